"""Grouped affine INT2 in torch (mirrors kvq_jax.codecs.formats.int2, FlashLoop's 2-bit stream):
codes 0..3, FP16 minimum and scale per group, any G >= 1, four codes per byte.
docs/FORMAT.md section 2a. Codes are computed with the float32 minimum and scale (span / 3);
the stored FP16 metadata is rounded afterwards and used by decode.
"""

from __future__ import annotations

import torch

from kvq_jax.core.constants import INT2_LEVELS
from kvq_jax.core.layouts import Int2Layout
from kvq_torch_bridge.codecs import _grouping
from kvq_torch_bridge.codecs._dtypes import torch_dtype
from kvq_torch_bridge.codecs._numerics import widen
from kvq_torch_bridge.codecs.codec import Codec
from kvq_torch_bridge.codecs.formats.int4 import dequantize, quantize


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., D] (values 0..3) -> uint8 [..., ceil(D/4)]: byte j holds channel
    4j + i in bits 2i .. 2i + 1; channels past D are 0."""
    pad = -codes.shape[-1] % 4
    if pad:
        zero = torch.zeros((*codes.shape[:-1], pad), dtype=codes.dtype, device=codes.device)
        codes = torch.cat([codes, zero], dim=-1)
    quads = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4)
    return quads[..., 0] | (quads[..., 1] << 2) | (quads[..., 2] << 4) | (quads[..., 3] << 6)


def unpack_2bit(packed: torch.Tensor, channels: int) -> torch.Tensor:
    """uint8 [..., ceil(D/4)] -> uint8 codes [..., D] with D = `channels`."""
    codes = torch.stack([(packed >> (2 * i)) & 0x3 for i in range(4)], dim=-1)
    return codes.reshape(*packed.shape[:-1], 4 * packed.shape[-1])[..., :channels]


class Int2Codec(Int2Layout, Codec):
    def encode(self, values, *, axis, group_size) -> dict:
        layout = _grouping.GroupLayout(tuple(values.shape), axis, group_size)
        codes, minimum, scale = quantize(widen(values), layout, INT2_LEVELS)
        return {"codes": pack_2bit(codes), "minimum": minimum, "scale": scale}

    def unpack(self, packed, dtype) -> torch.Tensor:
        layout = _grouping.GroupLayout(packed.shape, packed.axis, packed.group_size)
        codes = unpack_2bit(packed.codes, packed.shape[2])
        out = dequantize(codes, packed.minimum, packed.scale, layout)
        return out.to(torch_dtype(dtype)).contiguous()


CODEC = Int2Codec()
