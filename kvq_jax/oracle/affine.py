"""The affine group arithmetic of INT4, INT2 and INTB (docs/FORMAT.md sections 2, 2a, 2b),
element by element, with `levels` = L = 2**bits - 1 (15, 3, or a channel's width in INTB).

Per group, in float32 (every operation through `scalar`: rounded and flushed)::

    mn    = min(group)                 (a zero minimum is +0.0)
    mx    = max(group)
    span  = mx - mn
    scale = span / L  if span > 0 else 1.0       (IEEE division by the float32 value L)
    code  = clamp(round_half_even((x - mn) / scale), 0, L)    (NaN -> 0)
    stored: minimum = f16(mn), scale = f16(scale)

A group that holds inf or NaN stores minimum = scale = NaN (0x7E00) and codes 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvq_jax.oracle import layout
from kvq_jax.oracle.scalar import F16_NAN_BITS, add, bits_to_f16, div, f16_bits, is_nan, mul, sub


def round_code(q: float, levels: int) -> int:
    """clamp(round_half_even(q), 0, levels) as an int; NaN gives 0.

    Clamping first and rounding after gives the same integer (the bounds are integers and
    rounding is monotone) and keeps inf out of the rounding.
    """
    if is_nan(q):
        return 0
    q = min(max(q, 0.0), float(levels))
    whole = math.floor(q)
    fraction = q - whole  # exact: q <= 255, a float32 value
    if fraction > 0.5 or (fraction == 0.5 and whole % 2 == 1):
        whole += 1
    return int(whole)


def encode_group(xs: list[float], levels: int) -> tuple[list[int], int, int]:
    """One group's float32 values -> (codes 0..levels, minimum f16 bits, scale f16 bits)."""
    if not all(math.isfinite(x) for x in xs):
        return [0] * len(xs), F16_NAN_BITS, F16_NAN_BITS
    mn = min(xs)
    mx = max(xs)
    if mn == 0.0:
        mn = 0.0  # -0.0 and +0.0 both become +0.0 (independent of reduction order)
    span = sub(mx, mn)
    scale = div(span, float(levels)) if span > 0.0 else 1.0
    codes = [round_code(div(sub(x, mn), scale), levels) for x in xs]
    return codes, f16_bits(mn), f16_bits(scale)


def encode_groups(
    xs: list[float], shape, axis: str, group_size: int, levels_of: Callable[[int], int]
) -> tuple[list[int], list[int], list[int]]:
    """Flat float32 values of `shape` -> (codes per element, minimum f16 bits, scale f16 bits
    per group); group m (in `layout.groups` order) has ``levels_of(m)`` levels."""
    codes = [0] * len(xs)
    minimum = []
    scale = []
    for m, members in enumerate(layout.groups(shape, axis, group_size)):
        group_codes, min_bits, scale_bits = encode_group([xs[e] for e in members], levels_of(m))
        for e, c in zip(members, group_codes, strict=True):
            codes[e] = c
        minimum.append(min_bits)
        scale.append(scale_bits)
    return codes, minimum, scale


def decode_groups(
    codes: list[int], bits: dict[str, list[int]], shape, axis: str, group_size: int
) -> list[float]:
    """Codes per element and the f16 bits of minimum / scale per group -> flat float32 values
    ``code * scale16 + minimum16``."""
    owner = layout.group_of_elements(shape, axis, group_size)
    # float16 values widen exactly to float32 and are never float32-subnormal: no flush needed.
    minimum = [bits_to_f16(b) for b in bits["minimum"]]
    scale = [bits_to_f16(b) for b in bits["scale"]]
    return [
        add(mul(float(code), scale[m]), minimum[m]) for code, m in zip(codes, owner, strict=True)
    ]
