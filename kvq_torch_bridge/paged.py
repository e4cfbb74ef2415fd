"""Paged KV in torch (mirrors kvq_jax.paged): the codecs applied page by page to
[P, page_size, H, D] pages, with the bytes of `kvq_jax.pack_paged`.

Every page is packed on its own (token groups never span two pages; NVFP4 gets one global
scale per page), and the result is a `PackedKV` whose arrays carry a leading page axis
(`batch_shape == (P,)`). Group sizes are resolved by `kvq_jax.paged.resolve_paged`.

Vectorized, no loop over pages: INT4 and FP8 groups never cross a page boundary (token groups
divide page_size, channel groups live in one row), so packing the flattened
[P * page_size, H, D] tensor and splitting the leading axis gives each page's bytes. NVFP4
computes its global scale per page and applies it through views with a leading page axis.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvq_jax.paged import resolve_paged
from kvq_jax.spec import packed_width
from kvq_torch_bridge import _grouping, _nibbles
from kvq_torch_bridge._dtypes import torch_dtype
from kvq_torch_bridge._numerics import (
    widen,
)
from kvq_torch_bridge.api import pack_kv
from kvq_torch_bridge.codec import check_float_dtype
from kvq_torch_bridge.formats import nvfp4
from kvq_torch_bridge.packed import PackedKV
from kvq_torch_bridge.registry import get_codec

__all__ = ["check_pages", "pack_paged", "page_storage_bytes", "unpack_paged"]

#: Formats without per-tensor state: a page's bytes are those of its rows in a flat packing.
_FLAT_FORMATS = ("int4", "fp8_e4m3")


def check_pages(pages) -> tuple[int, int, int, int]:
    """Validate torch [P, page_size, H, D] pages; return the shape (kvq_jax's messages)."""
    if not isinstance(pages, torch.Tensor):
        raise TypeError(f"pages must be a torch.Tensor, got {type(pages).__name__}")
    if pages.ndim != 4:
        raise ValueError(
            f"pages must have rank 4 [P, page_size, H, D], got shape {tuple(pages.shape)}"
        )
    check_float_dtype(pages.dtype, "pages.dtype")
    num_pages, page_size, h, d = pages.shape
    if page_size < 1 or h < 1 or d < 1:
        raise ValueError(f"pages must have page_size, H, D >= 1, got shape {tuple(pages.shape)}")
    return num_pages, page_size, h, d


def _page_scales(g: torch.Tensor, layout: _grouping.GroupLayout, page_size: int):
    """One encode scale per page, [P] -> (per row of the flat [P * page_size, H, D] tensor,
    per group of `layout`): the max of a per-row constant over a group is that constant, and
    no group spans two pages."""
    g_rows = g.repeat_interleave(page_size).reshape(-1, 1, 1)
    g_groups = layout.reduce(torch.amax, g_rows.expand(layout.shape))
    return g_rows, g_groups


def _pack_nvfp4_pages(pages: torch.Tensor, *, kind, axis, group_size) -> PackedKV:
    """NVFP4 with one global scale per page, vectorized over pages: the codec's `quantize`
    on the flattened pages, with g given per row and per group."""
    num_pages, page_size, h, d = pages.shape
    flat = (num_pages * page_size, h, d)
    layout = _grouping.GroupLayout(flat, axis, group_size)
    x = widen(pages.reshape(flat))
    x_pages = x.reshape(num_pages, page_size * h * d)
    finite = torch.isfinite(x_pages).all(dim=1)  # [P]
    amax = x_pages.abs().amax(dim=1) if num_pages else x_pages.new_zeros((0,))
    g = nvfp4.global_scale_from_amax(amax)  # [P]
    g_rows, g_groups = _page_scales(g, layout, page_size)
    codes, s8 = nvfp4.quantize(x, g_rows, layout, g_groups=g_groups)
    finite_rows = finite.repeat_interleave(page_size).reshape(-1, 1, 1)
    finite_groups = layout.reduce(torch.amax, finite_rows.expand(flat).to(torch.uint8)) > 0
    codes = torch.where(finite_rows, codes, 0)
    block_bits = torch.where(finite_groups, s8.view(torch.uint8), nvfp4.E4M3_NAN_BITS)
    page_shape = (page_size, h, d)
    shapes = get_codec("nvfp4").array_shapes(page_shape, axis, group_size)
    arrays = {
        "codes": _nibbles.pack_nibbles(codes).reshape(num_pages, *shapes["codes"][0]),
        "block_scale": block_bits.view(torch.float8_e4m3fn).reshape(
            num_pages, *shapes["block_scale"][0]
        ),
        "global_scale": torch.where(finite, g, math.nan),
    }
    return _paged_packed(arrays, "nvfp4", kind, axis, group_size, page_shape, pages.dtype)


def _paged_packed(arrays, format, kind, axis, group_size, page_shape, dtype) -> PackedKV:
    return PackedKV(
        **{name: a.contiguous() for name, a in arrays.items()},
        format=format,
        kind=kind,
        axis=axis,
        group_size=group_size,
        shape=tuple(page_shape),
        dtype=check_float_dtype(dtype, "dtype"),
    )


@torch.no_grad()
def pack_paged(
    pages: torch.Tensor,
    *,
    kind: str,
    format: str = "int4",
    group_size: int | None = None,
    axis: str | None = None,
) -> PackedKV:
    """Pack every page of torch `pages` [P, page_size, H, D] on its own; the bytes of
    `kvq_jax.pack_paged`. `group_size` defaults as in `kvq_jax.paged.resolve_paged`
    (token-axis groups must divide page_size). Returns a `PackedKV` with a leading page axis.
    """
    num_pages, page_size, h, d = check_pages(pages)
    page_shape = (page_size, h, d)
    axis, group_size = resolve_paged(format, kind, page_shape, axis, group_size)
    get_codec(format).resolve(page_shape, kind, axis, group_size)  # the torch codec agrees
    if format == "nvfp4":
        return _pack_nvfp4_pages(pages, kind=kind, axis=axis, group_size=group_size)
    if format not in _FLAT_FORMATS:
        raise NotImplementedError(
            f"kvq_torch_bridge.pack_paged has no paged path for format {format!r}"
        )
    # Groups never cross a page (token groups divide page_size; channel groups are per row),
    # and these formats have no per-tensor state: pack the flattened pages, split the axis.
    flat = pack_kv(
        pages.reshape(num_pages * page_size, h, d),
        kind=kind,
        format=format,
        group_size=group_size,
        axis=axis,
    )
    shapes = get_codec(format).array_shapes(page_shape, axis, group_size)
    arrays = {name: a.reshape(num_pages, *shapes[name][0]) for name, a in flat.arrays.items()}
    return _paged_packed(arrays, format, kind, axis, group_size, page_shape, pages.dtype)


def _check_paged(packed) -> int:
    if not isinstance(packed, PackedKV) or len(packed.batch_shape) != 1:
        raise TypeError("packed must be a PackedKV with one leading page axis (from pack_paged)")
    return packed.batch_shape[0]


@torch.no_grad()
def unpack_paged(packed: PackedKV, dtype=None) -> torch.Tensor:
    """Packed pages (leading page axis) -> [P, page_size, H, D] in `dtype` (reference path)."""
    num_pages = _check_paged(packed)
    dtype = np.dtype(packed.dtype if dtype is None else check_float_dtype(dtype, "dtype"))
    page_size, h, d = packed.shape
    flat_shape = (num_pages * page_size, h, d)
    if packed.format == "nvfp4":
        layout = _grouping.GroupLayout(flat_shape, packed.axis, packed.group_size)
        meta = layout.metadata_shape
        _, g_groups = _page_scales(packed.global_scale, layout, page_size)
        codes = packed.codes.reshape(num_pages * page_size, h, packed_width(d))
        out = nvfp4.dequantize(codes, packed.block_scale.reshape(meta), g_groups, layout)
        return out.to(torch_dtype(dtype)).reshape(num_pages, page_size, h, d).contiguous()
    if packed.format not in _FLAT_FORMATS:
        raise NotImplementedError(
            f"kvq_torch_bridge.unpack_paged has no paged path for format {packed.format!r}"
        )
    codec = get_codec(packed.format)
    shapes = codec.array_shapes(flat_shape, packed.axis, packed.group_size)
    flat = PackedKV(
        **{name: a.reshape(shapes[name][0]) for name, a in packed.arrays.items()},
        format=packed.format,
        kind=packed.kind,
        axis=packed.axis,
        group_size=packed.group_size,
        shape=flat_shape,
        dtype=packed.dtype,
    )
    return codec.unpack(flat, dtype).reshape(num_pages, page_size, h, d)


def page_storage_bytes(packed: PackedKV) -> int:
    """Bytes one page occupies (every page of a packed cache costs the same)."""
    return packed.storage_bytes // _check_paged(packed)
