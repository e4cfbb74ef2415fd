"""NVFP4 in torch (mirrors kvq_jax.codecs.formats.nvfp4): E2M1 codes, one E4M3 scale per 16
elements, one float32 global encode scale per packed tensor. docs/FORMAT.md section 3.
"""

from __future__ import annotations

import math

import torch

from kvq_jax.core.constants import (
    E2M1_MAX,
    F32_MAX,
    NVFP4_GLOBAL_NUMERATOR,
    NVFP4_GROUP_SIZE,
    NVFP4_ONE_SIXTH,
)
from kvq_jax.core.layouts import NVFP4Layout
from kvq_torch_bridge.codecs import _grouping, _nibbles
from kvq_torch_bridge.codecs._dtypes import torch_dtype
from kvq_torch_bridge.codecs._numerics import (
    F32,
    clamp_e4m3,
    divide,
    e2m1_decode,
    e2m1_encode,
    flush_subnormal,
    widen,
)
from kvq_torch_bridge.codecs.codec import Codec

GROUP_SIZE = NVFP4_GROUP_SIZE
#: The canonical E4M3 NaN pattern stored for non-finite input.
E4M3_NAN_BITS = 0x7F
_ONE_SIXTH = float(NVFP4_ONE_SIXTH)  # exactly a float32 value
_E2M1_MAX = float(E2M1_MAX)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """float32 amax (any shape) -> encode scale g, all-zero and tiny-tensor rules applied."""
    g = torch.where(amax == 0, 1.0, divide(NVFP4_GLOBAL_NUMERATOR, amax))
    return torch.where(torch.isinf(g), float(F32_MAX), g)


def global_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 tensor -> float32 [] encode scale g."""
    # (amax of an empty tensor raises in torch; T = 0 is known from the shape)
    amax = x.abs().amax() if x.numel() else torch.zeros((), dtype=F32, device=x.device)
    return global_scale_from_amax(amax)


def quantize(x: torch.Tensor, g: torch.Tensor, layout: _grouping.GroupLayout, g_groups=None):
    """float32 [T, H, D] and g -> (4-bit codes uint8 [T, H, D], e4m3 block scales).

    `g` broadcasts against x; `g_groups` (default `g`) against the block scales. Paged packing
    passes one g per page, as a per-row and a per-group tensor.
    """
    g_groups = g if g_groups is None else g_groups
    vmax = layout.reduce(torch.amax, x.abs())
    s = flush_subnormal(g_groups * flush_subnormal(vmax * _ONE_SIXTH))
    s8 = clamp_e4m3(s).to(torch.float8_e4m3fn)  # s >= 0: only the 448 bound matters
    sf = s8.to(F32)
    v = flush_subnormal(sf * flush_subnormal(divide(1.0, g_groups)))
    r = torch.where(v == 0, 0.0, flush_subnormal(divide(1.0, v)))
    # Tiny-scale fallback: the reciprocal path underflowed although the block scale did not.
    fallback = (v == 0) & (sf > 0)
    sf_e, r_e, fallback_e = (layout.expand(a) for a in (sf, r, fallback))
    y = flush_subnormal(x * r_e)
    y_direct = flush_subnormal(divide(flush_subnormal(x * g), torch.where(fallback_e, sf_e, 1.0)))
    y = torch.clamp(torch.where(fallback_e, y_direct, y), -_E2M1_MAX, _E2M1_MAX)
    return e2m1_encode(y, torch.signbit(x)), s8


def dequantize(codes, block_scale, g, layout: _grouping.GroupLayout) -> torch.Tensor:
    """Packed nibbles, e4m3 block scales and g (broadcasting against the block scales) ->
    float32 [T, H, D]."""
    step = flush_subnormal(divide(block_scale.to(F32), flush_subnormal(g)))
    values = e2m1_decode(_nibbles.unpack_nibbles(codes, layout.shape[2]))
    return flush_subnormal(values * layout.expand(step))


class NVFP4Codec(NVFP4Layout, Codec):
    def encode(self, values, *, axis, group_size) -> dict:
        layout = _grouping.GroupLayout(tuple(values.shape), axis, group_size)
        x = widen(values)
        finite = torch.isfinite(x).all()
        g = global_scale(x)
        codes, s8 = quantize(x, g, layout)
        codes = torch.where(finite, codes, 0)
        # NaN block scales as bits: float8 tensors support few ops, and the pattern is fixed.
        block_bits = torch.where(finite, s8.view(torch.uint8), E4M3_NAN_BITS)
        arrays = {
            "codes": _nibbles.pack_nibbles(codes),
            "block_scale": block_bits.view(torch.float8_e4m3fn),
            "global_scale": torch.where(finite, g, math.nan),
        }
        return arrays

    def unpack(self, packed, dtype) -> torch.Tensor:
        layout = _grouping.GroupLayout(packed.shape, packed.axis, packed.group_size)
        out = dequantize(packed.codes, packed.block_scale, packed.global_scale, layout)
        return out.to(torch_dtype(dtype)).contiguous()


CODEC = NVFP4Codec()
