"""JAX containers: `PackedKV` (one quantized [T, H, D] tensor) and `WindowedKV` (raw window rows
around a packed middle), pytrees of arrays with static metadata."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from kvq_jax.core.containers import ARRAY_FIELDS, META_FIELDS, PackedKVMixin, WindowedKVMixin
from kvq_jax.core.window import Window


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedKV(PackedKVMixin):
    """A packed KV tensor of logical shape `shape` = (T, H, D) and input dtype `dtype`.

    Array fields by format (docs/FORMAT.md); unused ones are None:
      int4:     codes uint8 [T, H, ceil(D/2)], minimum / scale float16 [metadata shape]
      nvfp4:    codes uint8 [T, H, ceil(D/2)], block_scale float8_e4m3fn [metadata shape],
                global_scale float32 []
      fp8_e4m3: codes float8_e4m3fn [T, H, D], scale float32 [T, H]
    metadata shape: [ceil(T/G), H, D] for axis "tokens", [T, H, ceil(D/G)] for "channels".

    Under `jax.vmap` the arrays gain leading batch axes; the static metadata stays per example.
    """

    codes: Any
    minimum: Any = None
    scale: Any = None
    block_scale: Any = None
    global_scale: Any = None
    format: str
    kind: str
    axis: str
    group_size: int
    shape: tuple[int, int, int]
    dtype: np.dtype


jax.tree_util.register_dataclass(
    PackedKV, data_fields=list(ARRAY_FIELDS), meta_fields=list(META_FIELDS)
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowedKV(WindowedKVMixin):
    """A [T, H, D] tensor whose window rows are stored raw and whose middle rows are packed.

    head: [h, H, D] and tail: [t, H, D] in the input dtype (h = min(sink, T),
    t = min(recent, T - h)); middle: PackedKV of the [T - h - t, H, D] middle rows.
    """

    head: Any
    tail: Any
    middle: PackedKV
    window: Window
    shape: tuple[int, int, int]


jax.tree_util.register_dataclass(
    WindowedKV, data_fields=["head", "tail", "middle"], meta_fields=["window", "shape"]
)
