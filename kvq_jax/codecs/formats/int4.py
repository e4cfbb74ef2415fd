"""Grouped affine INT4 (FlashLoop arithmetic): FP16 minimum and scale per group, any G >= 1.

docs/FORMAT.md section 2. Codes are computed with the float32 minimum/scale; the stored FP16
metadata is rounded afterwards and used by decode (the reference behaviour).
"""

from __future__ import annotations

import jax.numpy as jnp

from kvq_jax.codecs import _grouping, _nibbles
from kvq_jax.codecs._numerics import divide, flush_subnormal, round_half_even, widen
from kvq_jax.codecs.codec import Codec
from kvq_jax.core.constants import INT4_LEVELS
from kvq_jax.core.layouts import Int4Layout


def group_range(layout: _grouping.GroupLayout, values: jnp.ndarray):
    """Raw [T, H, D] values -> (minimum, maximum, all finite) per group, float32 / bool,
    keepdims along the member axis of the grouped view.

    min and max run on the input dtype (exact: they never round) and are flushed afterwards
    (FTZ is monotone, so it commutes with min and max): XLA:CPU then reduces the input
    buffer itself instead of a float32 copy. Their NaN handling does not matter: "all finite"
    is its own reduction (XLA:CPU min/max reductions do not reliably propagate NaN).
    """
    raw, m = layout.split_edge(values), layout.member_axis
    mn = flush_subnormal(jnp.min(raw, axis=m, keepdims=True).astype(jnp.float32))
    mx = flush_subnormal(jnp.max(raw, axis=m, keepdims=True).astype(jnp.float32))
    return mn, mx, jnp.all(jnp.isfinite(raw), axis=m, keepdims=True)


def quantize_groups(xg: jnp.ndarray, mn, mx, finite, levels=INT4_LEVELS):
    """Grouped float32 values and their group range (`group_range`) -> (codes uint8 0..levels
    like xg, minimum f16, scale f16 = span / levels per group, keepdims). levels: 15 (INT4)
    or 3 (INT2)."""
    mn = jnp.where(mn == 0, jnp.float32(0.0), mn)  # a zero minimum is stored as +0.0
    span = flush_subnormal(mx - mn)
    scale = jnp.where(span > 0, flush_subnormal(divide(span, levels, fuse=False)), jnp.float32(1.0))
    q = round_half_even(divide(flush_subnormal(xg - mn), scale))
    codes = jnp.where(q >= 0, jnp.minimum(q, jnp.float32(levels)), 0.0)  # NaN -> 0
    codes = jnp.where(finite, codes, 0.0).astype(jnp.uint8)
    minimum = jnp.where(finite, mn, jnp.nan).astype(jnp.float16)
    scale = jnp.where(finite, scale, jnp.nan).astype(jnp.float16)
    return codes, minimum, scale


def dequantize_groups(codes_g, minimum, scale, member_axis: int) -> jnp.ndarray:
    """Grouped uint8 codes and per-group f16 metadata -> float32 values (grouped)."""
    mn = jnp.expand_dims(minimum.astype(jnp.float32), member_axis)
    sc = jnp.expand_dims(scale.astype(jnp.float32), member_axis)
    return codes_g.astype(jnp.float32) * sc + mn


class Int4Codec(Int4Layout, Codec):
    def encode(self, values, *, axis, group_size) -> dict:
        layout = _grouping.GroupLayout(values.shape, axis, group_size)
        mn, mx, finite = group_range(layout, values)
        xg = layout.split(widen(values), 0.0)
        codes_g, minimum, scale = quantize_groups(xg, mn, mx, finite)
        codes = _nibbles.pack_nibbles(layout.merge(codes_g))
        m = layout.member_axis
        return {"codes": codes, "minimum": minimum.squeeze(m), "scale": scale.squeeze(m)}

    def unpack(self, packed, dtype) -> jnp.ndarray:
        layout = _grouping.GroupLayout(packed.shape, packed.axis, packed.group_size)
        codes = _nibbles.unpack_nibbles(packed.codes, packed.shape[2])
        out = dequantize_groups(
            layout.split(codes, 0), packed.minimum, packed.scale, layout.member_axis
        )
        return layout.merge(out).astype(dtype)


CODEC = Int4Codec()
