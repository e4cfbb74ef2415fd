"""FP8 E4M3 with one float32 scale per (token, head) (docs/FORMAT.md section 4).

Per (token, head) row of D channels, in float32 (every operation through `scalar`)::

    s    = max |x| / 448
    code = e4m3(clamp(x / s, -448, 448))   if s > 0
    code = +0 (0x00)                       otherwise
A row that holds inf or NaN stores scale NaN (0x7FC00000) and codes 0.
Decode: ``e4m3(code) * s``.
"""

from __future__ import annotations

import math

from kvq_jax.oracle import e4m3, layout
from kvq_jax.oracle.scalar import F32_NAN_BITS, bits_to_f32, div, f32_to_bits, ftz, mul


def encode_row(xs: list[float]) -> tuple[list[int], int]:
    """One (token, head) row -> (e4m3 code patterns, f32 scale bits)."""
    if not all(math.isfinite(x) for x in xs):
        return [0] * len(xs), F32_NAN_BITS
    amax = max((abs(x) for x in xs), default=0.0)
    s = div(amax, e4m3.MAX)
    if s > 0.0:
        codes = [e4m3.encode(min(max(div(x, s), -e4m3.MAX), e4m3.MAX)) for x in xs]
    else:
        codes = [0] * len(xs)
    return codes, f32_to_bits(s)


def encode(xs: list[float], shape, axis: str = "channels", group_size=None) -> dict:
    """Flat float32 values -> raw bits: codes (e4m3 patterns, [T, H, D]), scale (f32, [T, H])."""
    codes = [0] * len(xs)
    scale = []
    for members in layout.rows(shape):
        row_codes, s_bits = encode_row([xs[e] for e in members])
        for e, c in zip(members, row_codes, strict=True):
            codes[e] = c
        scale.append(s_bits)
    return {"codes": codes, "scale": scale}


def decode(bits: dict, shape, axis: str = "channels", group_size=None) -> list[float]:
    """Raw bits -> flat float32 values ``e4m3(code) * s``."""
    out = [0.0] * (shape[0] * shape[1] * shape[2])
    for members, s_bits in zip(layout.rows(shape), bits["scale"], strict=True):
        s = ftz(bits_to_f32(s_bits))
        for e in members:
            out[e] = mul(e4m3.decode(bits["codes"][e]), s)
    return out
