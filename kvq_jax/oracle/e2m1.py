"""E2M1 (FP4): 1 sign bit, 2 exponent bits, 1 mantissa bit; no inf, no NaN.

A 4-bit code is ``sign << 3 | magnitude_code``. The eight magnitudes, indexed by the 3-bit
magnitude code, are written out below instead of being derived, so the table can be checked
by eye against the OCP MX specification (and, in the tests, against ml_dtypes).

Encoding is by enumeration: scan all eight magnitudes and keep the nearest; an exact tie
goes to the even code (``code & 1 == 0``).
"""

from __future__ import annotations

import math

from kvq_jax.oracle.scalar import is_nan, signbit

#: Non-negative E2M1 values indexed by the 3-bit magnitude code.
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Largest magnitude.
MAX = 6.0
#: Sign bit of a 4-bit code.
SIGN_BIT = 0x8


def encode_magnitude(a: float) -> int:
    """0 <= a <= 6 -> 3-bit code of the nearest magnitude, exact ties to the even code.

    The distances ``abs(a - m)`` are binary64 differences. They decide correctly: rounding
    is monotone, so only a spurious tie could flip a decision, and two distances can only
    be that close when `a` lies near a midpoint (so a > 0.2), where both differences are
    exact (every float32 a > 0.125 and every m <= 6 lie on a 2**-26 grid of < 53 bits).
    """
    if is_nan(a) or not 0.0 <= a <= MAX:
        raise ValueError(f"E2M1 magnitude must lie in [0, 6], got {a!r}")
    best_code = 0
    best_distance = math.inf
    for code, magnitude in enumerate(MAGNITUDES):
        distance = abs(a - magnitude)
        if distance < best_distance or (distance == best_distance and code % 2 == 0):
            best_code = code
            best_distance = distance
    return best_code


def encode(y: float) -> int:
    """-6 <= y <= 6 -> 4-bit code: nearest magnitude (ties to even), bit 3 = sign of y.

    The sign follows copysign semantics: ``encode(-0.0) == 0x8`` and a negative value that
    rounds to magnitude 0 keeps 0x8.
    """
    return encode_magnitude(abs(y)) | (SIGN_BIT if signbit(y) else 0)


def decode(code: int) -> float:
    """4-bit code -> value (``decode(0x8) == -0.0``)."""
    if not 0 <= code <= 0xF:
        raise ValueError(f"E2M1 code must be in 0..15, got {code!r}")
    magnitude = MAGNITUDES[code & 0x7]
    return -magnitude if code & SIGN_BIT else magnitude
