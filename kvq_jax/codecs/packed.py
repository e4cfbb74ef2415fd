"""JAX containers: `PackedKV` (one quantized [T, H, D] tensor) and `WindowedKV` (raw window rows
around a packed middle), pytrees of arrays with static metadata."""

from __future__ import annotations

import jax

from kvq_jax.core.containers import ARRAY_FIELDS, META_FIELDS, PackedKVBase, WindowedKVBase


class PackedKV(PackedKVBase):
    """A packed KV tensor of jax arrays (fields: `kvq_jax.core.containers.PackedKVBase`)."""


jax.tree_util.register_dataclass(
    PackedKV, data_fields=list(ARRAY_FIELDS), meta_fields=list(META_FIELDS)
)


class WindowedKV(WindowedKVBase):
    """Raw window rows around a packed middle, jax arrays (`WindowedKVBase`)."""


jax.tree_util.register_dataclass(
    WindowedKV, data_fields=["head", "tail", "middle"], meta_fields=["window", "shape"]
)
