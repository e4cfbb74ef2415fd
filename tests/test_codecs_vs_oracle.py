"""Every JAX codec against the scalar oracle, bit for bit (docs/FORMAT.md, docs/ORACLE.md).

Each input goes through the oracle (`kvq_jax.oracle`, plain Python) and through the jitted
codec (`kvq_jax.pack_kv` / `unpack_kv`). Every stored array (codes and all metadata) must have
the same bytes, and the decoded tensor in every output dtype must have the same bytes, except
that a decoded NaN matches any NaN (its sign and payload depend on the device).

The hand-built inputs (ties, midpoints, tiny and huge values, non-finite values) assert their
own construction with numpy float32 arithmetic, so they cannot silently stop hitting the case
they were written for. The expected bytes always come from the oracle, never from the codec.

Compile budget: `pack_kv` compiles once per (format, kind, axis, group size, shape, dtype).
All hand-built tensors are laid out in the one shape `SHAPE` and use the two default layouts
(int4 with group size `G4`), so they share their compiles with the random grid test.
"""

from __future__ import annotations

import functools
import zlib
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_packed_equal, assert_same_bytes, assert_same_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvq_jax import oracle, pack_kv, unpack_kv

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = (BF16, F16, F32)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FORMATS = ("int4", "nvfp4", "fp8_e4m3")
KINDS = ("key", "value")
AXIS_OF = {"key": "tokens", "value": "channels"}

#: The shape of every hand-built tensor and of the random grid: T = 40 and D = 37 leave
#: partial groups for G = 16 and 64 on both axes, and D is odd.
SHAPE = (40, 3, 37)
#: int4 group size for the hand-built tensors and the grid.
G4 = 16
#: nvfp4 block size.
G_NV = 16

F32_TINY = np.float32(2.0**-126)
F32_MAX = np.finfo(np.float32).max
INF = np.float32(np.inf)
#: float32 nearest to 1/6; 6 * ONE_SIXTH == 1 + 2**-25 exactly.
ONE_SIXTH = np.float32(1.0) / np.float32(6.0)
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: All finite non-negative E4M3 values (by bit pattern 0x00..0x7E) and their 126 midpoints.
E4M3_VALUES = np.arange(127, dtype=np.uint8).view(E4M3).astype(np.float64)
E4M3_MIDPOINTS = (E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2


def _dtype_max(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).max)


def _seed(*parts) -> int:
    """A stable seed from test parameters (Python's hash() is salted per process)."""
    return zlib.crc32(repr(parts).encode())


# ------------------------------------------------------------------------------------------
# comparing the codec with the oracle


def _pack(x, fmt, kind, *, group_size=None, axis=None):
    """pack_kv with None arguments omitted, so that every test hits the same jit cache entry."""
    kwargs = {k: v for k, v in (("group_size", group_size), ("axis", axis)) if v is not None}
    return pack_kv(x, kind=kind, format=fmt, **kwargs)


def check(x, fmt, kind, *, group_size=None, axis=None, out_dtypes=DTYPES, x_jax=None, what=""):
    """Pack numpy `x` with the oracle and (`x_jax`, default `x`) with the codec; assert that
    every stored array and the decoded values in each of `out_dtypes` agree. Returns the
    oracle's encoding."""
    what = what or f"{fmt} {kind} {np.dtype(x.dtype)} {x.shape}"
    expected = oracle.pack(np.asarray(x), format=fmt, kind=kind, group_size=group_size, axis=axis)
    packed = _pack(x if x_jax is None else x_jax, fmt, kind, group_size=group_size, axis=axis)
    for name in ("format", "kind", "axis", "group_size", "shape"):
        assert getattr(packed, name) == getattr(expected, name), f"{what}: {name}"
    assert np.dtype(packed.dtype) == expected.dtype, f"{what}: dtype"
    assert_packed_equal(packed, expected.arrays, what)
    for dt in out_dtypes:
        got = unpack_kv(packed, dtype=dt)
        assert_same_values(got, oracle.unpack(expected, dt), f"{what} decoded as {dt}")
    return expected


# ------------------------------------------------------------------------------------------
# building inputs


def _exact(values, dtype) -> np.ndarray:
    """Values (Python / float64) -> array of `dtype`; assert that each is represented exactly."""
    a = np.asarray(values, np.float64)
    out = a.astype(np.float32).astype(dtype)
    back = out.astype(np.float64)
    same = (back == a) & (np.signbit(back) == np.signbit(a))
    same |= np.isnan(a) & np.isnan(back)
    assert same.all(), f"not exact in {dtype}: {a[~same]}"
    return out


def _cast(values, dtype) -> np.ndarray:
    """Values -> array of `dtype`, rounded (for data that need not be exact; may give inf)."""
    with np.errstate(over="ignore"):
        return np.asarray(values, np.float64).astype(np.float32).astype(dtype)


def _next(a, dtype, toward) -> np.ndarray:
    """Element-wise neighbour of `a` in `dtype` toward `toward`."""
    a = np.asarray(a, dtype)
    return np.nextafter(a, np.full(a.shape, toward, dtype))


def _widen(x) -> np.ndarray:
    """Input dtype -> float32 with subnormals flushed (FORMAT.md section 0), for assertions."""
    return _ftz(np.asarray(x).astype(np.float32))


def _ftz(a) -> np.ndarray:
    a = np.asarray(a, np.float32)
    return np.where(np.abs(a) < F32_TINY, np.copysign(np.float32(0.0), a), a)


def _slots(axis: str, g: int, shape=SHAPE) -> list[tuple]:
    """Index tuples of every complete group of `shape` along `axis`."""
    t, h, d = shape
    if axis == "tokens":
        return [
            (slice(i * g, (i + 1) * g), j, c)
            for i in range(t // g)
            for j in range(h)
            for c in range(d)
        ]
    return [
        (i, j, slice(k * g, (k + 1) * g)) for i in range(t) for j in range(h) for k in range(d // g)
    ]


def _place(groups, axis, dtype, g, *, anchor=(), shape=SHAPE) -> list[np.ndarray]:
    """Lay out `groups` (each <= g values, cycled to fill its group) in the complete groups of
    zero tensors of `shape`; as many tensors as needed, each starting with the `anchor`
    groups (e.g. the element that fixes an NVFP4 tensor's global scale)."""
    slots = _slots(axis, g, shape)
    per = len(slots) - len(anchor)
    assert per > 0 and groups
    tensors = []
    for start in range(0, len(groups), per):
        x = np.zeros(shape, dtype)
        for slot, group in zip(slots, [*anchor, *groups[start : start + per]], strict=False):
            x[slot] = np.resize(np.asarray(group, dtype), g)
        tensors.append(x)
    return tensors


def _rows(rows, dtype, shape=SHAPE) -> list[np.ndarray]:
    """FP8: lay out rows of <= D values (cycled) in the (token, head) rows of `shape`."""
    return _place(rows, "channels", dtype, shape[2], shape=shape)


# ------------------------------------------------------------------------------------------
# numpy float32 mirrors of single format steps, used only to assert that an input was built
# right (the expected bytes always come from the oracle)


def _int4_q(group) -> tuple[np.ndarray, np.float32]:
    """(x - mn) / scale of one INT4 group (float32, no flush: used on normal values)."""
    x = _widen(group)
    mn, mx = x.min(), x.max()
    mn = np.float32(0.0) if mn == 0 else mn
    span = mx - mn
    scale = span / np.float32(15.0) if span > 0 else np.float32(1.0)
    return (x - mn) / scale, scale


def _nv_steps(amax, vmax) -> dict:
    """FORMAT.md section 3 for one block (max |x| = vmax) of a tensor with max |x| = amax:
    g, s, sf, v, in numpy float32 with flush-to-zero."""
    with np.errstate(over="ignore", divide="ignore"):
        amax, vmax = _widen(np.float32(amax)), _widen(np.float32(vmax))
        g = np.float32(1.0) if amax == 0 else _ftz(np.float32(2688.0) / amax)
        g = np.float32(F32_MAX) if np.isinf(g) else g
        s = np.minimum(_ftz(g * _ftz(vmax * ONE_SIXTH)), np.float32(448.0))
        sf = s.astype(E4M3).astype(np.float32)
        v = _ftz(sf * _ftz(np.float32(1.0) / g))
    return {"g": g, "s": s, "sf": sf, "v": v}


def _nv_y(x, amax) -> np.ndarray:
    """y (before clamping) for the elements of one NVFP4 block, float32 with flush."""
    x = _widen(x)
    steps = _nv_steps(amax, np.abs(x).max())
    g, sf, v = steps["g"], steps["sf"], steps["v"]
    if v == 0 and sf > 0:
        return _ftz(_ftz(x * g) / sf)
    r = _ftz(np.float32(1.0) / v) if v != 0 else np.float32(0.0)
    return _ftz(x * r)


# ------------------------------------------------------------------------------------------
# random data: a mix of distributions shared by the grid, hypothesis and vmap tests

DISTS = ("normal", "heavy", "channel_offsets", "int4_ties", "e2m1", "e4m3", "magnitudes")


def _random_values(rng, shape, dtype, dist, zeros=0.05) -> np.ndarray:
    """Random [T, H, D] data of `dtype` drawn from `dist`, with a fraction of signed zeros."""
    t, h, d = shape
    if dist == "normal":
        x = rng.standard_normal(shape)
    elif dist == "heavy":  # Student t, df 1.2: heavy tails, outliers of 1e3..1e5
        x = rng.standard_t(1.2, shape)
    elif dist == "channel_offsets":  # keys: per-channel magnitude and offset
        x = rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 7, d) + rng.normal(0, 20, d)
    elif dist == "int4_ties":  # groups spanning [mn, mn + 15 sc] with (x - mn) / sc = k + 0.5
        k = rng.choice(np.r_[0, 15, np.arange(15) + 0.5], size=shape, p=[0.2, 0.2] + [0.04] * 15)
        x = rng.choice([0.0, -3.0, 1.5, -40.0]) + k * 2.0 ** rng.integers(-3, 3)
    elif dist == "e2m1":  # E2M1 grid and midpoints; 21 * 2**k fixes g = 2**(7 - k)
        scale = 2.0 ** rng.integers(-4, 4)
        x = rng.choice(np.r_[E2M1_GRID, E2M1_MIDPOINTS], shape) * scale
        x *= rng.choice([-1.0, 1.0], shape)
        if x.size:
            x.flat[rng.integers(x.size)] = 21.0 * scale
    elif dist == "e4m3":  # E4M3 values and midpoints; every row holds +-448 * 2**k
        scale = 2.0 ** rng.integers(-6, 6)
        x = rng.choice(np.r_[E4M3_VALUES, E4M3_MIDPOINTS], shape) * scale
        x *= rng.choice([-1.0, 1.0], shape)
        if x.size:
            where = rng.integers(d, size=(t, h, 1))
            np.put_along_axis(x, where, 448.0 * scale * rng.choice([-1.0, 1.0], (t, h, 1)), 2)
    elif dist == "magnitudes":  # one random binade per tensor, from flushed to near max
        x = rng.standard_normal(shape) * 2.0 ** float(rng.integers(-150, 126))
    else:
        raise ValueError(dist)
    x = np.clip(x, -_dtype_max(dtype), _dtype_max(dtype))
    if zeros:
        x = np.where(rng.random(shape) < zeros, rng.choice([0.0, -0.0], shape), x)
    return _cast(x, dtype)


def _mixed(rng, shape, dtype) -> np.ndarray:
    """One tensor whose token blocks come from different distributions."""
    parts = np.array_split(np.arange(shape[0]), len(DISTS) - 1)
    x = np.zeros(shape, dtype)
    for idx, dist in zip(parts, [d for d in DISTS if d != "magnitudes"], strict=True):
        x[idx] = _random_values(rng, (len(idx), *shape[1:]), dtype, dist)
    return x


# ------------------------------------------------------------------------------------------
# random grid: every format x layout x input dtype x output dtype, partial groups, odd D

#: (format, kind, axis override, input dtypes): the default layouts in every input dtype (the
#: hand-built tests below reuse their compiles), the overridden axes in one dtype each.
LAYOUTS = [
    *((fmt, kind, None, DTYPES) for fmt in FORMATS for kind in KINDS),
    ("int4", "key", "channels", (BF16,)),
    ("int4", "value", "tokens", (F32,)),
    ("nvfp4", "key", "channels", (F16,)),
    ("nvfp4", "value", "tokens", (BF16,)),
]
GRID = [
    pytest.param(fmt, kind, axis, dt, id=f"{fmt}-{kind}-{axis or 'default'}-{dt}")
    for fmt, kind, axis, dtypes in LAYOUTS
    for dt in dtypes
]


@pytest.mark.parametrize(("fmt", "kind", "axis", "dtype"), GRID)
def test_random_grid(fmt, kind, axis, dtype):
    rng = np.random.default_rng(_seed("grid", fmt, kind, axis, str(dtype)))
    g = G4 if fmt == "int4" else None
    check(_mixed(rng, SHAPE, dtype), fmt, kind, group_size=g, axis=axis)
    for dist in DISTS:
        x = _random_values(rng, SHAPE, dtype, dist)
        check(x, fmt, kind, group_size=g, axis=axis, out_dtypes=(dtype,), what=dist)


# ------------------------------------------------------------------------------------------
# INT4 hand-built groups (G = 16, both default layouts)

#: (minimum, scale) with span = 15 * scale exact: ties at minimum + (k + 0.5) * scale.
INT4_TIE_GRIDS = [
    (0.0, 1.0),
    (-3.0, 1.0),
    (0.5, 0.25),
    (-8.0, 0.5),
    (-1.5, 0.75),
    (100.0, 2.0),
    (1024.0, 64.0),
    (0.0, 3.0),
    (-7.0, 0.375),
    (-0.5, 0.125),
    (-40.0, 6.0),
    (-32768.0, 4096.0),
]
#: Extra grids outside the float16 range.
INT4_TIE_GRIDS_WIDE = [
    (2.0**-100, 2.0**-104),
    (-(2.0**100), 2.0**100),
    (3.0 * 2.0**-120, 2.0**-121),
]


def _int4_exact_ties(dtype, axis):
    """Groups [mn, mx, ties...] where (x - mn) / scale is exactly k + 0.5 (k = 0..14, even
    and odd), plus the same groups with every tie moved to the nearest value of `dtype` on
    either side whose q is no longer a tie."""
    grids = INT4_TIE_GRIDS + (INT4_TIE_GRIDS_WIDE if dtype != F16 else [])
    groups = []
    for mn, sc in grids:
        for ks in (np.arange(0, 14), np.arange(14, 15)):
            group = _exact([mn, mn + 15 * sc, *(mn + (ks + 0.5) * sc)], dtype)
            q, scale = _int4_q(group)
            assert scale == sc and np.array_equal(q[2:], ks + 0.5), (mn, sc, q)
            groups.append(group)
            for toward in (-INF, INF):
                # the nearest inputs in `dtype` whose q is off the tie (one step can round
                # back onto it when x - mn has a larger exponent than x)
                moved = group.copy()
                for _ in range(64):
                    on_tie = np.flatnonzero(_int4_q(moved)[0][2:] == ks + 0.5) + 2
                    moved[on_tie] = _next(moved[on_tie], dtype, toward)
                assert np.all(_int4_q(moved)[0][2:] != ks + 0.5)
                groups.append(moved)
    return _place(groups, axis, dtype, G4)


def _int4_rounded_ties(dtype, axis):
    """float32 groups whose scale is inexact (span / 15) and whose (x - mn) / scale is not
    k + 0.5 in exact arithmetic but rounds to it in float32; plus both float32 neighbours,
    and inputs on which multiplying by the reciprocal of the scale (XLA's rewrite of a
    division) gives a different code than the IEEE division."""
    groups, ties, inexact, recip_codes = [], 0, 0, 0
    for mn, mx in [
        (0.0, 1.0),
        (-1.0, 2.0),
        (0.1, 0.7),
        (-3.3, 17.9),
        (1e-3, 2e-3),
        (-100.0, 1e4),
        (0.0, 7.0),
        (0.0, 11.0),
        (-2.0, 0.6),
    ]:
        mn, mx = np.float32(mn), np.float32(mx)
        scale = (mx - mn) / np.float32(15.0)
        xs = []
        for k in range(15):
            tie = np.float32(k + 0.5)
            x0 = np.float32(float(mn) + (k + 0.5) * float(scale))
            cand = (x0.view(np.int32) + np.arange(-64, 65, dtype=np.int32)).view(np.float32)
            cand = cand[(cand > mn) & (cand < mx)]
            q = (cand - mn) / scale
            recip_differs = np.round(q) != np.round((cand - mn) * (np.float32(1.0) / scale))
            hits = cand[q == tie]
            if not hits.size:
                continue
            x = hits[len(hits) // 2]
            ties += 1
            inexact += Fraction(float(x - mn)) / Fraction(float(scale)) != k + Fraction(1, 2)
            recip_codes += int(recip_differs.sum())
            xs += [x, _next(x, F32, -INF), _next(x, F32, INF), *cand[recip_differs]]
        for i in range(0, len(xs), G4 - 2):
            groups.append(np.array([mn, mx, *xs[i : i + G4 - 2]], np.float32))
    assert ties >= 80 and inexact >= 30 and recip_codes >= 5, (ties, inexact, recip_codes)
    return _place(groups, axis, dtype, G4)


def _int4_zeros(dtype, axis):
    """Zero-span groups, signed zeros, constants (a zero minimum is stored as +0.0)."""
    z = -0.0
    big = 65504.0 if dtype != BF16 else 65280.0  # float16 max / a bfloat16 value near it
    groups = [
        [0.0],
        [z],
        [0.0, z],
        [z, 0.0, z, z],
        [3.0],
        [-2.5],
        [big],
        [-big],
        [z, 1.0, 2.0, 3.5],
        [0.0, z, 5.0],
        [z, -1.0, 3.0],
        [2.0, z, 2.0],
        [z, z, z, 0.5],
        [1.5, 1.5, z],
        [-0.5, z, -0.25],
        [z] * 15 + [7.0],
    ]
    return _place([_exact(g, dtype) for g in groups], axis, dtype, G4)


def _tiny_values(dtype) -> dict[str, np.ndarray]:
    """Named tiny values of `dtype`: around 2**-126, subnormals of the dtype, 1e-30, 1e-36."""
    if dtype == F16:
        sub = np.array([1, 2, 0x3FF, 0x8001, 0x200], np.uint16).view(F16)
        return {
            "min_normal": _exact([2.0**-14, -(2.0**-14)], F16),
            "below": _next([2.0**-14], F16, 0.0),
            "subnormal": sub,
            "small": _cast([6e-8, 1e-7, -3e-6, 1e-5], F16),
        }
    bits = np.uint32 if dtype == F32 else np.uint16
    top = 0x7FFFFF if dtype == F32 else 0x7F
    sign = 0x80000000 if dtype == F32 else 0x8000
    sub = np.array([1, top, top // 2, sign | 1, sign | top], bits).view(dtype)
    t = _exact([2.0**-126], dtype)
    return {
        "min_normal": _exact([2.0**-126, -(2.0**-126), 2.0**-125], dtype),
        "below": _next(t, dtype, 0.0),
        "above": _next(t, dtype, INF),
        "subnormal": sub,
        "small": _cast([1e-30, -2e-30, 3e-30, 1e-36, -1e-36, 1.5e-36], dtype),
    }


def _int4_tiny(dtype, axis):
    """Tiny groups: flushed subnormal inputs, spans whose span / 15 flushes (q = inf or NaN),
    a tie at scale 2**-126, tiny values next to normal ones."""
    tv = _tiny_values(dtype)
    groups = [*tv.values(), np.concatenate(list(tv.values()))]
    groups += [np.concatenate([v, _cast([1.0, -2.0], dtype)]) for v in tv.values()]
    if dtype != F16:
        t = 2.0**-126
        groups += [
            _exact([t, 2 * t], dtype),  # span / 15 flushes: q = inf -> 15, 0 / 0 -> 0
            _exact([-t, t], dtype),
            _exact([0.0, 15 * t, 7.5 * t, 8.5 * t], dtype),  # scale 2**-126, ties
            _cast([1e-36, 15e-36, 7e-36], dtype),
            _cast([1e-30, 1e-36, -1e-38, 0.0], dtype),
        ]
    else:
        groups += [_exact([0.0, 15 * 2.0**-24, 7.5 * 2.0**-24 * 2, 2.0**-24], F16)]
    return _place(groups, axis, dtype, G4)


def _int4_huge(dtype, axis):
    """float16 metadata near and past its range (65504), spans past float32 max."""
    if dtype == F16:
        groups = [
            [-65504.0, 65504.0],
            [65504.0],
            [-65504.0, 0.0],
            [60000.0, -60000.0, 1.0],
            [65504.0, 65472.0],
            [-65504.0, -65472.0, 0.5],
            [0.0, 65504.0, 1.0],
        ]
        return _place([_exact(g, F16) for g in groups], axis, dtype, G4)
    big = _dtype_max(dtype)
    groups = [
        [0.0, 1e6],
        [-1e5, 0.0],
        [-65504.0, 65504.0],
        [65504.0, 65520.0],
        [65519.0, 65520.0],
        [0.0, 65504.0 * 15],
        [0.0, 65520.0 * 15],
        [-3e38, 3e38],
        [big],
        [big, -big],
        [1e38, 2e38, -1e38],
        [-big, 0.0, 1.0],
        [1e30, -1e30, 5e29],
        [65536.0, 1.0],
    ]
    return _place([_cast(g, dtype) for g in groups], axis, dtype, G4)


def _int4_non_finite(dtype, axis):
    """Groups holding inf / -inf / NaN (stored NaN, codes 0) next to finite groups."""
    nan, inf = np.nan, np.inf
    groups = [
        [inf, 1.0, 2.0],
        [-inf, 0.0],
        [nan, 1.0],
        [inf, -inf],
        [nan, inf, -1.0],
        [1.0, 2.0, nan],
        [1.0, 2.0, 3.5],
        [inf],
        [-0.0, nan],
        [nan],
        [-inf, -inf, 3.0],
        [0.0, 15.0, 7.5],
    ]
    return _place([_cast(g, dtype) for g in groups], axis, dtype, G4)


INT4_CASES = {
    "exact_ties": (_int4_exact_ties, DTYPES),
    "rounded_ties": (_int4_rounded_ties, (F32,)),
    "zeros": (_int4_zeros, DTYPES),
    "tiny": (_int4_tiny, DTYPES),
    "huge": (_int4_huge, DTYPES),
    "non_finite": (_int4_non_finite, DTYPES),
}


def _edge_params(cases):
    return [
        pytest.param(name, dt, kind, id=f"{name}-{dt}-{kind}")
        for name, (_, dtypes) in cases.items()
        for dt in dtypes
        for kind in KINDS
    ]


@pytest.mark.parametrize(("case", "dtype", "kind"), _edge_params(INT4_CASES))
def test_int4_edge_cases(case, dtype, kind):
    build, _ = INT4_CASES[case]
    for i, x in enumerate(build(dtype, AXIS_OF[kind])):
        check(x, "int4", kind, group_size=G4, what=f"int4 {case} {dtype} {kind} #{i}")


# ------------------------------------------------------------------------------------------
# NVFP4 hand-built tensors (both default layouts)


def _nv_block(top, values, amax, dtype, *, expect_y=None, above=None, below=None):
    """Check the y of `values` in the NVFP4 block [top, *values] against the construction;
    return the block."""
    block = np.r_[np.asarray(top, dtype), np.asarray(values, dtype)]
    y = np.abs(_nv_y(block, amax))[1:]
    if expect_y is not None:
        np.testing.assert_array_equal(y, np.abs(np.asarray(expect_y, np.float32)))
    if above is not None:  # strictly above the midpoints, below the next E2M1 value
        assert np.all(y > above) and np.all(y < above * 1.04), (y, above)
    if below is not None:
        assert np.all(y < below) and np.all(y > below * 0.96), (y, below)
    return block


def _nvfp4_e2m1_midpoints(dtype, axis):
    """amax = 21 gives g = 2688 / 21 = 128; a block with max 6 * 2**(j - 7) gets the block
    scale sf = 2**j (every power-of-two E4M3 value, subnormal ones included) and
    r = 1 / (sf / 128) exact, so y = x * r lands exactly on each E2M1 midpoint (and on the
    neighbours in `dtype` of each midpoint)."""
    amax = 21.0
    assert _nv_steps(amax, amax)["g"] == 128
    mids = np.array(E2M1_MIDPOINTS)
    groups = []
    for j in range(-9, 9):
        v = 2.0 ** (j - 7)
        assert _nv_steps(amax, 6 * v)["sf"] == 2.0**j
        for sign in (1.0, -1.0):
            top = _exact([sign * 6 * v], dtype)
            tie = _exact(sign * mids * v, dtype)
            groups.append(_nv_block(top, tie, amax, dtype, expect_y=mids))
            for toward, key in ((INF, "above"), (0.0, "below")):
                moved = _next(tie, dtype, sign * toward)
                groups.append(_nv_block(top, moved, amax, dtype, **{key: mids}))
    return _place(groups, axis, dtype, G_NV, anchor=[_exact([amax], dtype)])


def _nvfp4_fallback_midpoints(dtype, axis):
    """Tiny-scale fallback: amax = 21 * 2**-120 gives g = 2**127, whose reciprocal 2**-127
    flushes, so v = 0 in every block and y = (x * g) / sf; blocks with sf = 2**j again put
    y exactly on the E2M1 midpoints."""
    amax = 21.0 * 2.0**-120
    steps = _nv_steps(amax, amax)
    assert steps["g"] == 2.0**127 and steps["v"] == 0 and steps["sf"] > 0
    mids = np.array(E2M1_MIDPOINTS)
    groups = []
    for j in (4, 6, 8):
        v = 2.0 ** (j - 127)
        assert _nv_steps(amax, 6 * v)["sf"] == 2.0**j and _nv_steps(amax, 6 * v)["v"] == 0
        for sign in (1.0, -1.0):
            top = _exact([sign * 6 * v], dtype)
            tie = _exact(sign * mids * v, dtype)
            groups.append(_nv_block(top, tie, amax, dtype, expect_y=mids))
            for toward, key in ((INF, "above"), (0.0, "below")):
                moved = _next(tie, dtype, sign * toward)
                groups.append(_nv_block(top, moved, amax, dtype, **{key: mids}))
    return _place(groups, axis, dtype, G_NV, anchor=[_exact([amax], dtype)])


def _nvfp4_e4m3_scale_midpoints(dtype, axis):
    """Block scales s on every E4M3 midpoint m (ties to the even pattern, the subnormal
    midpoint 2**-10 rounds to a zero scale) and on the neighbours of m: with g = 128 and
    vmax = 6 * m / 128, vmax * f32(1/6) = m / 128 * (1 + 2**-25) rounds to m / 128 exactly."""
    amax = 21.0
    groups = []
    for i, m in enumerate(E4M3_MIDPOINTS):
        lo, hi = E4M3_VALUES[i], E4M3_VALUES[i + 1]
        vmax = _exact([6 * m / 128], dtype)
        assert _nv_steps(amax, vmax[0])["s"] == m
        tops = [vmax]
        for toward, cond in (
            (INF, lambda s, m=m, hi=hi: m < s < hi),
            (0.0, lambda s, m=m, lo=lo: lo < s < m),
        ):
            # the nearest vmax in `dtype` whose s is off the midpoint
            top = vmax
            while _nv_steps(amax, top[0])["s"] == m:
                top = _next(top, dtype, toward)
            assert cond(float(_nv_steps(amax, top[0])["s"])), (m, top)
            tops.append(top)
        for top in tops:
            rest = _cast(
                top[0].astype(np.float64) * np.array([-0.75, 0.5, -0.3, 0.1, 1 / 3]), dtype
            )
            groups.append(np.r_[top, rest])
    return _place(groups, axis, dtype, G_NV, anchor=[_exact([amax], dtype)])


def _nvfp4_scale_clamp(dtype, axis):
    """Tensors whose largest block has s = g * (amax * f32(1/6)) slightly above 448 (two
    roundings): min(s, 448) and the E4M3 rounding both give 448. (s >= 464, where only the
    clamp would keep the E4M3 cast finite, is unreachable: s <= 448 * (1 + 2**-22).)"""
    cand = _cast(np.geomspace(1.0, 1e4, 4000), dtype)
    over = [
        a
        for a in np.unique(cand)
        if _nv_steps(a, a)["s"] == 448
        and np.float32(2688.0) / _widen(a) * (_widen(a) * ONE_SIXTH) > 448
    ]
    assert over, dtype
    tensors = []
    for a in over[:2]:
        groups = [
            np.r_[np.asarray([a], dtype), _cast([a * 0.9, -a * 0.51, a * 0.25], dtype)],
            _cast([-a, 0.3 * a], dtype),
        ]
        tensors += _place(groups, axis, dtype, G_NV)
    return tensors


def _nvfp4_zeros(dtype, axis):
    """All-zero tensors (all +0, all -0, mixed), and signed zeros inside a non-zero tensor:
    -0.0 and negatives that round to 0 keep code 0x8, zero blocks get block scale 0."""
    rng = np.random.default_rng(_seed("nvfp4 zeros", str(dtype), axis))
    mixed = np.where(rng.random(SHAPE) < 0.5, -0.0, 0.0).astype(dtype)
    z = -0.0
    groups = [
        [1.0, z, 0.0, -1e-3, 1e-3, -0.2],
        [z],
        [0.0, z],
        [6.0, -0.24, 0.24, z, -0.25],
        [z, -1.0, -0.0001],
        [0.0],
    ]
    nonzero = _place([_cast(g, dtype) for g in groups], axis, dtype, G_NV)
    return [np.zeros(SHAPE, dtype), np.full(SHAPE, -0.0, dtype), mixed, *nonzero]


def _nvfp4_tiny(dtype, axis):
    """Tiny tensors: the tiny-tensor rule (2688 / amax overflows: g = f32 max) at and around
    its threshold, the tiny-scale fallback (1 / g flushes), blocks whose vmax * f32(1/6)
    flushes (s = 0), a block whose decode step sf / g flushes, flushed subnormal inputs."""
    rng = np.random.default_rng(_seed("nvfp4 tiny", str(dtype), axis))
    tensors = []
    tv = np.concatenate(list(_tiny_values(dtype).values()))
    if dtype == F16:  # float16 cannot go below 2**-24: subnormal tensors, huge g
        for amax in (2.0**-24, 2.0**-14, 1e-5):
            x = _cast(rng.uniform(-amax, amax, SHAPE), F16)
            x.flat[rng.integers(x.size, size=tv.size)] = tv
            tensors.append(x)
        return tensors
    # threshold of the tiny-tensor rule: the smallest amax with a finite 2688 / amax
    a0 = _cast([2688.0 / F32_MAX], dtype)
    with np.errstate(over="ignore"):
        while np.isinf(np.float32(2688.0) / _widen(a0)[0]):
            a0 = _next(a0, dtype, INF)
        below = _next(a0, dtype, 0.0)
        assert np.isfinite(np.float32(2688.0) / _widen(a0)[0])
        assert np.isinf(np.float32(2688.0) / _widen(below)[0])
    for amax in (1e-36, float(a0[0]), float(below[0]), 1e-35, 1e-30):
        steps = _nv_steps(amax, amax)
        if amax <= float(below[0]):
            assert steps["g"] == np.float32(F32_MAX)
        if amax in (1e-36, 1e-35):
            assert steps["v"] == 0 and steps["sf"] > 0  # tiny-scale fallback
        x = _cast(rng.uniform(-amax, amax, SHAPE) * rng.choice([1.0, 1e-2, 1e-4], SHAPE), dtype)
        x.flat[rng.integers(x.size)] = amax
        x.flat[rng.integers(x.size, size=tv.size)] = tv
        tensors.append(x)
    # a block whose vmax * f32(1/6) flushes (s = 0) in a tensor with amax 1e-30
    assert _nv_steps(1e-30, 5e-38)["s"] == 0
    groups = [
        _cast([1e-30, -3e-31], dtype),
        _cast([5e-38, -4e-38, 1e-38], dtype),
        _cast([7.1e-38, -2e-38], dtype),
    ]
    tensors += _place(groups, axis, dtype, G_NV)
    # sf / g flushes: g = 3.01 * 2**126 (so 1/g flushes) and a block with s in
    # [g * 2**-126, 3.125) that rounds down to sf = 3 < g * 2**-126
    amax = _cast([2688.0 / (3.01 * 2.0**126)], dtype)[0]
    vmax = _cast([6.05 * 2.0**-126], dtype)[0]
    steps = _nv_steps(amax, vmax)
    assert steps["sf"] == 3 and _ftz(steps["sf"] / steps["g"]) == 0, steps
    groups = [np.asarray([amax], dtype), _cast([vmax, -vmax * 0.5, vmax * 0.2], dtype)]
    tensors += _place(groups, axis, dtype, G_NV)
    return tensors


def _nvfp4_huge(dtype, axis):
    """Huge tensors: amax = the dtype's max, values above 65504 (float16 output overflows)."""
    rng = np.random.default_rng(_seed("nvfp4 huge", str(dtype), axis))
    big = _dtype_max(dtype)
    tensors = []
    for amax in [big, 3e38, 1e5, 65504.0] if dtype != F16 else [big, 60000.0]:
        x = _cast(rng.uniform(-amax, amax, SHAPE), dtype)
        x.flat[rng.integers(x.size, size=3)] = _cast([amax, -amax, -0.0], dtype)
        tensors.append(x)
    return tensors


def _nvfp4_non_finite(dtype, axis):
    """Any inf / NaN makes the whole tensor NaN: global scale NaN, block scales 0x7F."""
    rng = np.random.default_rng(_seed("nvfp4 nan", str(dtype), axis))
    tensors = []
    for bad in ([np.inf], [-np.inf], [np.nan], [np.nan, np.inf, -np.inf]):
        x = _random_values(rng, SHAPE, dtype, "normal")
        x.flat[rng.integers(x.size, size=len(bad))] = _cast(bad, dtype)
        tensors.append(x)
    return tensors


NVFP4_CASES = {
    "e2m1_midpoints": (_nvfp4_e2m1_midpoints, DTYPES),
    "fallback_midpoints": (_nvfp4_fallback_midpoints, (BF16, F32)),
    "e4m3_scale_midpoints": (_nvfp4_e4m3_scale_midpoints, DTYPES),
    "scale_clamp": (_nvfp4_scale_clamp, DTYPES),
    "zeros": (_nvfp4_zeros, DTYPES),
    "tiny": (_nvfp4_tiny, DTYPES),
    "huge": (_nvfp4_huge, DTYPES),
    "non_finite": (_nvfp4_non_finite, DTYPES),
}


@pytest.mark.parametrize(("case", "dtype", "kind"), _edge_params(NVFP4_CASES))
def test_nvfp4_edge_cases(case, dtype, kind):
    build, _ = NVFP4_CASES[case]
    for i, x in enumerate(build(dtype, AXIS_OF[kind])):
        check(x, "nvfp4", kind, what=f"nvfp4 {case} {dtype} {kind} #{i}")


# ------------------------------------------------------------------------------------------
# FP8 E4M3 hand-built rows (D = 37)


def _fp8_midpoints(dtype, axis):
    """Rows with amax = 448 * s for s in {1, 2**-4, 2**5, 3, 2**-20}: x / s lands exactly on
    every E4M3 midpoint (subnormal ones included), and on the neighbours in `dtype`."""
    rows = []
    covered = 0
    for s in (1.0, 2.0**-4, 2.0**5, 3.0, 2.0**-20):
        anchor = np.asarray(_cast([448.0 * s], dtype))
        if anchor[0] != 448.0 * s or 448.0 * s > _dtype_max(dtype):
            continue
        tie = np.asarray(E4M3_MIDPOINTS * s, np.float64)
        exact = _cast(tie, dtype).astype(np.float64) == tie
        tie = _cast(tie[exact], dtype)
        q = _widen(tie) / (_widen(anchor)[0] / np.float32(448.0))
        np.testing.assert_array_equal(q, E4M3_MIDPOINTS[exact])
        covered += exact.sum()
        values = np.concatenate([tie, _next(tie, dtype, INF), _next(tie, dtype, 0.0)])
        values = values * np.resize(np.array([1, -1], dtype), values.size)
        for i in range(0, values.size, SHAPE[2] - 1):
            sign = anchor * (-1 if (i // (SHAPE[2] - 1)) % 2 else 1)
            rows.append(np.r_[sign, values[i : i + SHAPE[2] - 1]].astype(dtype))
    assert covered >= (3 if dtype == F16 else 5) * len(E4M3_MIDPOINTS) - 40, covered
    return _rows(rows, dtype)


def _fp8_zeros(dtype, axis):
    """All-zero rows (+0 / -0: scale 0, codes +0) and -0.0 in non-zero rows (code 0x80)."""
    z = -0.0
    rows = [[0.0], [z], [0.0, z], [1.0, z, 0.0], [448.0, z, -1e-3], [z, -1.0], [-2.0, 0.0]]
    return [np.zeros(SHAPE, dtype), *_rows([_cast(r, dtype) for r in rows], dtype)]


def _fp8_tiny(dtype, axis):
    """Row scales that flush (amax < 448 * 2**-126: codes +0), that are exactly 2**-126,
    x / s that flushes to a signed zero, flushed subnormal inputs."""
    tv = _tiny_values(dtype)
    rows = [*tv.values(), np.concatenate(list(tv.values()))]
    rows += [np.concatenate([v, _cast([1.0, -2.0], dtype)]) for v in tv.values()]
    if dtype != F16:
        edge = _exact([448.0 * 2.0**-126], dtype)
        rows += [
            _cast([1e-36, -1e-37, 0.0], dtype),
            edge,
            _next(edge, dtype, 0.0),
            np.r_[edge, _exact([-(2.0**-126)], dtype)],
            _cast([3e38, -1e-3, 1e-3, -1e-30], dtype),  # x / s flushes to -0 / +0
            _cast([1.0, 2.0**-126, -(2.0**-126)], dtype),
        ]
        assert _ftz(np.float32(1e-36) / np.float32(448.0)) == 0
    return _rows(rows, dtype)


def _fp8_huge(dtype, axis):
    big = _dtype_max(dtype)
    rows = [[big, -big, 1.0], [big, 0.5], [65504.0, -65504.0, 1.0], [60000.0, -3.0]]
    if dtype != F16:
        rows += [[3e38, -1e38, 1e30], [1e5, -65504.0, 65520.0], [65536.0, -1e-20]]
    return _rows([_cast(r, dtype) for r in rows], dtype)


def _fp8_non_finite(dtype, axis):
    nan, inf = np.nan, np.inf
    rows = [[inf, 1.0], [-inf], [nan, 1.0], [inf, -inf, nan], [-0.0, nan], [1.0, 448.0, -3.5]]
    return _rows([_cast(r, dtype) for r in rows], dtype)


FP8_CASES = {
    "e4m3_midpoints": (_fp8_midpoints, DTYPES),
    "zeros": (_fp8_zeros, DTYPES),
    "tiny": (_fp8_tiny, DTYPES),
    "huge": (_fp8_huge, DTYPES),
    "non_finite": (_fp8_non_finite, DTYPES),
}


@pytest.mark.parametrize(("case", "dtype", "kind"), _edge_params(FP8_CASES))
def test_fp8_edge_cases(case, dtype, kind):
    build, _ = FP8_CASES[case]
    for i, x in enumerate(build(dtype, AXIS_OF[kind])):
        check(x, "fp8_e4m3", kind, what=f"fp8 {case} {dtype} {kind} #{i}")


# ------------------------------------------------------------------------------------------
# group sizes, partial groups and small / empty shapes


@pytest.mark.parametrize("axis", ["tokens", "channels"])
@pytest.mark.parametrize("group_size", [1, 3, 7, 16, 32, 64, 128])
def test_int4_group_sizes(group_size, axis):
    """T = 40 and D = 37 are not multiples of G (G > 1): partial groups on both axes."""
    dtype = DTYPES[(group_size + len(axis)) % 3]
    kind = "key" if axis == "tokens" else "value"
    rng = np.random.default_rng(_seed("G", group_size, axis))
    for dist in ("int4_ties", "channel_offsets"):
        x = _random_values(rng, SHAPE, dtype, dist)
        check(x, "int4", kind, group_size=group_size, out_dtypes=(dtype,))


SMALL_SHAPES = [(1, 1, 1), (1, 3, 37), (17, 2, 1), (0, 2, 8)]


@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_small_and_empty_shapes(fmt, shape):
    """T = 1, D = 1 (one nibble per byte), odd D, T = 0 (empty arrays, NVFP4 g = 1)."""
    i = SMALL_SHAPES.index(shape)
    kind = KINDS[(i + FORMATS.index(fmt)) % 2]
    dtype = DTYPES[(i + FORMATS.index(fmt)) % 3]
    rng = np.random.default_rng(_seed("small", fmt, shape))
    x = _random_values(rng, shape, dtype, "heavy", zeros=0.2)
    if x.size:
        x.flat[0] = -0.0
    check(x, fmt, kind, group_size=3 if fmt == "int4" else None)


# ------------------------------------------------------------------------------------------
# non-contiguous inputs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_inputs(fmt, dtype):
    """numpy strided / transposed / reversed / Fortran-order views and jnp transposes."""
    t, h, d = SHAPE
    g = G4 if fmt == "int4" else None
    rng = np.random.default_rng(_seed("strided", fmt, str(dtype)))
    base = _random_values(rng, (2 * t, d, h), dtype, "channel_offsets")
    views = {
        "strided-transposed": base[::2].transpose(0, 2, 1),
        "reversed": np.ascontiguousarray(base[:t].transpose(0, 2, 1))[::-1, :, ::-1],
        "fortran": np.asfortranarray(base[1::2].transpose(0, 2, 1)),
    }
    for name, view in views.items():
        assert view.shape == SHAPE and not view.flags.c_contiguous
        check(view, fmt, "value", group_size=g, out_dtypes=(dtype,), what=name)
    x_jax = jnp.transpose(jnp.asarray(base[::2]), (0, 2, 1))
    check(
        views["strided-transposed"],
        fmt,
        "key",
        group_size=g,
        out_dtypes=(dtype,),
        x_jax=x_jax,
        what="jnp.transpose",
    )


# ------------------------------------------------------------------------------------------
# jit vs eager vs vmap on edge cases


def _edge_inputs(fmt):
    """Two hand-built float32 tensors per format (ties, tiny values, non-finite values)."""
    if fmt == "int4":
        x = _int4_non_finite(F32, "channels")[0]
        x[SHAPE[0] // 2 :] = _int4_tiny(F32, "channels")[0][: SHAPE[0] // 2]
        return [_int4_rounded_ties(F32, "channels")[0], x]
    if fmt == "nvfp4":
        return [_nvfp4_e2m1_midpoints(F32, "channels")[0], _nvfp4_tiny(F32, "channels")[3]]
    x = _fp8_non_finite(F32, "channels")[0]
    x[SHAPE[0] // 2 :] = _fp8_tiny(F32, "channels")[0][: SHAPE[0] // 2]
    return [_fp8_midpoints(F32, "channels")[0], x]


@pytest.mark.parametrize("fmt", FORMATS)
def test_jit_eager_vmap_identical(fmt):
    g = G4 if fmt == "int4" else None
    xs = [x.astype(F32) for x in _edge_inputs(fmt)]
    expected = [check(x, fmt, "value", group_size=g, out_dtypes=(F32,)) for x in xs]
    with jax.disable_jit():
        for x, want in zip(xs, expected, strict=True):
            p = _pack(x, fmt, "value", group_size=g)
            assert not isinstance(p.codes, jax.core.Tracer)
            assert_packed_equal(p, want.arrays, f"{fmt} eager")
            assert_same_values(unpack_kv(p, dtype=F32), oracle.unpack(want, F32), "eager")
    batched = jax.vmap(functools.partial(_pack, fmt=fmt, kind="value", group_size=g))(np.stack(xs))
    decoded = np.asarray(jax.vmap(functools.partial(unpack_kv, dtype=F32))(batched))
    for i, want in enumerate(expected):
        for name, array in want.arrays.items():
            assert_same_bytes(np.asarray(batched.arrays[name])[i], array, f"{fmt} vmap {name}")
        assert_same_values(decoded[i], oracle.unpack(want, F32), f"{fmt} vmap decoded")


# ------------------------------------------------------------------------------------------
# property-based: random shapes, values, dtypes, layouts and group sizes

HYP_SHAPES = [(1, 1, 1), (7, 3, 16), (17, 2, 1), (33, 1, 40), (0, 2, 8), SHAPE]
SPECIALS = [
    0.0,
    -0.0,
    1e-30,
    -1e-36,
    2.0**-126,
    float(np.nextafter(F32_TINY, 0)),
    65504.0,
    1e5,
    -3e38,
    np.inf,
    -np.inf,
    np.nan,
    0.25,
    -0.75,
    5.0,
    448.0,
    21.0,
    1.5,
]


@st.composite
def _hyp_cases(draw):
    fmt = draw(st.sampled_from(FORMATS))
    shape = draw(st.sampled_from(HYP_SHAPES))
    kind = draw(st.sampled_from(KINDS))
    axis = None if fmt == "fp8_e4m3" else draw(st.sampled_from([None, "tokens", "channels"]))
    group_size = draw(st.sampled_from([1, 3, 16, 64])) if fmt == "int4" else None
    dtype = draw(st.sampled_from(DTYPES))
    out_dtype = draw(st.sampled_from(DTYPES))
    dist = draw(st.sampled_from(DISTS))
    seed = draw(st.integers(0, 2**32 - 1))
    specials = draw(
        st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=5)
    )
    x = _random_values(np.random.default_rng(seed), shape, dtype, dist)
    for position, value in specials:
        if x.size:
            x.flat[position % x.size] = _cast([value], dtype)[0]
    return fmt, kind, axis, group_size, x, out_dtype


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(_hyp_cases())
def test_property_random(case):
    fmt, kind, axis, group_size, x, out_dtype = case
    check(x, fmt, kind, group_size=group_size, axis=axis, out_dtypes=(out_dtype,))


# ------------------------------------------------------------------------------------------
# thousands of random tensors per format, one vmap compile each

VMAP_SPECS = {
    "int4": ((6, 2, 11), 4),  # partial groups on both axes, odd D
    "nvfp4": ((18, 1, 8), None),  # tokens: 16 + 2; channels: one partial block of 8
    "fp8_e4m3": ((4, 3, 12), None),
}
VMAP_PER_LAYOUT = 342  # x 2 layouts x 3 dtypes = 2052 tensors per format


@pytest.mark.parametrize("fmt", FORMATS)
def test_thousands_of_random_tensors_vmap(fmt):
    shape, g = VMAP_SPECS[fmt]
    rng = np.random.default_rng(_seed("vmap", fmt))
    configs = [(kind, dt) for kind in KINDS for dt in DTYPES]
    batches = []
    for c, (_, dt) in enumerate(configs):
        xs = np.stack(
            [
                _random_values(rng, shape, dt, DISTS[(i + c) % len(DISTS)], zeros=0.02 * (i % 4))
                for i in range(VMAP_PER_LAYOUT)
            ]
        )
        for i in range(5, VMAP_PER_LAYOUT, 37):  # a few tensors with an inf or a NaN
            xs[i].flat[rng.integers(xs[i].size)] = _cast([(np.inf, -np.inf, np.nan)[i % 3]], dt)[0]
        batches.append(xs)

    @jax.jit
    def pack_all(*batches):
        return tuple(
            jax.vmap(functools.partial(_pack, fmt=fmt, kind=kind, group_size=g))(b)
            for (kind, _), b in zip(configs, batches, strict=True)
        )

    @jax.jit
    def unpack_all(packed):
        return tuple(jax.vmap(unpack_kv)(p) for p in packed)

    packed = pack_all(*batches)
    decoded = unpack_all(packed)
    for (kind, dt), b, p, out in zip(configs, batches, packed, decoded, strict=True):
        got = {name: np.asarray(a) for name, a in p.arrays.items()}
        encs = [oracle.pack(x, format=fmt, kind=kind, group_size=g) for x in b]
        what = f"{fmt} {kind} {dt} vmap batch"
        for name, array in got.items():
            assert_same_bytes(array, np.stack([e.arrays[name] for e in encs]), f"{what} {name}")
        want = np.stack([oracle.unpack(e) for e in encs])
        assert_same_values(np.asarray(out), want, f"{what} decoded")
