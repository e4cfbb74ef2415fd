"""The Torch codec interface (mirrors kvq_jax.codecs.codec) and the shared argument checks.

A codec turns a [T, H, D] bf16/fp16/fp32 torch tensor into a `PackedKV` of torch tensors and
back, with the bytes of kvq_jax and of the scalar oracle (docs/FORMAT.md). Argument checks
raise the same exceptions with the same messages as kvq_jax; they read shapes and dtypes only,
never the data.
"""

from __future__ import annotations

import numpy as np
import torch

from kvq_jax.core import checks
from kvq_jax.core import layouts as _layouts
from kvq_jax.core.codec_base import CodecBase
from kvq_jax.core.layouts import FLOAT_DTYPES, check_group_size, check_kind
from kvq_torch_bridge.codecs._dtypes import meta, numpy_dtype
from kvq_torch_bridge.codecs.packed import PackedKV

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
    return _layouts.check_float_dtype(dtype, name)


def check_values(values, name: str = "values") -> tuple[tuple[int, int, int], np.dtype]:
    """Check a [T, H, D] float torch tensor; return its (shape, numpy dtype)."""
    check_tensor(values, name)
    check_float_dtype(values.dtype, f"{name}.dtype")  # torch dtypes numpy cannot name
    return checks.check_values(meta(values), name)


def check_tensor(x, name: str) -> torch.Tensor:
    """`x` is a torch.Tensor, else a TypeError naming argument `name`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


class Codec(CodecBase):
    """A storage format implemented in Torch: a `kvq_jax.core.layouts.FormatLayout` (the same
    names, group-size rules, array shapes and error messages as kvq_jax) plus `encode` /
    `unpack` on torch tensors; `pack` comes from `kvq_jax.core.codec_base.CodecBase`.
    """

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
