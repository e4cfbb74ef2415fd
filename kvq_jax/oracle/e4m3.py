"""float8_e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits.

Subnormals at exponent field 0, no infinities, NaN = 0x7F / 0xFF, largest finite 448.

The value table is built by decoding every non-negative finite bit pattern 0x00..0x7E with
the textbook formula; those values increase strictly with the pattern (checked at import),
so the table index *is* the 7-bit magnitude pattern. Encoding picks the nearest table value
(exact ties to the even pattern) and puts the sign of the input into bit 7.
"""

from __future__ import annotations

import bisect
import itertools
import math

from kvq_jax.oracle.scalar import is_nan, signbit

#: Largest finite value.
MAX = 448.0
#: The NaN pattern the oracle writes.
NAN_BITS = 0x7F
#: Sign bit.
SIGN_BIT = 0x80


def _decode_pattern(bits: int) -> float:
    """Textbook decoding of one 8-bit pattern."""
    if bits & 0x7F == 0x7F:
        return math.nan
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    if exponent == 0:  # subnormal: 0.mmm * 2**(1 - 7)
        magnitude = math.ldexp(mantissa, -9)
    else:  # normal: 1.mmm * 2**(e - 7)
        magnitude = math.ldexp(8 + mantissa, exponent - 10)
    return -magnitude if bits & SIGN_BIT else magnitude


#: Non-negative finite values indexed by their bit pattern 0x00..0x7E.
VALUES = tuple(_decode_pattern(bits) for bits in range(0x7F))

if VALUES[-1] != MAX or any(lo >= hi for lo, hi in itertools.pairwise(VALUES)):
    raise AssertionError("E4M3 value table is not strictly increasing up to 448")


def decode(bits: int) -> float:
    """8-bit pattern -> value (NaN for 0x7F / 0xFF, -0.0 for 0x80)."""
    if not 0 <= bits <= 0xFF:
        raise ValueError(f"E4M3 pattern must be in 0..255, got {bits!r}")
    return _decode_pattern(bits)


def _check(v: float) -> None:
    if not -MAX <= v <= MAX:
        raise ValueError(f"E4M3 encode expects a value clamped to [-448, 448], got {v!r}")


def encode(v: float) -> int:
    """Value with |v| <= 448 (clamp first) -> nearest pattern, exact ties to the even one.

    NaN gives 0x7F. Bit 7 is the sign of `v` (``encode(-0.0) == 0x80``). The two table
    neighbours of |v| are found by bisection (the table is sorted), then compared exactly
    like the full scan of `encode_linear` would compare them. binary64 distances decide
    correctly: a spurious tie needs |v| near a midpoint (>= 2**-10), where both differences
    are exact (a float32 >= 2**-11 and a table value <= 448 span < 53 bits).
    """
    if is_nan(v):
        return NAN_BITS
    _check(v)
    a = abs(v)
    hi = bisect.bisect_left(VALUES, a)  # first pattern with value >= a
    if VALUES[hi] == a:
        code = hi
    else:
        lo = hi - 1
        d_lo = a - VALUES[lo]
        d_hi = VALUES[hi] - a
        if d_lo < d_hi:
            code = lo
        elif d_hi < d_lo:
            code = hi
        else:  # exact tie: the even pattern
            code = lo if lo % 2 == 0 else hi
    return code | (SIGN_BIT if signbit(v) else 0)


def encode_linear(v: float) -> int:
    """Same contract as `encode`, by a literal scan of all 127 magnitudes (slow; for tests)."""
    if is_nan(v):
        return NAN_BITS
    _check(v)
    a = abs(v)
    best_code = 0
    best_distance = math.inf
    for code, value in enumerate(VALUES):
        distance = abs(a - value)
        if distance < best_distance or (distance == best_distance and code % 2 == 0):
            best_code = code
            best_distance = distance
    return best_code | (SIGN_BIT if signbit(v) else 0)
