"""The Torch codec interface (mirrors kvq_jax.codec) and the shared argument checks.

A codec turns a [T, H, D] bf16/fp16/fp32 torch tensor into a `PackedKV` of torch tensors and
back, with the bytes of kvq_jax and of the scalar oracle (docs/FORMAT.md). Argument checks
raise the same exceptions with the same messages as kvq_jax; they read shapes and dtypes only,
never the data.
"""

from __future__ import annotations

import abc
import math

import numpy as np
import torch

from kvq_jax import codec as _jax_codec
from kvq_jax.codec import FLOAT_DTYPES, check_group_size, check_kind
from kvq_jax.spec import AXES, DEFAULT_AXIS
from kvq_torch_bridge._dtypes import numpy_dtype
from kvq_torch_bridge.packed import PackedKV

__all__ = [
    "FLOAT_DTYPES",
    "Codec",
    "check_float_dtype",
    "check_group_size",
    "check_kind",
    "check_values",
]


def check_float_dtype(dtype, name: str) -> np.dtype:
    """A torch dtype or anything `np.dtype` accepts -> numpy dtype among FLOAT_DTYPES, or a
    TypeError naming argument `name` (kvq_jax's message)."""
    if isinstance(dtype, torch.dtype):
        dt = numpy_dtype(dtype)
        if dt is None:
            allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
            raise TypeError(f"{name} must have dtype in ({allowed}), got {dtype}")
        dtype = dt
    return _jax_codec.check_float_dtype(dtype, name)


def check_values(values, name: str = "values") -> tuple[tuple[int, int, int], np.dtype]:
    """Check a [T, H, D] float torch tensor; return its (shape, numpy dtype)."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    shape = tuple(values.shape)
    if len(shape) != 3:
        raise ValueError(f"{name} must have rank 3 [T, H, D], got shape {shape}")
    if shape[1] < 1 or shape[2] < 1:
        raise ValueError(f"{name} must have H >= 1 and D >= 1, got shape {shape}")
    return shape, check_float_dtype(values.dtype, f"{name}.dtype")


class Codec(abc.ABC):
    """A storage format for torch tensors. Subclass, set the class attributes, implement
    `array_shapes`/`pack`/`unpack`, and add an instance to the registry with
    `kvq_torch_bridge.registry.register_codec`.

    Class attributes:
      name: registry key ("int4", ...).
      array_fields: the PackedKV array fields this format fills.
      default_group_size: used when the caller passes group_size=None.
    """

    name: str
    array_fields: tuple[str, ...]
    default_group_size: int

    # -- static layout -----------------------------------------------------------------
    def resolve(self, shape, kind: str, axis: str | None, group_size: int | None):
        """Validate and default (axis, group_size) for values of `shape` (no data read)."""
        check_kind(kind)
        axis = DEFAULT_AXIS[kind] if axis is None else axis
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES} or None, got {axis!r}")
        group_size = self.default_group_size if group_size is None else group_size
        return axis, check_group_size(group_size)

    @abc.abstractmethod
    def array_shapes(self, shape, axis: str, group_size: int) -> dict[str, tuple[tuple, np.dtype]]:
        """{field: (shape, numpy dtype)} of every array a PackedKV of this format holds."""

    def metadata_shapes(self, shape, axis: str, group_size: int) -> dict[str, tuple]:
        """{field: shape} of the metadata arrays (every array but codes)."""
        return {
            k: s for k, (s, _) in self.array_shapes(shape, axis, group_size).items() if k != "codes"
        }

    def storage_bytes(self, shape, axis: str, group_size: int) -> int:
        """Bytes a packed tensor of logical `shape` occupies (all arrays, no overhead)."""
        return sum(
            math.prod(s) * np.dtype(dt).itemsize
            for s, dt in self.array_shapes(shape, axis, group_size).values()
        )

    # -- data paths --------------------------------------------------------------------
    @abc.abstractmethod
    def pack(self, values: torch.Tensor, *, kind: str, axis: str, group_size: int) -> PackedKV:
        """Quantize validated [T, H, D] values (axis/group_size already resolved)."""

    @abc.abstractmethod
    def unpack(self, packed: PackedKV, dtype: np.dtype) -> torch.Tensor:
        """Dequantize to [T, H, D] in `dtype` (a numpy dtype among FLOAT_DTYPES)."""

    def _packed(self, arrays: dict, *, kind, axis, group_size, shape, dtype) -> PackedKV:
        """Wrap the arrays, made contiguous (row-major, like every JAX array)."""
        return PackedKV(
            **{name: a.contiguous() for name, a in arrays.items()},
            format=self.name,
            kind=kind,
            axis=axis,
            group_size=group_size,
            shape=tuple(shape),
            dtype=check_float_dtype(dtype, "dtype"),
        )
