"""NVFP4 (vLLM reference arithmetic): E2M1 codes, one E4M3 scale per 16 elements, one float32
global encode scale per packed tensor. docs/FORMAT.md section 3.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvq_jax import _grouping, _nibbles
from kvq_jax._numerics import (
    divide,
    e2m1_decode,
    e2m1_encode,
    flush_subnormal,
    widen,
)
from kvq_jax.codec import Codec
from kvq_jax.core.constants import (
    E2M1_MAX,
    E4M3_MAX,
    F32_MAX,
    NVFP4_GLOBAL_NUMERATOR,
    NVFP4_GROUP_SIZE,
    NVFP4_ONE_SIXTH,
)
from kvq_jax.core.layouts import NVFP4Layout
from kvq_jax.packed import PackedKV

GROUP_SIZE = NVFP4_GROUP_SIZE


def global_scale(x: jnp.ndarray) -> jnp.ndarray:
    """float32 tensor -> float32 [] encode scale g (all-zero and tiny-tensor rules applied)."""
    amax = jnp.max(jnp.abs(x), initial=jnp.float32(0.0))
    g = jnp.where(amax == 0, jnp.float32(1.0), divide(NVFP4_GLOBAL_NUMERATOR, amax))
    return jnp.where(jnp.isinf(g), F32_MAX, g)


def quantize_groups(xg: jnp.ndarray, g: jnp.ndarray, member_axis: int):
    """Grouped float32 values (padding = 0) and g -> (4-bit codes like xg, e4m3 block scales)."""
    vmax = jnp.max(jnp.abs(xg), axis=member_axis, keepdims=True)
    s = flush_subnormal(g * flush_subnormal(vmax * NVFP4_ONE_SIXTH))
    s8 = jnp.minimum(s, E4M3_MAX).astype(jnp.float8_e4m3fn)
    sf = s8.astype(jnp.float32)
    v = flush_subnormal(sf * flush_subnormal(divide(1.0, g)))
    r = jnp.where(v == 0, jnp.float32(0.0), flush_subnormal(divide(1.0, v)))
    y = flush_subnormal(xg * r)
    # Tiny-scale fallback: the reciprocal path underflowed although the block scale did not.
    fallback = (v == 0) & (sf > 0)
    y_direct = flush_subnormal(divide(flush_subnormal(xg * g), jnp.where(fallback, sf, 1.0)))
    y = jnp.clip(jnp.where(fallback, y_direct, y), -E2M1_MAX, E2M1_MAX)
    codes = e2m1_encode(y, jnp.signbit(xg))
    return codes, jnp.squeeze(s8, member_axis)


class NVFP4Codec(NVFP4Layout, Codec):
    def pack(self, values, *, kind, axis, group_size) -> PackedKV:
        layout = _grouping.GroupLayout(values.shape, axis, group_size)
        x = widen(values)
        finite = jnp.all(jnp.isfinite(x))
        g = global_scale(x)
        codes_g, s8 = quantize_groups(layout.split(x, 0.0), g, layout.member_axis)
        codes = jnp.where(finite, layout.merge(codes_g), jnp.uint8(0))
        arrays = {
            "codes": _nibbles.pack_nibbles(codes),
            "block_scale": jnp.where(finite, s8, jnp.float8_e4m3fn(jnp.nan)),
            "global_scale": jnp.where(finite, g, jnp.float32(jnp.nan)),
        }
        return self._packed(
            arrays,
            kind=kind,
            axis=axis,
            group_size=group_size,
            shape=values.shape,
            dtype=values.dtype,
        )

    def unpack(self, packed, dtype) -> jnp.ndarray:
        layout = _grouping.GroupLayout(packed.shape, packed.axis, packed.group_size)
        codes = _nibbles.unpack_nibbles(packed.codes, packed.shape[2])
        sf = packed.block_scale.astype(jnp.float32)
        g = flush_subnormal(packed.global_scale)  # a hand-made scale may be subnormal
        step = flush_subnormal(divide(sf, g))
        out = flush_subnormal(e2m1_decode(layout.split(codes, 0)) * layout.expand(step))
        return layout.merge(out).astype(dtype)


CODEC = NVFP4Codec()
