"""The public codec entry points: `pack_kv` and `unpack_kv`, jit-compiled.

Format, kind, axis, group size and output dtype are static: every argument error is raised
while tracing, before any device work, and never needs the data.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvq_jax.codecs.packed import PackedKV, WindowedKV
from kvq_jax.codecs.registry import get_codec
from kvq_jax.core.checks import check_values
from kvq_jax.core.codec_base import layer_arg
from kvq_jax.core.layouts import check_float_dtype
from kvq_jax.core.window import Window, check_window, split_rows


@functools.partial(jax.jit, static_argnames=("kind", "format", "group_size", "axis", "window"))
def pack_kv(
    values,
    *,
    kind: str,
    format: str = "int4",
    group_size: int | None = None,
    axis: str | None = None,
    window: Window | None = None,
    layer=None,
) -> PackedKV | WindowedKV:
    """Quantize a KV tensor.

    Args:
      values: [T, H, D] bfloat16, float16 or float32 (tokens x KV heads x channels).
      kind: "key" or "value"; picks the default grouping axis.
      format: a registered format, "int4" (default), "nvfp4" or "fp8_e4m3".
      group_size: elements per group along `axis` (int4: any >= 1, default 64; nvfp4: 16;
        fp8_e4m3: D, one scale per token and head).
      axis: "tokens" (default for keys) or "channels" (default for values).
      window: keep the first `window.sink` and last `window.recent` rows in the input dtype
        and pack only the middle rows (token groups are formed over those rows alone).
      layer: the model layer (an int or a traced int32 scalar) of a format with one table per
        layer (`kvq_jax.codecs.formats.intb.IntBLayersCodec`); ignored by the other formats.

    Returns:
      A `PackedKV` pytree (see its docstring for the array fields of each format), or a
      `WindowedKV` when a window is given.
    """
    values = jnp.asarray(values)
    shape, _ = check_values(values)
    codec = get_codec(format)
    axis, group_size = codec.resolve(shape, kind, axis, group_size)
    args = dict(kind=kind, axis=axis, group_size=group_size, **layer_arg(codec, layer))
    if check_window(window) is None:
        return codec.pack(values, **args)
    head, middle, tail = split_rows(values, window)
    packed = codec.pack(middle, **args)
    return WindowedKV(head=head, tail=tail, middle=packed, window=window, shape=shape)


@functools.partial(jax.jit, static_argnames=("dtype",))
def unpack_kv(packed: PackedKV | WindowedKV, dtype=None, layer=None) -> jnp.ndarray:
    """Dequantize to [T, H, D] in `dtype` (default: the dtype it was packed from).

    A `WindowedKV` returns its window rows exactly (cast to `dtype`). This is the reference
    path: it materializes the tensor. Attention kernels dequantize in registers instead.
    layer: the model layer (int or int32 scalar) of a format with one table per layer
    (`IntBLayersCodec`; `pack_kv`'s layer); the other formats ignore it.
    """
    if not isinstance(packed, PackedKV | WindowedKV):
        raise TypeError(f"packed must be a PackedKV or WindowedKV, got {type(packed).__name__}")
    dtype = np.dtype(packed.dtype if dtype is None else check_float_dtype(dtype, "dtype"))
    if isinstance(packed, WindowedKV):
        middle = unpack_kv(packed.middle, dtype, layer)
        return jnp.concatenate([packed.head.astype(dtype), middle, packed.tail.astype(dtype)])
    codec = get_codec(packed.format)
    return codec.unpack(packed, dtype, **layer_arg(codec, layer))
