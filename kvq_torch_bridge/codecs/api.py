"""The Torch codec entry points: `pack_kv` and `unpack_kv` (mirror kvq_jax.codecs.api).

Format, kind, axis, group size, window and output dtype are checked from shapes and dtypes
alone, before any device work; nothing here reads the data back to the host (no `.item()`,
no data-dependent Python control flow), so the calls queue asynchronously on CUDA. The entry
points run under `torch.no_grad()`: packed caches never hold an autograd graph.
"""

from __future__ import annotations

import numpy as np
import torch

from kvq_jax.core.window import Window, check_window, split_rows
from kvq_torch_bridge.codecs._dtypes import torch_dtype
from kvq_torch_bridge.codecs.codec import check_float_dtype, check_values
from kvq_torch_bridge.codecs.packed import PackedKV, WindowedKV
from kvq_torch_bridge.codecs.registry import get_codec

__all__ = ["join_rows", "own_rows", "pack_kv", "unpack_kv"]


def own_rows(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that owns its storage (window rows must not alias a caller's cache)."""
    return x.clone(memory_format=torch.contiguous_format)


def join_rows(head, middle, tail) -> torch.Tensor:
    return torch.cat([head, middle, tail], dim=0)


@torch.no_grad()
def pack_kv(
    values: torch.Tensor,
    *,
    kind: str,
    format: str = "int4",
    group_size: int | None = None,
    axis: str | None = None,
    window: Window | None = None,
) -> PackedKV | WindowedKV:
    """Quantize a KV tensor; the same bytes as `kvq_jax.pack_kv`.

    Args:
      values: torch [T, H, D] bfloat16, float16 or float32 on any device (contiguous or not).
      kind: "key" or "value"; picks the default grouping axis.
      format: a registered format, "int4" (default), "nvfp4" or "fp8_e4m3".
      group_size: elements per group along `axis` (int4: any >= 1, default 64; nvfp4: 16;
        fp8_e4m3: D, one scale per token and head).
      axis: "tokens" (default for keys) or "channels" (default for values).
      window: a `kvq_jax.Window`: keep the first `sink` and last `recent` rows in the input
        dtype (copied) and pack only the middle rows.

    Returns:
      A `PackedKV` of torch tensors on `values.device`, or a `WindowedKV`.
    """
    shape, _ = check_values(values)
    codec = get_codec(format)
    axis, group_size = codec.resolve(shape, kind, axis, group_size)
    if check_window(window) is None:
        return codec.pack(values, kind=kind, axis=axis, group_size=group_size)
    head, middle, tail = split_rows(values, window)
    packed = codec.pack(middle, kind=kind, axis=axis, group_size=group_size)
    return WindowedKV(
        head=own_rows(head), tail=own_rows(tail), middle=packed, window=window, shape=shape
    )


@torch.no_grad()
def unpack_kv(packed: PackedKV | WindowedKV, dtype=None) -> torch.Tensor:
    """Dequantize to a contiguous [T, H, D] tensor in `dtype` (a torch or numpy dtype; default:
    the dtype it was packed from). A `WindowedKV` returns its window rows exactly."""
    if not isinstance(packed, PackedKV | WindowedKV):
        raise TypeError(f"packed must be a PackedKV or WindowedKV, got {type(packed).__name__}")
    dtype = np.dtype(packed.dtype if dtype is None else check_float_dtype(dtype, "dtype"))
    if isinstance(packed, WindowedKV):
        middle = unpack_kv(packed.middle, dtype)
        td = torch_dtype(dtype)
        return join_rows(packed.head.to(td), middle, packed.tail.to(td))
    return get_codec(packed.format).unpack(packed, dtype)
