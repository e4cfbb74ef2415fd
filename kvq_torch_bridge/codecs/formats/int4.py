"""Grouped affine INT4 in torch (mirrors kvq_jax.codecs.formats.int4): FP16 minimum and scale per
group, any G >= 1. docs/FORMAT.md section 2. Codes are computed with the float32 minimum and
scale; the stored FP16 metadata is rounded afterwards and used by decode.
"""

from __future__ import annotations

import math

import torch

from kvq_jax.core.constants import INT4_LEVELS
from kvq_jax.core.layouts import Int4Layout
from kvq_torch_bridge.codecs import _grouping, _nibbles
from kvq_torch_bridge.codecs._dtypes import torch_dtype
from kvq_torch_bridge.codecs._numerics import F32, divide, flush_subnormal, round_half_even, widen
from kvq_torch_bridge.codecs.codec import Codec


def quantize(x: torch.Tensor, layout: _grouping.GroupLayout, levels=INT4_LEVELS):
    """float32 [T, H, D] -> (codes uint8 0..levels [T, H, D], minimum f16, scale f16 = span /
    levels [metadata shape]). levels: 15 (INT4), 3 (INT2), or a float32 tensor [H, D] of
    per-channel levels (INTB, axis tokens: it broadcasts against [T, H, D] and the metadata
    [ceil(T/G), H, D])."""
    mn = layout.reduce(torch.amin, x)
    mx = layout.reduce(torch.amax, x)
    # tested element-wise: a non-finite group must not depend on NaN handling of min/max
    finite = layout.reduce(torch.all, torch.isfinite(x))
    mn = torch.where(mn == 0, 0.0, mn)  # a zero minimum is stored as +0.0
    span = flush_subnormal(mx - mn)
    scale = torch.where(span > 0, flush_subnormal(divide(span, levels)), 1.0)
    q = round_half_even(divide(flush_subnormal(x - layout.expand(mn)), layout.expand(scale)))
    # clamp before the cast (float -> uint8 wraps in torch); NaN -> 0
    limit = levels if isinstance(levels, torch.Tensor) else float(levels)
    codes = torch.where(q >= 0, torch.clamp(q, max=limit), 0.0)
    codes = torch.where(layout.expand(finite), codes, 0.0).to(torch.uint8)
    minimum = torch.where(finite, mn, math.nan).to(torch.float16)
    scale = torch.where(finite, scale, math.nan).to(torch.float16)
    return codes, minimum, scale


def dequantize(codes, minimum, scale, layout: _grouping.GroupLayout) -> torch.Tensor:
    """uint8 codes [T, H, D] and per-group f16 metadata -> float32 values [T, H, D].

    code * scale16 is exact and the sum is a multiple of 2**-24, never float32-subnormal:
    no flush is needed (and a fused multiply-add would give the same bytes).
    """
    mn = layout.expand(minimum.to(F32))
    sc = layout.expand(scale.to(F32))
    return codes.to(F32) * sc + mn


class Int4Codec(Int4Layout, Codec):
    def encode(self, values, *, axis, group_size) -> dict:
        layout = _grouping.GroupLayout(tuple(values.shape), axis, group_size)
        codes, minimum, scale = quantize(widen(values), layout)
        return {"codes": _nibbles.pack_nibbles(codes), "minimum": minimum, "scale": scale}

    def unpack(self, packed, dtype) -> torch.Tensor:
        layout = _grouping.GroupLayout(packed.shape, packed.axis, packed.group_size)
        codes = _nibbles.unpack_nibbles(packed.codes, packed.shape[2])
        out = dequantize(codes, packed.minimum, packed.scale, layout)
        return out.to(torch_dtype(dtype)).contiguous()


CODEC = Int4Codec()
