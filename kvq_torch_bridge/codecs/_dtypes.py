"""numpy <-> torch dtypes. Packed metadata holds numpy dtypes (equal to kvq_jax's), tensors
hold torch dtypes; numpy has no native bfloat16 / float8, so those map to ml_dtypes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from kvq_jax.core.checks import ShapeDtype

#: torch dtype -> numpy dtype, for every dtype a kvq array or a caller's tensor may have.
NUMPY_DTYPE: dict[torch.dtype, np.dtype] = {
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.bool: np.dtype(np.bool_),
}
#: numpy dtype -> torch dtype (the inverse of NUMPY_DTYPE).
TORCH_DTYPE: dict[np.dtype, torch.dtype] = {v: k for k, v in NUMPY_DTYPE.items()}


def numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """The numpy dtype of a torch dtype, or None if numpy / ml_dtypes has no equivalent."""
    return NUMPY_DTYPE.get(dtype)


def torch_dtype(dtype) -> torch.dtype:
    """A torch dtype, or anything `np.dtype` accepts (e.g. ml_dtypes.bfloat16) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    dt = np.dtype(dtype)
    try:
        return TORCH_DTYPE[dt]
    except KeyError:
        raise TypeError(f"no torch dtype for numpy dtype {dt}") from None


def dtype_name(dtype) -> str:
    """numpy-style name of a torch or numpy dtype ("bfloat16", "int32", ...), for messages."""
    if isinstance(dtype, torch.dtype):
        dt = NUMPY_DTYPE.get(dtype)
        return str(dtype) if dt is None else str(dt)
    return str(np.dtype(dtype))


def meta(x):
    """The shape and numpy dtype of a torch tensor (`kvq_jax.core.checks.ShapeDtype`), which is
    what the shared argument checks read; anything else (numpy arrays, None) passes through.
    A dtype numpy cannot name (e.g. complex32) is kept as the torch dtype, for the message."""
    if isinstance(x, torch.Tensor):
        dt = numpy_dtype(x.dtype)
        return ShapeDtype(tuple(x.shape), dt if dt is not None else x.dtype)
    return x


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor (any device) -> a NumPy array with its dtype (ml_dtypes for bfloat16 and
    float8) and bytes, through a bit view (numpy has no native bfloat16 / float8)."""
    dtype = NUMPY_DTYPE[tensor.dtype]
    raw = tensor.detach().cpu().contiguous()
    if tensor.dtype != torch.bool:
        raw = raw.view(BITS[tensor.element_size()])
    return raw.numpy().view(dtype)


def from_numpy(array: np.ndarray, device=None) -> torch.Tensor:
    """A NumPy array (ml_dtypes included) -> a tensor with its bytes on `device` (a copy)."""
    a = np.ascontiguousarray(array)
    raw = a if a.dtype == np.bool_ else a.view(_NP_BITS[a.dtype.itemsize])
    return torch.from_numpy(raw.copy()).view(TORCH_DTYPE[a.dtype]).to(device)


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
