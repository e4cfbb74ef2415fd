"""Zero-copy handoff of packed KV between JAX and Torch through DLPack.

    torch_packed = to_torch(jax_packed)     # PackedKV, KVResidual, WindowedKV or LoopCode
    jax_packed = from_torch(torch_packed)

Every array crosses by DLPack and shares its buffer: the result's data pointer is the
source's (checked on every call, not assumed). The metadata (format, kind, axis, group size,
shape, dtype, window) is carried over unchanged. DLPack keeps the producer's buffer alive, so
the source may be dropped after the conversion. On CUDA the DLPack protocol passes the
consumer's stream, so the producer's pending work is ordered before the consumer's.

Buffers that cannot be shared are never copied silently. `copy` decides:
  None  (default) share when possible; otherwise make an explicit copy and emit a
        `CopyWarning` naming the reason (XLA on CPU needs 64-byte-aligned buffers; a torch
        view at an odd offset is not).
  False share or raise ValueError.
  True  always return an independent copy (DLPack import with copy=True was seen to still
        share memory on CPU, so the copy is made explicitly).
float4/int4 dtypes do not cross DLPack; kvq ships 4-bit codes as packed uint8.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import torch

import kvq_jax
from kvq_torch_bridge.codecs import loops as torch_loops
from kvq_torch_bridge.codecs import packed as torch_packed

#: JAX class -> Torch class for every packed container (same field names, same metadata).
_TO_TORCH = {
    kvq_jax.PackedKV: torch_packed.PackedKV,
    kvq_jax.KVResidual: torch_packed.KVResidual,
    kvq_jax.WindowedKV: torch_packed.WindowedKV,
    kvq_jax.LoopCode: torch_loops.LoopCode,
}
_TO_JAX = {v: k for k, v in _TO_TORCH.items()}
#: XLA:CPU imports a DLPack buffer without a copy only at this alignment.
CPU_ALIGNMENT = 64


class CopyWarning(UserWarning):
    """A buffer could not be shared between the stacks and was copied."""


def _check_copy(copy) -> None:
    if copy not in (None, True, False):
        raise TypeError(f"copy must be None, True or False, got {copy!r}")


def _shared(src_ptr: int, dst_ptr: int, numel: int) -> bool:
    return numel == 0 or src_ptr == dst_ptr


def jax_to_torch(array: jax.Array, *, copy: bool | None = None) -> torch.Tensor:
    """One JAX array -> torch tensor on the same device, sharing its buffer (see module doc)."""
    _check_copy(copy)
    if not isinstance(array, jax.Array):
        raise TypeError(f"array must be a jax.Array, got {type(array).__name__}")
    if len(array.devices()) != 1:
        raise ValueError(
            "array is sharded over several devices; DLPack exports one buffer: "
            "gather it or convert each shard (array.addressable_shards)"
        )
    tensor = torch.from_dlpack(array)
    if copy:
        return tensor.clone()
    if not _shared(array.unsafe_buffer_pointer(), tensor.data_ptr(), tensor.numel()):
        _not_shared(copy, "the DLPack import did not share the buffer")
    return tensor


def torch_to_jax(tensor: torch.Tensor, *, copy: bool | None = None) -> jax.Array:
    """One torch tensor -> JAX array on the same device, sharing its buffer (see module doc)."""
    _check_copy(copy)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    if copy:
        return jax.dlpack.from_dlpack(tensor.contiguous().clone())  # owned by the result alone
    reason = None
    if tensor.device.type == "cpu" and tensor.numel() and tensor.data_ptr() % CPU_ALIGNMENT:
        reason = (
            f"the CPU buffer is not {CPU_ALIGNMENT}-byte aligned (data_ptr % "
            f"{CPU_ALIGNMENT} = {tensor.data_ptr() % CPU_ALIGNMENT}), which XLA requires"
        )
    else:
        try:
            array = jax.dlpack.from_dlpack(tensor)
        except Exception as e:
            reason = f"DLPack import failed ({type(e).__name__}: {e})"
        else:
            if _shared(tensor.data_ptr(), array.unsafe_buffer_pointer(), tensor.numel()):
                return array
            reason = "the DLPack import did not share the buffer"
    _not_shared(copy, reason)
    return jax.dlpack.from_dlpack(tensor.contiguous().clone())


def _not_shared(copy, reason: str) -> None:
    if copy is False:
        raise ValueError(
            f"cannot share the buffer without a copy: {reason} (pass copy=None "
            f"to copy with a warning, or copy=True)"
        )
    warnings.warn(f"copied instead of shared: {reason}", CopyWarning, stacklevel=3)


def _is_data(value, classes: dict) -> bool:
    """Arrays and containers are data; static metadata (shape tuples, names) is not."""
    if isinstance(value, tuple):
        return bool(value) and all(_is_data(v, classes) for v in value)
    return isinstance(value, jax.Array | torch.Tensor) or type(value) in classes


def _convert(obj, classes: dict, convert_array):
    """Rebuild `obj` with the counterpart classes, converting every array leaf."""
    if obj is None:
        return None
    if isinstance(obj, tuple):
        return tuple(_convert(o, classes, convert_array) for o in obj)
    target = classes.get(type(obj))
    if target is None:
        return convert_array(obj)
    values = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if _is_data(value, classes):
            value = _convert(value, classes, convert_array)
        values[field.name] = value
    return target(**values)


def to_torch(packed, *, copy: bool | None = None):
    """A kvq_jax PackedKV / KVResidual / WindowedKV / LoopCode (or a plain jax.Array) -> the
    kvq_torch_bridge equivalent, every array shared through DLPack."""
    _check_copy(copy)
    if not isinstance(packed, jax.Array) and type(packed) not in _TO_TORCH:
        raise TypeError(
            f"packed must be a kvq_jax packed container or jax.Array, got {type(packed).__name__}"
        )
    return _convert(packed, _TO_TORCH, lambda a: jax_to_torch(a, copy=copy))


def from_torch(packed, *, copy: bool | None = None):
    """A kvq_torch_bridge PackedKV / KVResidual / WindowedKV / LoopCode (or a torch.Tensor) ->
    the kvq_jax equivalent, every array shared through DLPack where XLA allows it."""
    _check_copy(copy)
    if not isinstance(packed, torch.Tensor) and type(packed) not in _TO_JAX:
        raise TypeError(
            f"packed must be a kvq_torch_bridge packed container or torch.Tensor, "
            f"got {type(packed).__name__}"
        )
    return _convert(packed, _TO_JAX, lambda t: torch_to_jax(t, copy=copy))
