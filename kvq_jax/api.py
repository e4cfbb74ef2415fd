"""The public codec entry points: `pack_kv` and `unpack_kv`, jit-compiled.

Format, kind, axis, group size and output dtype are static: every argument error is raised
while tracing, before any device work, and never needs the data.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvq_jax.codec import check_float_dtype, check_values
from kvq_jax.packed import PackedKV
from kvq_jax.registry import get_codec


@functools.partial(jax.jit, static_argnames=("kind", "format", "group_size", "axis"))
def pack_kv(values, *, kind: str, format: str = "int4", group_size: int | None = None,  # noqa: A002
            axis: str | None = None) -> PackedKV:
    """Quantize a KV tensor.

    Args:
      values: [T, H, D] bfloat16, float16 or float32 (tokens x KV heads x channels).
      kind: "key" or "value"; picks the default grouping axis.
      format: a registered format, "int4" (default), "nvfp4" or "fp8_e4m3".
      group_size: elements per group along `axis` (int4: any >= 1, default 64; nvfp4: 16;
        fp8_e4m3: D, one scale per token and head).
      axis: "tokens" (default for keys) or "channels" (default for values).

    Returns:
      A `PackedKV` pytree (see its docstring for the array fields of each format).
    """
    values = jnp.asarray(values)
    shape, _ = check_values(values)
    codec = get_codec(format)
    axis, group_size = codec.resolve(shape, kind, axis, group_size)
    return codec.pack(values, kind=kind, axis=axis, group_size=group_size)


@functools.partial(jax.jit, static_argnames=("dtype",))
def unpack_kv(packed: PackedKV, dtype=None) -> jnp.ndarray:
    """Dequantize a `PackedKV` to [T, H, D] in `dtype` (default: the dtype it was packed from).

    This is the reference path: it materializes the tensor. Attention kernels dequantize in
    registers instead.
    """
    if not isinstance(packed, PackedKV):
        raise TypeError(f"packed must be a PackedKV, got {type(packed).__name__}")
    dtype = packed.dtype if dtype is None else check_float_dtype(dtype, "dtype")
    codec = get_codec(packed.format)
    return codec.unpack(packed, np.dtype(dtype))
