"""The binary32 arithmetic model of docs/FORMAT.md section 0, one Python float at a time.

Every value the oracle computes is a Python ``float`` (IEEE binary64) that holds an exact
float32 value. One float32 operation is modelled as:

1. flush the operands (a subnormal float32 operand is read as a zero of the same sign: DAZ);
2. compute the exact operation in binary64 (Python's ``+ - * /``);
3. round the binary64 result to float32, round to nearest even (``struct`` format ``"f"``);
4. flush the result (a subnormal result becomes a zero of the same sign: FTZ).

Step 2 + 3 is exactly the correctly rounded float32 operation: binary64 carries
53 >= 2 * 24 + 2 significand bits, so rounding twice (to binary64, then to float32) is
innocuous for ``+ - * /`` (Figueroa, "When is double rounding innocuous?", 1995).

Nothing here uses numpy or the host's float32 unit: the only rounding primitive is
``struct.pack`` (C ``(float)double`` and ``PyFloat_Pack2`` for float16, both round to nearest
even), and bfloat16 rounding is integer arithmetic on the float32 bit pattern.

NaN bit patterns: NaNs produced by arithmetic carry host-dependent signs and payloads (x86
produces a *negative* NaN for ``inf - inf``). The bit helpers therefore write one canonical
quiet NaN per format: float32 ``0x7FC00000``, float16 ``0x7E00``, bfloat16 ``0x7FC0``.
"""

from __future__ import annotations

import math
import struct

#: Smallest positive normal float32 (2**-126). Magnitudes below it are flushed to zero.
F32_MIN_NORMAL = 2.0**-126
#: Largest finite float32, (2 - 2**-23) * 2**127.
F32_MAX = (2.0 - 2.0**-23) * 2.0**127

#: Canonical quiet NaN bit patterns written by this module.
F32_NAN_BITS = 0x7FC00000
F16_NAN_BITS = 0x7E00
BF16_NAN_BITS = 0x7FC0

_INF = math.inf
_F32 = struct.Struct("<f")
_U32 = struct.Struct("<I")
_F16 = struct.Struct("<e")
_U16 = struct.Struct("<H")


# --------------------------------------------------------------------------- predicates


def is_nan(x: float) -> bool:
    """True for any NaN."""
    return x != x


def signbit(x: float) -> bool:
    """True when the sign bit of `x` is set (so ``signbit(-0.0)`` is True)."""
    return math.copysign(1.0, x) < 0.0


# --------------------------------------------------------------------------- rounding


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (ties to even). No flush.

    A result beyond the float32 range after rounding is +-inf (some Pythons raise
    OverflowError from ``struct.pack`` there instead; that is caught). NaN and inf pass.
    """
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:
        # struct raises only when the correctly rounded result is infinite.
        return math.copysign(_INF, x)


def ftz(x: float) -> float:
    """Flush: a magnitude below 2**-126 becomes a zero of the same sign. NaN/inf pass."""
    if -F32_MIN_NORMAL < x < F32_MIN_NORMAL:  # False for NaN
        return math.copysign(0.0, x)
    return x


def round_f32(x: float) -> float:
    """Round to float32, then flush: the result of one float32 operation."""
    return ftz(f32(x))


# --------------------------------------------------------------------------- operations


def add(a: float, b: float) -> float:
    """float32 ``a + b`` with flushed operands and result."""
    return ftz(f32(ftz(a) + ftz(b)))


def sub(a: float, b: float) -> float:
    """float32 ``a - b`` with flushed operands and result."""
    return ftz(f32(ftz(a) - ftz(b)))


def mul(a: float, b: float) -> float:
    """float32 ``a * b`` with flushed operands and result."""
    return ftz(f32(ftz(a) * ftz(b)))


def div(a: float, b: float) -> float:
    """float32 ``a / b`` with flushed operands and result; IEEE division by zero.

    ``x / +-0`` is +-inf for a non-zero, non-NaN x (sign = xor of the signs) and NaN for
    ``0 / 0`` and ``NaN / 0``. (Python raises ZeroDivisionError there.)
    """
    a = ftz(a)
    b = ftz(b)
    if b == 0.0:
        if is_nan(a) or a == 0.0:
            return math.nan
        return _INF if signbit(a) == signbit(b) else -_INF
    return ftz(f32(a / b))


# --------------------------------------------------------------------------- float32 bits


def f32_to_bits(x: float) -> int:
    """Bit pattern (uint32) of the float32 value `x` (must already be a float32 value).

    Any NaN gives the canonical quiet NaN 0x7FC00000.
    """
    if is_nan(x):
        return F32_NAN_BITS
    try:
        return _U32.unpack(_F32.pack(x))[0]
    except OverflowError:  # not a float32 value; refuse rather than guess
        raise ValueError(f"{x!r} is not a float32 value") from None


def bits_to_f32(bits: int) -> float:
    """float32 bit pattern (uint32) -> its exact value as a Python float (no flush)."""
    return _F32.unpack(_U32.pack(bits))[0]


# --------------------------------------------------------------------------- float16


def f16_bits(x: float) -> int:
    """Round `x` to float16 (nearest, ties to even; subnormals kept) and return its bits.

    Overflow gives +-inf (0x7C00 / 0xFC00); any NaN gives 0x7E00. Apply to float32 values,
    so that this is the single rounding float32 -> float16.
    """
    if is_nan(x):
        return F16_NAN_BITS
    try:
        return _U16.unpack(_F16.pack(x))[0]
    except OverflowError:
        # PyFloat_Pack2 raises only when the correctly rounded result is infinite.
        return 0xFC00 if signbit(x) else 0x7C00


def bits_to_f16(bits: int) -> float:
    """float16 bit pattern (uint16) -> its exact value as a Python float."""
    return _F16.unpack(_U16.pack(bits))[0]


def f16(x: float) -> float:
    """Round `x` to the nearest float16 value (as a Python float)."""
    return bits_to_f16(f16_bits(x))


# --------------------------------------------------------------------------- bfloat16


def bf16_bits(x: float) -> int:
    """Round the float32 value `x` to bfloat16 (nearest, ties to even) and return its bits.

    Integer arithmetic on the float32 pattern: add 0x7FFF plus the lowest kept bit, drop
    the low 16 bits. A carry out of the mantissa correctly bumps the exponent (to inf on
    overflow). Any NaN gives the canonical 0x7FC0.
    """
    if is_nan(x):
        return BF16_NAN_BITS
    bits = f32_to_bits(x)
    lowest_kept = (bits >> 16) & 1
    return ((bits + 0x7FFF + lowest_kept) >> 16) & 0xFFFF


def bits_to_bf16(bits: int) -> float:
    """bfloat16 bit pattern (uint16) -> its exact value (the float32 with bits << 16)."""
    return bits_to_f32((bits & 0xFFFF) << 16)


def bf16(x: float) -> float:
    """Round the float32 value `x` to the nearest bfloat16 value (as a Python float)."""
    return bits_to_bf16(bf16_bits(x))
