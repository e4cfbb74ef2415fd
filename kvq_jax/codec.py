"""The codec interface every storage format implements, and the shared argument checks.

A codec turns a [T, H, D] bf16/fp16/fp32 tensor into a `PackedKV` and back. Its `pack` and
`unpack` are the *reference* (XLA) paths: `unpack` materializes the dequantized tensor, which a
serving attention kernel never does (it dequantizes in registers). Kernels live in
`kvq_jax.kernels` and are checked against these paths byte for byte.
"""

from __future__ import annotations

import abc
import math

import jax.numpy as jnp
import numpy as np

from kvq_jax.packed import PackedKV
from kvq_jax.spec import AXES, DEFAULT_AXIS, KINDS

#: Input/output dtypes the codecs accept.
FLOAT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def check_float_dtype(dtype, name: str) -> np.dtype:
    """Return `dtype` as a numpy dtype, or raise TypeError naming argument `name`."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name}: {dtype!r} is not a dtype") from e
    if dt not in FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {dt}")
    return dt


def check_values(values, name: str = "values") -> tuple[tuple[int, int, int], np.dtype]:
    """Check a [T, H, D] float tensor; return its (shape, dtype)."""
    shape = tuple(np.shape(values))
    if len(shape) != 3:
        raise ValueError(f"{name} must have rank 3 [T, H, D], got shape {shape}")
    if shape[1] < 1 or shape[2] < 1:
        raise ValueError(f"{name} must have H >= 1 and D >= 1, got shape {shape}")
    return shape, check_float_dtype(values.dtype, f"{name}.dtype")


def check_kind(kind) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return kind


def check_group_size(group_size) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int | np.integer):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return int(group_size)


class Codec(abc.ABC):
    """A storage format. Subclass, set the class attributes, implement `pack`/`unpack`, and
    add an instance to the registry with `kvq_jax.register_codec`.

    Class attributes:
      name: registry key ("int4", ...).
      array_fields: the PackedKV array fields this format fills.
      default_group_size: used when the caller passes group_size=None.
      fixed_group_size: True when the format admits only its default group size.
    """

    name: str
    array_fields: tuple[str, ...]
    default_group_size: int
    fixed_group_size: bool = False

    # -- static layout -----------------------------------------------------------------
    def resolve(self, shape, kind: str, axis: str | None, group_size: int | None):
        """Validate and default (axis, group_size) for values of `shape`; trace-time only."""
        check_kind(kind)
        axis = DEFAULT_AXIS[kind] if axis is None else axis
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES} or None, got {axis!r}")
        group_size = self.default_group_size if group_size is None else group_size
        return axis, check_group_size(group_size)

    @abc.abstractmethod
    def array_shapes(self, shape, axis: str, group_size: int) -> dict[str, tuple[tuple, np.dtype]]:
        """{field: (shape, dtype)} of every array a PackedKV of this format holds."""

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

    # -- data paths (reference / XLA) -----------------------------------------------------
    @abc.abstractmethod
    def pack(self, values: jnp.ndarray, *, kind: str, axis: str, group_size: int) -> PackedKV:
        """Quantize validated [T, H, D] values (axis/group_size already resolved)."""

    @abc.abstractmethod
    def unpack(self, packed: PackedKV, dtype: np.dtype) -> jnp.ndarray:
        """Reference dequantization to [T, H, D] in `dtype` (materializes the tensor)."""

    def _packed(self, arrays: dict, *, kind, axis, group_size, shape, dtype) -> PackedKV:
        return PackedKV(
            **arrays,
            format=self.name,
            kind=kind,
            axis=axis,
            group_size=group_size,
            shape=tuple(shape),
            dtype=np.dtype(dtype),
        )
