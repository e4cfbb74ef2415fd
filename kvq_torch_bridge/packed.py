"""Torch containers with kvq_jax's field names and static metadata: `PackedKV`, `WindowedKV`
and `KVResidual` holding torch tensors.

The static metadata is the same Python values as in kvq_jax (`dtype` is a *numpy* dtype, e.g.
``np.dtype(ml_dtypes.bfloat16)``, and `window` a `kvq_jax.Window`), so metadata compares equal
across stacks; `torch_dtype` gives the torch dtype. Every class is registered as a
`torch.utils._pytree` node (arrays are children, metadata is the context), for `tree_map`,
`torch.compile` and `torch.export`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from kvq_jax.core.containers import (
    ARRAY_FIELDS,
    META_FIELDS,
    KVResidualMixin,
    PackedKVMixin,
    WindowedKVMixin,
)
from kvq_jax.core.window import Window
from kvq_torch_bridge._dtypes import torch_dtype

__all__ = ["KVResidual", "PackedKV", "WindowedKV", "register_pytree"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedKV(PackedKVMixin):
    """A packed KV tensor of logical shape `shape` = (T, H, D) and input dtype `dtype`.

    Array fields by format (docs/FORMAT.md); unused ones are None:
      int4:     codes uint8 [T, H, ceil(D/2)], minimum / scale float16 [metadata shape]
      nvfp4:    codes uint8 [T, H, ceil(D/2)], block_scale float8_e4m3fn [metadata shape],
                global_scale float32 []
      fp8_e4m3: codes float8_e4m3fn [T, H, D], scale float32 [T, H]
    metadata shape: [ceil(T/G), H, D] for axis "tokens", [T, H, ceil(D/G)] for "channels".
    Arrays are contiguous torch tensors on the device of the packed input.
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

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        return torch_dtype(self.dtype)

    @property
    def device(self) -> torch.device:
        return self.codes.device


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

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.middle.torch_dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVResidual(KVResidualMixin):
    """One loop stored as a delta against the reconstructed previous loop.

    payload:   PackedKV of the delta of the quantized rows, [M, H, D].
    positions: int32 [N] rows of [0, T) this residual owns (None: dense, every row).
    head/tail: raw rows of the current loop kept by the window (None without a window),
               [h, H, D] and [t, H, D] in the input dtype.
    shape:     (T, H, D) of the full loop.
    window:    the `kvq_jax.Window`, or None.
    """

    payload: PackedKV
    positions: Any = None
    head: Any = None
    tail: Any = None
    shape: tuple[int, int, int]
    window: Window | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.payload.torch_dtype


def register_pytree(cls, data_fields, meta_fields) -> None:
    """Register a frozen dataclass as a torch pytree node.

    The children are the `data_fields` that are not None (as in JAX, an absent array is no
    leaf; torch's pytree would otherwise make None a leaf); the context is the tuple of the
    present field names followed by the `meta_fields` values (all hashable).
    """
    data_fields, meta_fields = tuple(data_fields), tuple(meta_fields)

    def _present(obj):
        return tuple(name for name in data_fields if getattr(obj, name) is not None)

    def flatten(obj):
        present = _present(obj)
        context = (present, *(getattr(obj, name) for name in meta_fields))
        return [getattr(obj, name) for name in present], context

    def unflatten(children, context):
        present, *meta = context
        return cls(
            **dict(zip(present, children, strict=True)),
            **dict(zip(meta_fields, meta, strict=True)),
        )

    def flatten_with_keys(obj):
        children, context = flatten(obj)
        keys = [pytree.GetAttrKey(name) for name in context[0]]
        return list(zip(keys, children, strict=True)), context

    pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )


register_pytree(PackedKV, ARRAY_FIELDS, META_FIELDS)
register_pytree(WindowedKV, ("head", "tail", "middle"), ("window", "shape"))
register_pytree(KVResidual, ("payload", "positions", "head", "tail"), ("shape", "window"))
