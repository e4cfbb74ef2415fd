"""Paged KV in torch (mirrors kvq_jax.cache.paged): the codecs applied page by page to
[P, page_size, H, D] pages, with the bytes of `kvq_jax.pack_paged`.

Every page is packed on its own (token groups never span two pages; NVFP4 gets one global
scale per page), and the result is a `PackedKV` whose arrays carry a leading page axis
(`batch_shape == (P,)`). Group sizes are resolved by `kvq_jax.cache.paged.resolve_paged`.

Vectorized where the format allows: a format without per-tensor state (INT4, FP8, and any
registered codec whose arrays all scale with the tokens) has no group crossing a page boundary
(token groups divide page_size, channel groups live in one row), so packing the flattened
[P * page_size, H, D] tensor and splitting the leading axis gives each page's bytes. NVFP4
computes its global scale per page and applies it through views with a leading page axis. A
registered codec with per-tensor state is packed page by page with its own `pack`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from kvq_jax.core import checks
from kvq_jax.core.cache_config import resolve_paged
from kvq_jax.core.constants import packed_width
from kvq_torch_bridge.codecs import _grouping, _nibbles
from kvq_torch_bridge.codecs._dtypes import meta, torch_dtype
from kvq_torch_bridge.codecs._numerics import widen
from kvq_torch_bridge.codecs.api import unpack_kv
from kvq_torch_bridge.codecs.codec import check_float_dtype, check_tensor
from kvq_torch_bridge.codecs.formats import nvfp4
from kvq_torch_bridge.codecs.packed import PackedKV
from kvq_torch_bridge.codecs.registry import get_codec

__all__ = ["check_pages", "pack_paged", "page_storage_bytes", "unpack_paged"]


def check_pages(pages) -> tuple[int, int, int, int]:
    """Validate torch [P, page_size, H, D] pages; return the shape (kvq_jax's messages)."""
    return checks.check_pages(meta(check_tensor(pages, "pages")))


def _flat(codec, page_shape, axis: str, group_size: int) -> bool:
    """Whether pages of this format pack as their flattened rows: every array's leading axis
    doubles when the tokens do (no per-tensor state such as NVFP4's global scale)."""
    t, h, d = page_shape
    one = codec.array_shapes((t, h, d), axis, group_size)
    two = codec.array_shapes((2 * t, h, d), axis, group_size)
    return all(len(s) and two[name][0][0] == 2 * s[0] for name, (s, _) in one.items())


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
    rows: torch.Tensor | None = None,
) -> PackedKV:
    """Pack every page of torch `pages` [P, page_size, H, D] on its own; the bytes of
    `kvq_jax.pack_paged`. `group_size` defaults as in `kvq_jax.core.cache_config.resolve_paged`
    (token-axis groups must divide page_size). `rows`: uint8 [P, page_size / G, H], each
    page's heavy rows for a heavy-row format that takes them (values: those chosen from the
    keys of the same tokens), else None. Returns a `PackedKV` with a leading page axis.
    Any registered format works (see the module doc for the vectorized paths).
    """
    num_pages, page_size, h, d = check_pages(pages)
    page_shape = (page_size, h, d)
    codec = get_codec(format)
    axis, group_size = resolve_paged(format, kind, page_shape, axis, group_size)
    take_rows = {}
    if rows is not None:
        if not hasattr(codec, "heavy_group"):
            raise ValueError(f"rows: format {format!r} stores no heavy rows; pass rows=None")
        check_tensor(rows, "rows")
        want = (num_pages, page_size // codec.heavy_group, h)
        if tuple(rows.shape) != want or rows.dtype != torch.uint8:
            raise ValueError(f"rows must be uint8 {list(want)} (pages, heavy groups per page, "
                             f"H), got {rows.dtype} {list(rows.shape)}")  # fmt: skip
        take_rows = {"rows": rows.reshape(-1, h)}
    if format == "nvfp4":
        return _pack_nvfp4_pages(pages, kind=kind, axis=axis, group_size=group_size)
    shapes = codec.array_shapes(page_shape, axis, group_size)
    if _flat(codec, page_shape, axis, group_size):
        # No group crosses a page and no state is per tensor: pack the flattened pages.
        packed = codec.pack(pages.reshape(num_pages * page_size, h, d), kind=kind, axis=axis,
                            group_size=group_size, **take_rows)  # fmt: skip
        arrays = {n: a.reshape(num_pages, *shapes[n][0]) for n, a in packed.arrays.items()}
    else:
        each = [
            codec.pack(p, kind=kind, axis=axis, group_size=group_size,
                       **({"rows": rows[i]} if take_rows else {})).arrays
            for i, p in enumerate(pages)
        ]  # fmt: skip
        arrays = {
            n: _stack([e[n] for e in each], shape, dt, pages.device)
            for n, (shape, dt) in shapes.items()
        }
    return _paged_packed(arrays, format, kind, axis, group_size, page_shape, pages.dtype)


def _stack(pages: list, page_shape, dtype, device) -> torch.Tensor:
    """Per-page tensors -> one tensor with a leading page axis (also for zero pages)."""
    if pages:
        return torch.stack(pages)
    return torch.zeros((0, *page_shape), dtype=torch_dtype(dtype), device=device)


def _check_paged(packed) -> int:
    return checks.check_packed_pages(packed, PackedKV)


@torch.no_grad()
def unpack_paged(packed: PackedKV, dtype=None) -> torch.Tensor:
    """Packed pages (leading page axis) -> [P, page_size, H, D] in `dtype` (reference path)."""
    num_pages = _check_paged(packed)
    dtype = np.dtype(packed.dtype if dtype is None else check_float_dtype(dtype, "dtype"))
    page_size, h, d = packed.shape
    flat_shape = (num_pages * page_size, h, d)
    codec = get_codec(packed.format)
    if packed.format == "nvfp4":
        layout = _grouping.GroupLayout(flat_shape, packed.axis, packed.group_size)
        meta_shape = layout.metadata_shape
        _, g_groups = _page_scales(packed.global_scale, layout, page_size)
        codes = packed.codes.reshape(num_pages * page_size, h, packed_width(d))
        out = nvfp4.dequantize(codes, packed.block_scale.reshape(meta_shape), g_groups, layout)
        return out.to(torch_dtype(dtype)).reshape(num_pages, page_size, h, d).contiguous()
    if not _flat(codec, packed.shape, packed.axis, packed.group_size):
        pages = [
            unpack_kv(
                dataclasses.replace(packed, **{n: a[i] for n, a in packed.arrays.items()}), dtype
            )
            for i in range(num_pages)
        ]
        return _stack(pages, packed.shape, dtype, packed.codes.device)
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
