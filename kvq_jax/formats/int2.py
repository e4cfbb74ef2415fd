"""Grouped affine INT2 (FlashLoop's 2-bit stream): codes 0..3, FP16 minimum and scale per
group, any G >= 1, four codes per byte.

docs/FORMAT.md section 2a. The arithmetic is INT4's with 3 levels instead of 15: codes are
computed with the float32 minimum/scale (scale = span / 3, IEEE division); the stored FP16
metadata is rounded afterwards and used by decode. Byte j of a (token, head) row holds channel
4j + i in bits 2i .. 2i + 1; channels past D are zero codes.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvq_jax import _grouping
from kvq_jax._numerics import divide, flush_subnormal, round_half_even, widen
from kvq_jax.codec import Codec
from kvq_jax.core.constants import INT2_LEVELS
from kvq_jax.core.layouts import Int2Layout
from kvq_jax.packed import PackedKV

_CODE_MAX = 3.0


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


def quantize_groups(xg: jnp.ndarray, valid, member_axis: int):
    """Grouped float32 values -> (codes uint8 0..3 like xg, minimum f16, scale f16 per group).

    `valid` is a boolean mask (or None) of the real members; padding never enters a min/max.
    """
    lo = xg if valid is None else jnp.where(valid, xg, jnp.inf)
    hi = xg if valid is None else jnp.where(valid, xg, -jnp.inf)
    mn = jnp.min(lo, axis=member_axis, keepdims=True)
    mx = jnp.max(hi, axis=member_axis, keepdims=True)
    # Tested element-wise: XLA:CPU min/max reductions do not reliably propagate NaN.
    finite = jnp.all(jnp.isfinite(xg), axis=member_axis, keepdims=True)
    mn = jnp.where(mn == 0, jnp.float32(0.0), mn)  # a zero minimum is stored as +0.0
    span = flush_subnormal(mx - mn)
    scale = jnp.where(span > 0, flush_subnormal(divide(span, INT2_LEVELS)), jnp.float32(1.0))
    q = round_half_even(divide(flush_subnormal(xg - mn), scale))
    codes = jnp.where(q >= 0, jnp.minimum(q, _CODE_MAX), 0.0)  # NaN -> 0
    codes = jnp.where(finite, codes, 0.0).astype(jnp.uint8)
    minimum = jnp.where(finite, mn, jnp.nan).astype(jnp.float16)
    scale = jnp.where(finite, scale, jnp.nan).astype(jnp.float16)
    return codes, jnp.squeeze(minimum, member_axis), jnp.squeeze(scale, member_axis)


def dequantize_groups(codes_g, minimum, scale, member_axis: int) -> jnp.ndarray:
    """Grouped uint8 codes and per-group f16 metadata -> float32 values (grouped).

    code * scale16 is exact (2-bit x 11-bit significands): a fused multiply-add gives the same.
    """
    mn = jnp.expand_dims(minimum.astype(jnp.float32), member_axis)
    sc = jnp.expand_dims(scale.astype(jnp.float32), member_axis)
    return codes_g.astype(jnp.float32) * sc + mn


class Int2Codec(Int2Layout, Codec):
    def pack(self, values, *, kind, axis, group_size) -> PackedKV:
        layout = _grouping.GroupLayout(values.shape, axis, group_size)
        xg = layout.split(widen(values), 0.0)
        valid = layout.split(jnp.ones(values.shape, bool), False) if layout.padding else None
        codes_g, minimum, scale = quantize_groups(xg, valid, layout.member_axis)
        return self._packed(
            {"codes": pack_2bit(layout.merge(codes_g)), "minimum": minimum, "scale": scale},
            kind=kind,
            axis=axis,
            group_size=group_size,
            shape=values.shape,
            dtype=values.dtype,
        )

    def unpack(self, packed, dtype) -> jnp.ndarray:
        layout = _grouping.GroupLayout(packed.shape, packed.axis, packed.group_size)
        codes = unpack_2bit(packed.codes, packed.shape[2])
        out = dequantize_groups(
            layout.split(codes, 0), packed.minimum, packed.scale, layout.member_axis
        )
        return layout.merge(out).astype(dtype)


CODEC = Int2Codec()
