"""INT2 affine format (docs/FORMAT.md section 2a, FlashLoop's 2-bit stream), element by element.

Per group, in float32 (every operation through `scalar`: rounded and flushed)::

    mn    = min(group)                 (a zero minimum is +0.0)
    mx    = max(group)
    span  = mx - mn
    scale = span / 3  if span > 0 else 1.0
    code  = clamp(round_half_even((x - mn) / scale), 0, 3)    (NaN -> 0)
    stored: minimum = f16(mn), scale = f16(scale)

A group that holds inf or NaN stores minimum = scale = NaN (0x7E00) and codes 0.
Decode: ``f32(code) * scale16 + minimum16``. Four codes per byte: channel 4j + i in bits
2i .. 2i + 1 of byte j (`layout.pack_2bit`).

Inputs to `encode` are flat lists of float32 values that were already flushed on entry
(see `kvq_jax.oracle.widen`); outputs are flat lists of raw bit patterns.
"""

from __future__ import annotations

import math

from kvq_jax.oracle import layout
from kvq_jax.oracle.scalar import (
    F16_NAN_BITS,
    add,
    bits_to_f16,
    div,
    f16_bits,
    is_nan,
    mul,
    sub,
)

#: Largest code.
CODE_MAX = 3
#: The scale's divisor: span / 3 (IEEE division).
LEVELS = 3.0


def round_code(q: float) -> int:
    """clamp(round_half_even(q), 0, 3) as an int; NaN gives 0 (clamp first: the bounds are
    integers, so clamping before rounding gives the same integer and keeps inf out)."""
    if is_nan(q):
        return 0
    q = min(max(q, 0.0), float(CODE_MAX))
    whole = math.floor(q)
    fraction = q - whole  # exact: q < 4, a float32 value
    if fraction > 0.5 or (fraction == 0.5 and whole % 2 == 1):
        whole += 1
    return int(whole)


def encode_group(xs: list[float]) -> tuple[list[int], int, int]:
    """One group's float32 values -> (codes 0..3, minimum f16 bits, scale f16 bits)."""
    if not all(math.isfinite(x) for x in xs):
        return [0] * len(xs), F16_NAN_BITS, F16_NAN_BITS
    mn = min(xs)
    mx = max(xs)
    if mn == 0.0:
        mn = 0.0  # -0.0 and +0.0 both become +0.0 (independent of reduction order)
    span = sub(mx, mn)
    scale = div(span, LEVELS) if span > 0.0 else 1.0
    codes = [round_code(div(sub(x, mn), scale)) for x in xs]
    return codes, f16_bits(mn), f16_bits(scale)


def encode(xs: list[float], shape, axis: str, group_size: int) -> dict[str, list[int]]:
    """Flat float32 values of `shape` -> raw bits: codes (bytes), minimum, scale (f16)."""
    codes = [0] * len(xs)
    minimum = []
    scale = []
    for members in layout.groups(shape, axis, group_size):
        group_codes, min_bits, scale_bits = encode_group([xs[e] for e in members])
        for e, c in zip(members, group_codes, strict=True):
            codes[e] = c
        minimum.append(min_bits)
        scale.append(scale_bits)
    return {"codes": layout.pack_2bit(codes, shape), "minimum": minimum, "scale": scale}


def decode(bits: dict[str, list[int]], shape, axis: str, group_size: int) -> list[float]:
    """Raw bits -> flat float32 values ``code * scale16 + minimum16``."""
    codes = layout.unpack_2bit(bits["codes"], shape)
    owner = layout.group_of_elements(shape, axis, group_size)
    minimum = [bits_to_f16(b) for b in bits["minimum"]]
    scale = [bits_to_f16(b) for b in bits["scale"]]
    return [
        add(mul(float(code), scale[m]), minimum[m]) for code, m in zip(codes, owner, strict=True)
    ]
