"""NVFP4 (docs/FORMAT.md section 3), element by element. Group size 16.

Per tensor, in float32 (every operation through `scalar`: rounded and flushed)::

    amax = max |x|
    g    = 1.0 if amax == 0 else 2688 / amax;  f32 max if that is inf   (tiny-tensor rule)
per group::
    vmax = max |x|
    s    = min(g * (vmax * f32(1/6)), 448)
    sf   = e4m3(s)  (value)
    v    = sf * (1 / g)
    r    = 1 / v  if v != 0 else 0
per element::
    y    = (x * g) / sf  if v == 0 and sf > 0  else  x * r           (tiny-scale fallback)
    code = e2m1(clamp(y, -6, 6)), bit 3 = sign of x
stored: block_scale = e4m3 pattern of s, global_scale = g.
Any inf/NaN in the tensor: global_scale NaN, every block scale 0x7F, every code 0.
Decode: ``e2m1(code) * (sf / g)``.
"""

from __future__ import annotations

import math

from kvq_jax.oracle import e2m1, e4m3, layout
from kvq_jax.oracle.scalar import (
    F32_MAX,
    F32_NAN_BITS,
    bits_to_f32,
    div,
    f32_to_bits,
    ftz,
    mul,
    signbit,
)

#: The only group size.
GROUP_SIZE = 16
#: 448 * 6: maps the tensor amax onto the largest block scale times the largest E2M1 value.
GLOBAL_NUMERATOR = 2688.0
#: f32(1/6), the float32 nearest to 1/6 (one correctly rounded float32 division).
ONE_SIXTH = div(1.0, 6.0)


def global_scale(xs: list[float]) -> float:
    """g for a finite tensor: the all-zero rule, 2688 / amax, and the tiny-tensor rule."""
    amax = max((abs(x) for x in xs), default=0.0)
    if amax == 0.0:
        return 1.0
    g = div(GLOBAL_NUMERATOR, amax)
    if math.isinf(g):
        return F32_MAX
    return g


def encode_element(x: float, g: float, sf: float, v: float, r: float) -> int:
    """One element -> 4-bit E2M1 code, given its group's sf, v = sf * (1/g) and r."""
    y = div(mul(x, g), sf) if v == 0.0 and sf > 0.0 else mul(x, r)
    y = min(max(y, -e2m1.MAX), e2m1.MAX)
    return e2m1.encode_magnitude(abs(y)) | (e2m1.SIGN_BIT if signbit(x) else 0)


def encode(xs: list[float], shape, axis: str, group_size: int = GROUP_SIZE) -> dict:
    """Flat float32 values -> raw bits: codes (bytes), block_scale (e4m3), global_scale (f32)."""
    if group_size != GROUP_SIZE:
        raise ValueError(f"group_size must be {GROUP_SIZE} for nvfp4, got {group_size!r}")
    blocks = layout.groups(shape, axis, group_size)
    if not all(math.isfinite(x) for x in xs):
        return {
            "codes": layout.pack_nibbles([0] * len(xs), shape),
            "block_scale": [e4m3.NAN_BITS] * len(blocks),
            "global_scale": [F32_NAN_BITS],
        }
    g = global_scale(xs)
    inv_g = div(1.0, g)
    codes = [0] * len(xs)
    block_scale = []
    for members in blocks:
        vmax = max(abs(xs[e]) for e in members)
        s = mul(g, mul(vmax, ONE_SIXTH))
        s = min(s, e4m3.MAX)
        s_bits = e4m3.encode(s)
        sf = e4m3.decode(s_bits)
        v = mul(sf, inv_g)
        r = div(1.0, v) if v != 0.0 else 0.0
        for e in members:
            codes[e] = encode_element(xs[e], g, sf, v, r)
        block_scale.append(s_bits)
    return {
        "codes": layout.pack_nibbles(codes, shape),
        "block_scale": block_scale,
        "global_scale": [f32_to_bits(g)],
    }


def decode(bits: dict, shape, axis: str, group_size: int = GROUP_SIZE) -> list[float]:
    """Raw bits -> flat float32 values ``e2m1(code) * (sf / g)``."""
    codes = layout.unpack_nibbles(bits["codes"], shape)
    owner = layout.group_of_elements(shape, axis, group_size)
    (g_bits,) = bits["global_scale"]
    g = ftz(bits_to_f32(g_bits))
    # E4M3 values are never float32-subnormal; sf / g is one division per block.
    step = [div(e4m3.decode(b), g) for b in bits["block_scale"]]
    return [mul(e2m1.decode(code), step[m]) for code, m in zip(codes, owner, strict=True)]
