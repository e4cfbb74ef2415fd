"""Torch containers with kvq_jax's field names and static metadata: `PackedKV`, `WindowedKV`
and `KVResidual` holding torch tensors.

The static metadata is the same Python values as in kvq_jax (`dtype` is a *numpy* dtype, e.g.
``np.dtype(ml_dtypes.bfloat16)``, and `window` a `kvq_jax.Window`), so metadata compares equal
across stacks; `torch_dtype` gives the torch dtype. Every class is registered as a
`torch.utils._pytree` node (arrays are children, metadata is the context), for `tree_map`,
`torch.compile` and `torch.export`.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from kvq_jax.core.containers import (
    ARRAY_FIELDS,
    META_FIELDS,
    KVResidualBase,
    PackedKVBase,
    WindowedKVBase,
)
from kvq_torch_bridge.codecs._dtypes import torch_dtype

__all__ = ["KVResidual", "PackedKV", "WindowedKV", "register_pytree"]


class PackedKV(PackedKVBase):
    """A packed KV tensor of contiguous torch tensors on the device of the packed input
    (fields: `kvq_jax.core.containers.PackedKVBase`)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        return torch_dtype(self.dtype)

    @property
    def device(self) -> torch.device:
        return self.codes.device


class WindowedKV(WindowedKVBase):
    """Raw window rows around a packed middle, torch tensors (`WindowedKVBase`)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.middle.torch_dtype


class KVResidual(KVResidualBase):
    """One loop as a packed delta, torch tensors (`KVResidualBase`)."""

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
register_pytree(
    KVResidual, ("payload", "positions", "head", "tail"), ("shape", "window", "absolute")
)
