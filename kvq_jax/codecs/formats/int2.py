"""Grouped affine INT2 (FlashLoop's 2-bit stream): codes 0..3, FP16 minimum and scale per
group, any G >= 1, four codes per byte.

docs/FORMAT.md section 2a. The arithmetic is INT4's (`kvq_jax.codecs.formats.int4`'s group range,
quantization and decode) with 3 levels instead of 15: codes are
computed with the float32 minimum/scale (scale = span / 3, IEEE division); the stored FP16
metadata is rounded afterwards and used by decode. Byte j of a (token, head) row holds channel
4j + i in bits 2i .. 2i + 1; channels past D are zero codes.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvq_jax.codecs import _grouping
from kvq_jax.codecs._numerics import widen
from kvq_jax.codecs.codec import Codec
from kvq_jax.codecs.formats.int4 import dequantize_groups, group_range, quantize_groups
from kvq_jax.core.constants import INT2_LEVELS
from kvq_jax.core.layouts import Int2Layout


def pack_2bit(codes: jnp.ndarray) -> jnp.ndarray:
    """uint8 codes [..., D] (values 0..3) -> uint8 [..., ceil(D/4)]; channels past D are 0."""
    pad = -codes.shape[-1] % 4
    if pad:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
    quads = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4)
    c0, c1, c2, c3 = (quads[..., i] for i in range(4))
    return c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)


def unpack_2bit(packed: jnp.ndarray, channels: int) -> jnp.ndarray:
    """uint8 [..., ceil(D/4)] -> uint8 codes [..., D] with D = `channels`."""
    codes = jnp.stack([(packed >> (2 * i)) & 0x3 for i in range(4)], axis=-1)
    return codes.reshape(*packed.shape[:-1], 4 * packed.shape[-1])[..., :channels]


class Int2Codec(Int2Layout, Codec):
    def encode(self, values, *, axis, group_size) -> dict:
        layout = _grouping.GroupLayout(values.shape, axis, group_size)
        xg = layout.split(widen(values), 0.0)
        mn, mx, finite = group_range(layout, values)
        codes_g, minimum, scale = quantize_groups(xg, mn, mx, finite, INT2_LEVELS)
        m = layout.member_axis
        minimum, scale = minimum.squeeze(m), scale.squeeze(m)
        return {"codes": pack_2bit(layout.merge(codes_g)), "minimum": minimum, "scale": scale}

    def unpack(self, packed, dtype) -> jnp.ndarray:
        layout = _grouping.GroupLayout(packed.shape, packed.axis, packed.group_size)
        codes = unpack_2bit(packed.codes, packed.shape[2])
        out = dequantize_groups(
            layout.split(codes, 0), packed.minimum, packed.scale, layout.member_axis
        )
        return layout.merge(out).astype(dtype)


CODEC = Int2Codec()
