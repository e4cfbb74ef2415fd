"""Tests of the scalar oracle itself (kvq_jax.oracle).

The oracle judges every other implementation, so it is checked here against sources that
share nothing with it: ml_dtypes / numpy casts and numpy float32 arithmetic (allowed in tests,
forbidden in the oracle), hand-worked cases from docs/FORMAT.md, and small vectorized numpy
re-derivations of each format on normal-range data.
"""

from __future__ import annotations

import ast
import math
import pathlib
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from kvq_jax import oracle
from kvq_jax.oracle import e2m1, e4m3, layout, nvfp4, scalar

REPO = pathlib.Path(__file__).resolve().parents[1]
ORACLE_DIR = REPO / "kvq_jax" / "oracle"
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
F4 = np.dtype(ml_dtypes.float4_e2m1fn)
VALUE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)


def f32_array(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def f32_neighbours(values) -> np.ndarray:
    """float32 values and their nextafter neighbours up and down."""
    v = f32_array(values)
    up = np.nextafter(v, np.float32(np.inf))
    down = np.nextafter(v, np.float32(-np.inf))
    return np.concatenate([v, up, down])


def with_negatives(v: np.ndarray) -> np.ndarray:
    return np.concatenate([v, -v])


def bits(array: np.ndarray) -> np.ndarray:
    """Raw bit patterns of a float array."""
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[array.dtype.itemsize]
    return np.ascontiguousarray(array).view(width)


def same_bits(a: np.ndarray, b: np.ndarray, nan_equal: bool = True) -> bool:
    """Bitwise equality; with nan_equal, NaN matches NaN of any sign/payload."""
    assert a.dtype == b.dtype and a.shape == b.shape
    equal = bits(a) == bits(b)
    if nan_equal:
        both_nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
        equal |= both_nan
    return bool(equal.all())


# ============================================================================ E2M1


def ml_e2m1_codes(values: np.ndarray) -> list[int]:
    return f32_array(values).astype(F4).view(np.uint8).tolist()


def e2m1_test_values() -> np.ndarray:
    mags = np.array(e2m1.MAGNITUDES, np.float32)
    mids = (mags[:-1] + mags[1:]) / 2
    rng = np.random.default_rng(1)
    rand = rng.uniform(-6, 6, 4000).astype(np.float32)
    tiny = f32_array([2.0**-126, 1e-30, 1e-3, 0.2499999])
    v = np.concatenate([mags, f32_neighbours(mids), tiny, np.nextafter(mags, np.float32(0))])
    v = v[np.abs(v) <= 6]
    return np.concatenate([with_negatives(v), rand, f32_array([0.0, -0.0])])


def test_e2m1_decode_table_matches_ml_dtypes():
    for code in range(16):
        want = np.array([code], np.uint8).view(F4).astype(np.float32)[0]
        got = np.float32(e2m1.decode(code))
        assert bits(np.array([got])) == bits(np.array([want])), code


def test_e2m1_encode_matches_ml_dtypes():
    values = e2m1_test_values()
    got = [e2m1.encode(float(v)) for v in values]
    assert got == ml_e2m1_codes(values)


def test_e2m1_documented_ties_and_signs():
    ties = {0.25: 0, 0.75: 1, 1.25: 1, 1.75: 2, 2.5: 2, 3.5: 4, 5.0: 4}
    for y, value in ties.items():
        assert e2m1.decode(e2m1.encode(y)) == value
        assert e2m1.decode(e2m1.encode(-y)) == -value
    assert e2m1.encode(-0.0) == 0x8
    assert e2m1.encode(0.0) == 0x0
    assert e2m1.encode(-0.2) == 0x8  # rounds to zero, keeps the sign
    for bad in (6.0001, -7.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            e2m1.encode(bad)


# ============================================================================ E4M3


def test_e4m3_decode_all_patterns_matches_ml_dtypes():
    want = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    got = np.array([e4m3.decode(b) for b in range(256)], np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(want[[0x7F, 0xFF]]).all() and np.isnan(want).sum() == 2
    finite = ~np.isnan(want)
    assert np.array_equal(bits(got)[finite], bits(want)[finite])  # -0.0 for 0x80 included
    assert e4m3.VALUES[-1] == 448.0 == e4m3.decode(0x7E)


def e4m3_test_values() -> np.ndarray:
    finite = np.array(e4m3.VALUES, np.float32)
    mids = (finite[:-1] + finite[1:]) / 2
    rng = np.random.default_rng(2)
    subnormal_range = rng.uniform(0, 2.0**-6, 2000).astype(np.float32)
    log_uniform = np.exp2(rng.uniform(-40, np.log2(448), 3000)).astype(np.float32)
    tiny = f32_array([2.0**-126, 1e-30, 2.0**-10, 2.0**-11, 448.0])
    v = np.concatenate([f32_neighbours(finite), f32_neighbours(mids), subnormal_range])
    v = np.concatenate([v, log_uniform, tiny])
    v = v[np.abs(v) <= 448]
    return np.concatenate([with_negatives(v), f32_array([0.0, -0.0])])


def test_e4m3_encode_matches_ml_dtypes():
    values = e4m3_test_values()
    got = [e4m3.encode(float(v)) for v in values]
    assert got == values.astype(E4M3).view(np.uint8).tolist()


def test_e4m3_bisect_equals_linear_scan():
    values = e4m3_test_values()[::3]
    assert [e4m3.encode(float(v)) for v in values] == [e4m3.encode_linear(float(v)) for v in values]


def test_e4m3_clamped_values_above_448():
    # After kvq's clamp, values in (448, 464] become 448; ml_dtypes rounds them to 448 too
    # (and gives NaN above 464, which is why kvq clamps first).
    above = np.linspace(448, 464, 50, dtype=np.float32)
    above = np.concatenate([above, np.nextafter(f32_array([448.0]), np.float32(np.inf))])
    for v in with_negatives(above):
        clamped = min(max(float(v), -448.0), 448.0)
        want = np.array([v], np.float32).astype(E4M3).view(np.uint8)[0]
        assert e4m3.encode(clamped) == want
    for bad in (448.001, -500.0, math.inf):
        with pytest.raises(ValueError):
            e4m3.encode(bad)


def test_e4m3_special_patterns():
    assert e4m3.encode(math.nan) == 0x7F
    assert e4m3.encode(-0.0) == 0x80
    assert e4m3.encode(0.0) == 0x00
    assert e4m3.encode(2.0**-10) == 0x00  # tie between 0 and 2**-9: even pattern 0
    assert e4m3.encode(3 * 2.0**-10) == 0x02  # tie between 1 and 2 (x 2**-9): even pattern
    assert e4m3.encode(-(2.0**-126)) == 0x80


# ============================================================================ scalar model


def random_f32_patterns(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)


def test_f16_rounding_matches_numpy():
    rng = np.random.default_rng(3)
    f16_finite = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    ties = ((f16_finite[:-1] + f16_finite[1:]) / 2).astype(np.float32)  # exact in float32
    random_bits = random_f32_patterns(20000, 4).view(np.float32)
    edge = f32_array([65504, 65519.99, 65520, 65536, 1e6, 3e38, 2.0**-24, 2.0**-25, 2.0**-26])
    small = rng.uniform(-(2.0**-13), 2.0**-13, 2000).astype(np.float32)
    v = np.concatenate([with_negatives(ties[::7]), random_bits, with_negatives(edge), small])
    v = v[~np.isnan(v)]
    with np.errstate(over="ignore"):
        want = v.astype(np.float16).view(np.uint16).tolist()
    assert [scalar.f16_bits(float(x)) for x in v] == want
    assert scalar.f16_bits(math.nan) == scalar.F16_NAN_BITS == 0x7E00
    assert scalar.f16_bits(-math.inf) == 0xFC00


def test_bf16_rounding_matches_ml_dtypes():
    random_bits = random_f32_patterns(20000, 5)
    tie_bits = (random_f32_patterns(5000, 6) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    edge = f32_array([scalar.F32_MAX, -scalar.F32_MAX, 3.3895314e38, 3.3961776e38, np.inf])
    v = np.concatenate([random_bits.view(np.float32), tie_bits.view(np.float32), edge])
    v = v[~np.isnan(v)]
    want = v.astype(BF16).view(np.uint16).tolist()
    assert [scalar.bf16_bits(float(x)) for x in v] == want
    assert scalar.bf16_bits(-math.nan) == 0x7FC0
    assert scalar.bits_to_bf16(0x3F80) == 1.0


def test_f32_rounding_matches_numpy():
    rng = np.random.default_rng(7)
    doubles = np.concatenate(
        [
            rng.standard_normal(5000) * 10.0 ** rng.integers(-30, 30, 5000),
            [3.4028235677973366e38, 3.4028235677973362e38, 1e39, -1e39, 1 / 3, 2.0**-149],
        ]
    )
    with np.errstate(over="ignore"):
        want = doubles.astype(np.float32)
    assert [scalar.f32(float(x)) for x in doubles] == want.astype(np.float64).tolist()
    assert scalar.f32(1e39) == math.inf and scalar.f32(-1e39) == -math.inf


@pytest.mark.parametrize(
    ("op", "np_op"),
    [
        (scalar.add, np.add),
        (scalar.sub, np.subtract),
        (scalar.mul, np.multiply),
        (scalar.div, np.divide),
    ],
)
def test_f32_ops_match_numpy_float32(op, np_op):
    # Random float32 operands of wildly different magnitudes; numpy float32 arithmetic is
    # correctly rounded. Compare after flushing numpy's operands and results ourselves.
    def flush(v):
        return np.where(np.abs(v) < np.float32(2.0**-126), np.copysign(np.float32(0), v), v)

    a = flush(random_f32_patterns(6000, 8).view(np.float32))
    b = flush(random_f32_patterns(6000, 9).view(np.float32))
    with np.errstate(all="ignore"):
        want = flush(np_op(a, b).astype(np.float32))
    got = f32_array([op(float(x), float(y)) for x, y in zip(a, b, strict=True)])
    assert same_bits(got, want)


def test_f32_ops_known_roundings():
    assert scalar.add(1.0, 2.0**-24) == 1.0  # tie, to even
    assert scalar.add(1.0, 3 * 2.0**-24) == 1.0 + 2.0**-22  # tie, to even (up)
    assert scalar.add(1.0, 2.0**-24 + 2.0**-40) == 1.0 + 2.0**-23  # above the tie
    assert scalar.div(1.0, 3.0) == float(np.float32(1 / 3))
    assert scalar.div(2.0, 3.0) == float(np.float32(2) / np.float32(3))
    assert scalar.mul(2.0**100, 2.0**100) == math.inf
    assert scalar.mul(-(2.0**100), 2.0**100) == -math.inf
    assert float(np.float32(1) / np.float32(6)) == nvfp4.ONE_SIXTH


def test_flush_to_zero_results_and_inputs():
    tiny = 2.0**-127  # subnormal in float32
    assert scalar.ftz(tiny) == 0.0 and not scalar.signbit(scalar.ftz(tiny))
    assert scalar.ftz(-tiny) == 0.0 and scalar.signbit(scalar.ftz(-tiny))
    assert scalar.ftz(2.0**-126) == 2.0**-126
    assert math.isnan(scalar.ftz(math.nan)) and scalar.ftz(-math.inf) == -math.inf
    # results
    assert scalar.mul(2.0**-63, 2.0**-63) == 2.0**-126  # smallest normal survives
    r = scalar.mul(-(2.0**-64), 2.0**-63)  # -2**-127: flushed, sign kept
    assert r == 0.0 and scalar.signbit(r)
    assert scalar.sub(1.5 * 2.0**-126, 2.0**-126) == 0.0  # exact difference is subnormal
    assert scalar.div(2.0**-100, 2.0**30) == 0.0
    # inputs (DAZ): a subnormal operand reads as zero
    assert scalar.add(2.0**-130, 2.0**-126) == 2.0**-126  # exact sum would be representable
    assert scalar.mul(tiny, 2.0**100) == 0.0  # exact product 2**-27
    assert scalar.div(1.0, tiny) == math.inf  # division by a flushed zero
    assert scalar.div(1.0, -tiny) == -math.inf
    assert scalar.round_f32(3 * 2.0**-151) == 0.0


def test_division_by_zero_and_nan_bits():
    assert scalar.div(1.0, 0.0) == math.inf
    assert scalar.div(-1.0, 0.0) == -math.inf
    assert scalar.div(1.0, -0.0) == -math.inf
    assert math.isnan(scalar.div(0.0, 0.0))
    assert math.isnan(scalar.div(math.nan, 0.0))
    assert scalar.div(math.inf, -0.0) == -math.inf
    # x86 produces a negative NaN for inf - inf; the bit helpers write the canonical one.
    assert scalar.f32_to_bits(scalar.sub(math.inf, math.inf)) == 0x7FC00000
    assert scalar.bits_to_f32(0x7F7FFFFF) == scalar.F32_MAX
    assert scalar.f32_to_bits(-0.0) == 0x80000000


# ============================================================================ INT4


def int4_codes(enc: oracle.OraclePacked) -> np.ndarray:
    """Unpacked 4-bit codes [T, H, D] of an int4/nvfp4 OraclePacked (numpy, test side)."""
    packed = enc.arrays["codes"]
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:2], -1)
    return codes[..., : enc.shape[2]]


def one_group(values, dtype=np.float32) -> np.ndarray:
    """Values as one channel group: shape [1, 1, D]."""
    return np.asarray(values, dtype=dtype).reshape(1, 1, -1)


@pytest.mark.parametrize(("k", "offset"), [(0.5, 0.0), (3.0, 0.0), (1.0, -8.0), (0.25, 100.0)])
def test_int4_ramp_codes(k, offset):
    x = one_group(np.arange(16) * k + offset)
    enc = oracle.pack(x, format="int4", kind="value", group_size=16)
    assert int4_codes(enc).ravel().tolist() == list(range(16))
    assert enc.arrays["codes"].ravel().tolist() == [2 * j | (2 * j + 1) << 4 for j in range(8)]
    assert enc.arrays["minimum"].ravel().tolist() == [offset]
    assert enc.arrays["scale"].ravel().tolist() == [k]
    assert np.array_equal(oracle.unpack(enc), x)


def test_int4_round_half_even():
    # span 15 -> scale 1.0, so q = x exactly: halves must round to even.
    x = one_group([0.0, 15.0, 0.5, 1.5, 2.5, 3.5, 14.5, 7.49999, 7.50001, 12.5])
    enc = oracle.pack(x, format="int4", kind="value", group_size=16)
    assert int4_codes(enc).ravel().tolist() == [0, 15, 0, 2, 2, 4, 14, 7, 8, 12]


def test_int4_codes_use_float32_metadata_decode_uses_float16():
    x = one_group([0.1, 0.7, 0.4])  # 0.1 is not a float16 value
    enc = oracle.pack(x, format="int4", kind="value")
    mn, mx = np.float32(0.1), np.float32(0.7)
    scale = (mx - mn) / np.float32(15)
    q = (x.ravel() - mn) / scale
    assert int4_codes(enc).ravel().tolist() == np.clip(np.rint(q), 0, 15).astype(int).tolist()
    assert enc.arrays["minimum"].ravel()[0] == np.float16(mn)
    assert enc.arrays["scale"].ravel()[0] == np.float16(scale)
    codes = int4_codes(enc).ravel().astype(np.float32)
    want = codes * np.float32(np.float16(scale)) + np.float32(np.float16(mn))
    assert np.array_equal(oracle.unpack(enc).ravel(), want)


def test_int4_zero_span_and_signed_zero_minimum():
    x = np.array([[[3.0, 3.0, 3.0]], [[-0.0, 0.0, 1.5]], [[-0.0, -0.0, -0.0]]], np.float32)
    enc = oracle.pack(x, format="int4", kind="value", group_size=3)
    assert bits(enc.arrays["minimum"]).ravel().tolist() == [0x4200, 0x0000, 0x0000]
    assert bits(enc.arrays["scale"]).ravel().tolist() == [0x3C00, 0x2E66, 0x3C00]  # 1.0, 0.1
    assert int4_codes(enc).ravel().tolist() == [0, 0, 0, 0, 0, 15, 0, 0, 0]
    out = oracle.unpack(enc)
    assert out[0].ravel().tolist() == [3.0, 3.0, 3.0]
    assert bits(out[2]).ravel().tolist() == [0, 0, 0]  # +0.0: code 0 * 1.0 + (+0.0)


def test_int4_partial_groups_both_axes():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((5, 2, 7)).astype(np.float32)
    enc = oracle.pack(x, format="int4", kind="key", group_size=2)  # tokens
    assert enc.axis == "tokens" and enc.arrays["minimum"].shape == (3, 2, 7)
    last = x[4]  # the partial token group holds one row: span 0
    assert np.array_equal(enc.arrays["minimum"][2], last.astype(np.float16))
    assert (enc.arrays["scale"][2] == 1.0).all()
    assert (int4_codes(enc)[4] == 0).all()
    full = x[0:2].min(axis=0)
    assert np.array_equal(enc.arrays["minimum"][0], full.astype(np.float16))

    enc = oracle.pack(x, format="int4", kind="value", group_size=3)  # channels: 3, 3, 1
    assert enc.axis == "channels" and enc.arrays["minimum"].shape == (5, 2, 3)
    assert np.array_equal(enc.arrays["minimum"][..., 2], x[..., 6].astype(np.float16))
    assert np.array_equal(enc.arrays["minimum"][..., 1], x[..., 3:6].min(-1).astype(np.float16))


def test_int4_odd_d_padding_nibble():
    x = one_group([0.0, 1.0, 15.0])
    enc = oracle.pack(x, format="int4", kind="value")
    assert enc.arrays["codes"].shape == (1, 1, 2)
    assert enc.arrays["codes"].ravel().tolist() == [0x10, 0x0F]  # high nibble of byte 1 is 0
    bad = dict(enc.arrays, codes=enc.arrays["codes"] | np.uint8(0x10))
    forged = oracle.OraclePacked(**{**vars(enc), "arrays": bad})
    with pytest.raises(ValueError, match="padding nibble"):
        oracle.unpack(forged)


def test_int4_non_finite_group():
    x = one_group([1.0, 2.0, np.nan, 4.0, 5.0, 6.0, -np.inf, 0.0, 0.0, 15.0, 3.0, 6.0])
    enc = oracle.pack(x, format="int4", kind="value", group_size=4)  # groups 0, 1 bad
    assert bits(enc.arrays["minimum"]).ravel().tolist() == [0x7E00, 0x7E00, 0x0000]
    assert bits(enc.arrays["scale"]).ravel().tolist()[:2] == [0x7E00, 0x7E00]
    assert (int4_codes(enc).ravel()[:8] == 0).all()
    out = oracle.unpack(enc).ravel()
    assert np.isnan(out[:8]).all()
    assert out[8:].tolist() == [0.0, 15.0, 3.0, 6.0]  # the finite group is unaffected


def test_int4_float16_overflow_decodes_non_finite():
    x = one_group([0.0, 1e6])  # span / 15 = 66666.7 > 65504
    enc = oracle.pack(x, format="int4", kind="value")
    assert bits(enc.arrays["scale"]).ravel().tolist() == [0x7C00]
    out = oracle.unpack(enc).ravel()
    assert np.isnan(out[0]) and out[1] == np.inf


# ============================================================================ NVFP4


def test_nvfp4_exact_e2m1_grid():
    # amax 6 -> g = 448, s = 448, v = 1: every E2M1 value encodes to itself.
    values = [e2m1.decode(c) for c in range(16)]
    x = one_group(values)
    enc = oracle.pack(x, format="nvfp4", kind="value")
    assert int4_codes(enc).ravel().tolist() == list(range(16))
    assert enc.arrays["global_scale"] == np.float32(448.0)
    assert bits(enc.arrays["block_scale"]).ravel().tolist() == [0x7E]
    assert same_bits(oracle.unpack(enc), x, nan_equal=False)  # -0.0 included


def test_nvfp4_block_scale_rounding_order():
    # s = g * (vmax * f32(1/6)): for this block that lands one float32 ulp above the E4M3
    # midpoint 0.390625 and rounds up to 0x2D; the other order, (g * vmax) / 6, would give
    # exactly the midpoint and round to the even pattern 0x2C.
    x = one_group([6.0] + [0.0] * 15 + [0.0052315848879516125] + [0.0] * 15)
    enc = oracle.pack(x, format="nvfp4", kind="value")
    assert enc.arrays["global_scale"] == np.float32(448)
    s = np.float32(448) * (np.float32(0.0052315848879516125) * np.float32(1 / 6))
    assert s > np.float32(0.390625)
    assert bits(enc.arrays["block_scale"]).ravel().tolist() == [0x7E, 0x2D]
    assert bits(np.array([s]).astype(E4M3)).tolist() == [0x2D]


def test_nvfp4_all_zero_tensor():
    x = np.zeros((3, 2, 32), np.float32)
    enc = oracle.pack(x, format="nvfp4", kind="key")
    assert enc.arrays["global_scale"] == np.float32(1.0)
    assert not bits(enc.arrays["block_scale"]).any() and not enc.arrays["codes"].any()
    assert not bits(oracle.unpack(enc)).any()  # exact +0.0
    x[1, 1, 5] = -0.0  # a negative zero keeps its sign bit even here (code 0x8)
    enc = oracle.pack(x, format="nvfp4", kind="key")
    assert int4_codes(enc)[1, 1, 5] == 0x8 and int4_codes(enc).sum() == 0x8
    out = oracle.unpack(enc)
    assert out[1, 1, 5] == 0 and np.signbit(out[1, 1, 5]) and np.signbit(out).sum() == 1


def test_nvfp4_negative_rounding_to_zero_keeps_sign():
    x = one_group([6.0, -0.2, 0.2, -0.0, 0.0])
    enc = oracle.pack(x, format="nvfp4", kind="value")
    assert int4_codes(enc).ravel().tolist() == [0x7, 0x8, 0x0, 0x8, 0x0]
    assert np.signbit(oracle.unpack(enc).ravel()).tolist() == [False, True, False, True, False]


def test_nvfp4_tiny_tensor_rule():
    x = one_group([1e-36, 5e-37, -2.5e-37, 0.0])  # 2688 / 1e-36 overflows float32
    enc = oracle.pack(x, format="nvfp4", kind="value")
    assert bits(enc.arrays["global_scale"]).item() == 0x7F7FFFFF  # float32 max
    g = scalar.F32_MAX
    s = float(np.float32(g) * (np.float32(1e-36) * np.float32(1 / 6)))
    sf = e4m3.decode(e4m3.encode(min(s, 448.0)))
    # 1/g is subnormal -> flushed -> v == 0 with sf > 0: the fallback y = (x * g) / sf.
    assert scalar.div(1.0, g) == 0.0 and sf > 0
    y = (x.ravel() * np.float32(g)) / np.float32(sf)
    want = ml_e2m1_codes(np.clip(y, -6, 6))
    assert int4_codes(enc).ravel().tolist() == want == [7, 5, 11, 0]  # 6, 3, -1.5, 0
    out = oracle.unpack(enc).ravel()
    assert np.abs(out[:3] - x.ravel()[:3]).max() < 0.3 * 1e-36


@pytest.mark.parametrize(
    ("amax", "tiny_block"),
    [
        (1e-35, None),  # g finite, 1/g subnormal -> flushed: v == 0 in every block
        (1e-33, 7.052966e-38),  # 1/g normal; the small block's v = sf * (1/g) underflows
    ],
)
def test_nvfp4_tiny_scale_fallback(amax, tiny_block):
    rng = np.random.default_rng(11)
    big = rng.uniform(-1, 1, 16).astype(np.float32) * np.float32(amax)
    big[3] = amax
    small = np.zeros(16, np.float32) if tiny_block is None else np.full(16, tiny_block, np.float32)
    if tiny_block is not None:
        small[1:] *= rng.uniform(0.2, 1, 15).astype(np.float32)
        small[0] = tiny_block
    x = np.concatenate([big, small]).reshape(1, 1, 32).astype(np.float32)
    enc = oracle.pack(x, format="nvfp4", kind="value")
    g = float(enc.arrays["global_scale"])
    assert g == float(np.float32(2688) / np.float32(amax)) and g < scalar.F32_MAX
    inv_g = scalar.div(1.0, g)
    sfs = enc.arrays["block_scale"].astype(np.float32).ravel()
    block = 0 if tiny_block is None else 1
    sf = float(sfs[block])
    assert sf > 0 and scalar.mul(sf, inv_g) == 0.0  # the fallback condition
    xb = x.ravel()[16 * block : 16 * block + 16]
    y = (xb * np.float32(g)) / np.float32(sf)  # float32, all normal here
    want = ml_e2m1_codes(np.clip(y, -6, 6))
    got = int4_codes(enc).ravel()[16 * block : 16 * block + 16].tolist()
    assert got == want
    assert max(c & 7 for c in got) >= 6  # not the all-zero codes the reciprocal path gives
    out = oracle.unpack(enc).ravel()[16 * block : 16 * block + 16]
    if tiny_block is None:
        err = np.linalg.norm(out.astype(np.float64) - xb) / np.linalg.norm(xb.astype(np.float64))
        assert err < 0.2
    else:  # decode's step sf / g = 0.03125 / 2.688e36 is subnormal: flushed, zeros come out
        assert scalar.div(sf, g) == 0.0 and not out.any()


def test_nvfp4_non_finite_tensor():
    x = np.ones((2, 1, 32), np.float32)
    x[1, 0, 17] = np.inf
    enc = oracle.pack(x, format="nvfp4", kind="value")
    assert bits(enc.arrays["global_scale"]).item() == 0x7FC00000
    assert (bits(enc.arrays["block_scale"]) == 0x7F).all()
    assert not enc.arrays["codes"].any()
    assert np.isnan(oracle.unpack(enc)).all()


def test_nvfp4_partial_blocks():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((20, 1, 19)).astype(np.float32)
    for kind, meta in (("key", (2, 1, 19)), ("value", (20, 1, 2))):
        enc = oracle.pack(x, format="nvfp4", kind=kind)
        assert enc.arrays["block_scale"].shape == meta
    enc = oracle.pack(x, format="nvfp4", kind="value")
    g = np.float32(enc.arrays["global_scale"])
    vmax = np.abs(x[..., 16:]).max(-1)  # the 3-channel partial block
    s = np.minimum(g * (vmax * np.float32(1 / 6)), np.float32(448)).astype(E4M3)
    assert np.array_equal(bits(enc.arrays["block_scale"][..., 1]), bits(s))


# ============================================================================ FP8


def test_fp8_rows():
    x = np.array(
        [
            [[448.0, -0.0, 1.0, -3.0]],  # s = 1: codes are e4m3(x) themselves
            [[0.0, -0.0, 0.0, 0.0]],  # zero row: s = 0, codes +0
            [[1.0, np.nan, 2.0, 3.0]],  # non-finite row
            [[1e-36, -1e-36, 0.0, 0.0]],  # s = amax / 448 is subnormal -> flushed -> 0
        ],
        np.float32,
    )
    enc = oracle.pack(x, format="fp8_e4m3", kind="key")
    scale_bits = bits(enc.arrays["scale"]).ravel().tolist()
    assert scale_bits == [0x3F800000, 0, 0x7FC00000, 0]
    codes = bits(enc.arrays["codes"]).reshape(4, 4).tolist()
    assert codes[0] == x[0].astype(E4M3).view(np.uint8).ravel().tolist()
    assert codes[0][1] == 0x80  # signed zero in a row with s > 0
    assert codes[1] == codes[2] == codes[3] == [0, 0, 0, 0]
    out = oracle.unpack(enc)
    assert same_bits(out[0], x[0], nan_equal=False)
    assert not bits(out[1]).any() and not bits(out[3]).any()
    assert np.isnan(out[2]).all()


def test_fp8_matches_numpy_reference():
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((7, 3, 24)) * 10.0 ** rng.integers(-5, 5, (7, 3, 1))).astype(
        np.float32
    )
    enc = oracle.pack(x, format="fp8_e4m3", kind="value")
    s = np.abs(x).max(-1) / np.float32(448)
    codes = np.clip(x / s[..., None], -448, 448).astype(E4M3)
    assert np.array_equal(bits(enc.arrays["scale"]), bits(s))
    assert np.array_equal(bits(enc.arrays["codes"]), bits(codes))
    assert np.array_equal(oracle.unpack(enc), codes.astype(np.float32) * s[..., None])


# ============================================================================ numpy re-derivations


def int4_numpy(x: np.ndarray, group: int):
    """INT4 over channel groups, vectorized numpy float32 (valid for normal-range data)."""
    d = x.shape[2]
    codes = np.zeros(x.shape, np.int64)
    mins, scales = [], []
    for j in range(0, d, group):
        xg = x[..., j : j + group]
        mn, mx = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
        span = mx - mn
        scale = np.where(span > 0, span / np.float32(15), np.float32(1))
        codes[..., j : j + group] = np.clip(np.rint((xg - mn) / scale), 0, 15)
        mins.append(mn[..., 0])
        scales.append(scale[..., 0])
    return codes, np.stack(mins, -1).astype(np.float16), np.stack(scales, -1).astype(np.float16)


@pytest.mark.parametrize(("group", "dtype"), [(64, BF16), (32, np.float16), (7, np.float32)])
def test_int4_matches_numpy_reference(group, dtype):
    x = np.random.default_rng(14).standard_normal((6, 3, 100)).astype(dtype)
    enc = oracle.pack(x, format="int4", kind="value", group_size=group)
    codes, mins, scales = int4_numpy(x.astype(np.float32), group)
    assert np.array_equal(int4_codes(enc), codes)
    assert np.array_equal(bits(enc.arrays["minimum"]), bits(mins))
    assert np.array_equal(bits(enc.arrays["scale"]), bits(scales))
    # keys (tokens axis) are the transposed problem
    enc_k = oracle.pack(x, format="int4", kind="key", group_size=group)
    xt = np.ascontiguousarray(x.astype(np.float32).transpose(2, 1, 0))
    codes_t, mins_t, _ = int4_numpy(xt, group)
    assert np.array_equal(int4_codes(enc_k), codes_t.transpose(2, 1, 0))
    assert np.array_equal(bits(enc_k.arrays["minimum"]), bits(mins_t.transpose(2, 1, 0)))


def test_nvfp4_matches_numpy_reference():
    x = np.random.default_rng(15).standard_normal((8, 2, 48)).astype(np.float32)
    x[0, 0, :16] *= 1e-3  # a block with a small scale
    enc = oracle.pack(x, format="nvfp4", kind="value")
    g = np.float32(2688) / np.abs(x).max()
    xb = x.reshape(8, 2, 3, 16)
    vmax = np.abs(xb).max(-1, keepdims=True)
    s8 = np.minimum(g * (vmax * np.float32(1 / 6)), np.float32(448)).astype(E4M3)
    sf = s8.astype(np.float32)
    r = np.float32(1) / (sf * (np.float32(1) / g))
    y = np.clip(xb * r, -6, 6)
    assert enc.arrays["global_scale"] == g
    assert np.array_equal(bits(enc.arrays["block_scale"]), bits(s8[..., 0]))
    assert int4_codes(enc).ravel().tolist() == ml_e2m1_codes(y.ravel())
    decoded = y.astype(F4).astype(np.float32) * (sf / g)
    assert np.array_equal(oracle.unpack(enc), decoded.reshape(x.shape))


# ============================================================================ decode / API


@pytest.mark.parametrize("fmt", oracle.FORMATS)
@pytest.mark.parametrize("in_dtype", VALUE_DTYPES)
def test_decode_output_dtypes_round_the_float32_result(fmt, in_dtype):
    rng = np.random.default_rng(16)
    x = (rng.standard_normal((5, 2, 33)) * 100).astype(in_dtype)
    x[0, 0, 0] = np.nan  # non-finite data too
    enc = oracle.pack(x, format=fmt, kind="key")
    assert enc.dtype == np.dtype(in_dtype)
    out32 = oracle.unpack(enc, np.float32)
    assert oracle.unpack(enc).dtype == np.dtype(in_dtype)
    for dtype in VALUE_DTYPES:
        out = oracle.unpack(enc, dtype)
        assert out.dtype == dtype and out.shape == x.shape
        assert same_bits(out, out32.astype(dtype))


def test_input_widening_flushes_subnormals():
    # float32 and bfloat16 subnormals are flushed on entry; float16 subnormals are normal
    # in float32 and are kept.
    sub32 = np.array([2.0**-130, -(2.0**-130), 1.0], np.float32).reshape(1, 1, 3)
    assert oracle.widen(sub32) == [0.0, -0.0, 1.0] and scalar.signbit(oracle.widen(sub32)[1])
    assert oracle.widen(sub32.astype(BF16))[:2] == [0.0, 0.0]
    sub16 = np.array([2.0**-24, 1.0], np.float16).reshape(1, 1, 2)
    assert oracle.widen(sub16) == [2.0**-24, 1.0]
    enc = oracle.pack(np.array([[[2.0**-130, 0.0]]], np.float32), format="nvfp4", kind="value")
    assert enc.arrays["global_scale"] == 1.0  # all-zero after the flush


@pytest.mark.parametrize("fmt", oracle.FORMATS)
def test_empty_tensor(fmt):
    x = np.zeros((0, 3, 10), BF16)
    enc = oracle.pack(x, format=fmt, kind="key")
    for name, (dtype, shape) in oracle.array_spec(fmt, x.shape, enc.axis, enc.group_size).items():
        assert enc.arrays[name].dtype == dtype and enc.arrays[name].shape == shape
        if name != "global_scale":
            assert enc.arrays[name].shape[0] == 0
    if fmt == "nvfp4":
        assert enc.arrays["global_scale"] == np.float32(1.0)
    out = oracle.unpack(enc)
    assert out.shape == (0, 3, 10) and out.dtype == BF16


@pytest.mark.parametrize(
    ("fmt", "kind", "group", "want"),
    [
        ("int4", "key", None, {"codes": (7, 2, 19), "minimum": (1, 2, 37), "scale": (1, 2, 37)}),
        ("int4", "value", 8, {"codes": (7, 2, 19), "minimum": (7, 2, 5), "scale": (7, 2, 5)}),
        ("int4", "key", 3, {"codes": (7, 2, 19), "minimum": (3, 2, 37), "scale": (3, 2, 37)}),
        ("nvfp4", "key", None, {"codes": (7, 2, 19), "block_scale": (1, 2, 37)}),
        ("nvfp4", "value", 16, {"codes": (7, 2, 19), "block_scale": (7, 2, 3)}),
        ("fp8_e4m3", "key", None, {"codes": (7, 2, 37), "scale": (7, 2)}),
        ("fp8_e4m3", "value", 37, {"codes": (7, 2, 37), "scale": (7, 2)}),
    ],
)
def test_array_shapes_and_dtypes(fmt, kind, group, want):
    x = np.random.default_rng(17).standard_normal((7, 2, 37)).astype(np.float16)
    enc = oracle.pack(x, format=fmt, kind=kind, group_size=group)
    dtypes = {
        "int4": {"codes": np.uint8, "minimum": np.float16, "scale": np.float16},
        "nvfp4": {"codes": np.uint8, "block_scale": E4M3, "global_scale": np.float32},
        "fp8_e4m3": {"codes": E4M3, "scale": np.float32},
    }[fmt]
    assert set(enc.arrays) == set(dtypes)
    for name, dtype in dtypes.items():
        assert enc.arrays[name].dtype == np.dtype(dtype), name
    assert {n: a.shape for n, a in enc.arrays.items() if n != "global_scale"} == want
    if fmt == "nvfp4":
        assert enc.arrays["global_scale"].shape == ()
    assert enc.shape == (7, 2, 37) and enc.kind == kind and enc.format == fmt
    assert enc.axis == ("channels" if fmt == "fp8_e4m3" else oracle.DEFAULT_AXIS[kind])


def test_layout_groups_cover_every_element_once():
    shape = (5, 2, 7)
    for axis in oracle.AXES:
        for g in (1, 2, 3, 16):
            members = [e for grp in layout.groups(shape, axis, g) for e in grp]
            assert sorted(members) == list(range(70))
            assert len(layout.groups(shape, axis, g)) == math.prod(
                layout.metadata_shape(shape, axis, g)
            )


X = np.zeros((4, 2, 32), np.float32)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"values": X[0]}, ValueError, "values"),
        ({"values": X.astype(np.float64)}, TypeError, "values"),
        ({"values": X.tolist()}, TypeError, "values"),
        ({"format": "int8"}, ValueError, "format"),
        ({"kind": "query"}, ValueError, "kind"),
        ({"axis": "heads"}, ValueError, "axis"),
        ({"group_size": 0}, ValueError, "group_size"),
        ({"group_size": 1.5}, TypeError, "group_size"),
        ({"group_size": True}, TypeError, "group_size"),
        ({"format": "nvfp4", "group_size": 32}, ValueError, "group_size"),
        ({"format": "fp8_e4m3", "group_size": 16}, ValueError, "group_size"),
        ({"format": "fp8_e4m3", "axis": "tokens"}, ValueError, "axis"),
    ],
)
def test_pack_errors_name_the_argument(kwargs, error, name):
    args = {"values": X, "format": "int4", "kind": "key", **kwargs}
    with pytest.raises(error, match=name):
        oracle.pack(args.pop("values"), **args)


def test_unpack_errors_name_the_argument():
    enc = oracle.pack(X, format="nvfp4", kind="key")
    with pytest.raises(TypeError, match="dtype"):
        oracle.unpack(enc, np.float64)
    with pytest.raises(TypeError, match="enc"):
        oracle.unpack(enc.arrays)
    wrong = oracle.OraclePacked(**{**vars(enc), "arrays": dict(enc.arrays, global_scale=1.0)})
    with pytest.raises(ValueError, match=r"enc\.arrays"):
        oracle.unpack(wrong)
    missing = {k: v for k, v in enc.arrays.items() if k != "codes"}
    with pytest.raises(ValueError, match=r"enc\.arrays"):
        oracle.unpack(oracle.OraclePacked(**{**vars(enc), "arrays": missing}))
    assert oracle.unpack(enc, np.float16).dtype == np.float16
    # an explicit fp8 group size equal to D is accepted
    assert oracle.pack(X, format="fp8_e4m3", kind="key", group_size=32).group_size == 32


def test_mismatches_reports_differences():
    x = np.random.default_rng(18).standard_normal((3, 2, 20)).astype(BF16)
    enc = oracle.pack(x, format="int4", kind="value", group_size=8)
    assert oracle.mismatches(enc.arrays, dict(enc.arrays)) == []
    tampered = dict(enc.arrays, codes=enc.arrays["codes"].copy())
    tampered["codes"][1, 0, 3] ^= 1
    problems = oracle.mismatches(enc.arrays, tampered)
    assert len(problems) == 1 and problems[0].startswith("codes[1, 0, 3]")
    nan = np.array([np.nan], np.float32)
    assert oracle.mismatches(nan, -nan) and not oracle.mismatches(nan, -nan, nan_equal=True)
    assert oracle.mismatches(enc.arrays["scale"], enc.arrays["scale"].astype(np.float32))


@pytest.mark.parametrize(("fmt", "bound"), [("int4", 0.15), ("nvfp4", 0.15), ("fp8_e4m3", 0.05)])
def test_reconstruction_error_is_sane(fmt, bound):
    x = np.random.default_rng(19).standard_normal((64, 4, 64)).astype(np.float32)
    for kind in oracle.KINDS:
        out = oracle.unpack(oracle.pack(x, format=fmt, kind=kind)).astype(np.float64)
        err = np.linalg.norm(out - x) / np.linalg.norm(x)
        assert 0 < err < bound, (kind, err)


# ============================================================================ independence


def oracle_sources() -> dict[str, ast.Module]:
    files = sorted(ORACLE_DIR.glob("*.py"))
    assert {f.name for f in files} >= FORMAT_ORACLE_FILES
    return {f.name: ast.parse(f.read_text()) for f in files}


#: The format oracle's own modules (others in the package, e.g. residual.py, only get the
#: no-JAX and no-astype checks).
FORMAT_ORACLE_FILES = {
    "__init__.py",
    "scalar.py",
    "e2m1.py",
    "e4m3.py",
    "layout.py",
    "int4.py",
    "nvfp4.py",
    "fp8_e4m3.py",
    "hadamard.py",
    "heavy.py",
    "rope.py",
}


def test_oracle_sources_use_numpy_only_as_a_container():
    allowed_np = {
        "ndarray",
        "dtype",
        "array",
        "asarray",
        "ascontiguousarray",
        "unravel_index",
        "float32",
        "float16",
        "uint8",
        "uint16",
        "uint32",
    }
    allowed_ml = {"bfloat16", "float8_e4m3fn"}
    for name, tree in oracle_sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                modules.append(getattr(node, "module", None) or "")
                for module in modules:
                    root = module.split(".")[0]
                    assert root not in {"jax", "jaxlib", "torch", "math_ops"}, (name, module)
                    if root == "kvq_jax" and module != "kvq_jax":
                        assert module.startswith("kvq_jax.oracle"), (name, module)
                if isinstance(node, ast.ImportFrom) and node.module == "kvq_jax":
                    assert [a.name for a in node.names] == ["oracle"], name
            if isinstance(node, ast.Attribute):
                assert node.attr not in {"astype", "round", "rint", "clip"}, (name, node.attr)
                if name not in FORMAT_ORACLE_FILES or not isinstance(node.value, ast.Name):
                    continue
                if node.value.id == "np":
                    assert node.attr in allowed_np, (name, node.attr)
                if node.value.id == "ml_dtypes":
                    assert node.attr in allowed_ml, (name, node.attr)


def test_oracle_imports_and_runs_without_jax():
    # Load kvq_jax.oracle with the package __init__ (which imports jax) bypassed and with
    # jax / jaxlib / torch imports made to fail; then pack and unpack every format.
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys, types
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "torch"):
                    raise ImportError("blocked: " + name)
                return None
        sys.meta_path.insert(0, Block())
        pkg = types.ModuleType("kvq_jax")
        pkg.__path__ = [{str(REPO / "kvq_jax")!r}]
        sys.modules["kvq_jax"] = pkg
        import numpy as np
        import kvq_jax.oracle as oracle
        x = np.linspace(-3, 3, 2 * 2 * 32, dtype=np.float32).reshape(2, 2, 32)
        for fmt in oracle.FORMATS:
            out = oracle.unpack(oracle.pack(x, format=fmt, kind="value"))
            assert out.shape == x.shape, fmt
        assert not [m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "torch")]
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
