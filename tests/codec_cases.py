"""Argument specs for the codec tests: every input the codecs are checked on, defined once.

The kvq_jax tests (`test_codecs_vs_oracle.py`), the Torch tests (`test_torch_codec.py`) and
the kernel tests read the same constructors, so every stack runs on the same edge cases
(tokamax style: the inputs live here, the checks live with each stack's tests). The module
is framework-neutral: numpy and ml_dtypes only, and every constructor returns numpy arrays
(or named dicts / lists of them), to be fed to the oracle and to the codec under test.

The hand-built inputs (ties, midpoints, tiny and huge values, non-finite values) assert their
own construction with numpy float32 arithmetic (FORMAT.md section 0: subnormals flushed), so
they cannot silently stop hitting the case they were written for. Expected bytes never come
from here: they come from the oracle.

Edge-case constructors have the signature `build(dtype, axis, *, shape=SHAPE)` and return a
list of [T, H, D] tensors of `dtype` whose complete groups along `axis` hold the case (the
`*_CASES` tables list them with the input dtypes they support). `shape` lets a stack pick
its own tensor size (Torch uses fewer heads); T >= 32, D >= 32 keep every case in place.
"""

from __future__ import annotations

import zlib
from fractions import Fraction

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = (BF16, F16, F32)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FORMATS = ("int4", "nvfp4", "fp8_e4m3")
KINDS = ("key", "value")
#: The default quantization axis of each kind (FORMAT.md): keys per channel over tokens.
AXIS_OF = {"key": "tokens", "value": "channels"}

#: The default shape of the hand-built tensors: T = 40 and D = 37 leave partial groups for
#: G = 16 and 64 on both axes, and D is odd.
SHAPE = (40, 3, 37)
#: int4 group size of the hand-built tensors.
G4 = 16
#: nvfp4 block size.
G_NV = 16

#: The smallest normal float32 (anything below flushes to a signed zero).
TINY = np.float32(2.0**-126)
F32_MAX = np.finfo(np.float32).max
INF = np.float32(np.inf)
#: float32 nearest to 1/6; 6 * ONE_SIXTH == 1 + 2**-25 exactly.
ONE_SIXTH = np.float32(1.0) / np.float32(6.0)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
#: All finite non-negative E4M3 values (by bit pattern 0x00..0x7E) and their 126 midpoints.
E4M3_VALUES = np.arange(127, dtype=np.uint8).view(E4M3).astype(np.float64)
E4M3_MIDPOINTS = (E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2

#: Single values worth sprinkling into random data: signed zeros, flushed and barely normal
#: values, float16 / float32 range edges, non-finite values, E2M1 / E4M3 ties and anchors.
SPECIALS = [
    0.0,
    -0.0,
    1e-30,
    -1e-36,
    2.0**-126,
    float(np.nextafter(TINY, 0)),
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


def seed(*parts) -> int:
    """A stable seed from test parameters (Python's hash() is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def dtype_max(dtype) -> float:
    """The largest finite value of `dtype`."""
    return float(ml_dtypes.finfo(dtype).max)


# ------------------------------------------------------------------------------------------
# values of a dtype


def exact(values, dtype) -> np.ndarray:
    """Values (Python / float64) -> array of `dtype`; assert that each is represented exactly
    (sign of zero and NaN included)."""
    a = np.asarray(values, np.float64)
    out = a.astype(np.float32).astype(dtype)
    back = out.astype(np.float64)
    same = (back == a) & (np.signbit(back) == np.signbit(a))
    same |= np.isnan(a) & np.isnan(back)
    assert same.all(), f"not exact in {dtype}: {a[~same]}"
    return out


def cast(values, dtype) -> np.ndarray:
    """Values -> array of `dtype`, rounded (for data that need not be exact; out-of-range
    values become +-inf on purpose)."""
    with np.errstate(over="ignore"):
        return np.asarray(values, np.float64).astype(np.float32).astype(dtype)


def next_toward(a, dtype, toward) -> np.ndarray:
    """Element-wise neighbour of `a` in `dtype` toward `toward`."""
    a = np.asarray(a, dtype)
    return np.nextafter(a, np.full(a.shape, toward, dtype))


def ftz(a) -> np.ndarray:
    """float32 with subnormals flushed to a zero of the same sign (FORMAT.md section 0)."""
    a = np.asarray(a, np.float32)
    return np.where(np.abs(a) < TINY, np.copysign(np.float32(0.0), a), a)


def widen(x) -> np.ndarray:
    """Input dtype -> float32 with subnormals flushed, as the codecs read their input."""
    return ftz(np.asarray(x).astype(np.float32))


def tiny_values(dtype) -> dict[str, np.ndarray]:
    """Named tiny values of `dtype`: around 2**-126 (float16: 2**-14), subnormals of the
    dtype, 1e-30, 1e-36."""
    if dtype == F16:
        sub = np.array([1, 2, 0x3FF, 0x8001, 0x200], np.uint16).view(F16)
        return {
            "min_normal": exact([2.0**-14, -(2.0**-14)], F16),
            "below": next_toward([2.0**-14], F16, 0.0),
            "subnormal": sub,
            "small": cast([6e-8, 1e-7, -3e-6, 1e-5], F16),
        }
    bits = np.uint32 if dtype == F32 else np.uint16
    top = 0x7FFFFF if dtype == F32 else 0x7F
    sign = 0x80000000 if dtype == F32 else 0x8000
    sub = np.array([1, top, top // 2, sign | 1, sign | top], bits).view(dtype)
    t = exact([2.0**-126], dtype)
    return {
        "min_normal": exact([2.0**-126, -(2.0**-126), 2.0**-125], dtype),
        "below": next_toward(t, dtype, 0.0),
        "above": next_toward(t, dtype, INF),
        "subnormal": sub,
        "small": cast([1e-30, -2e-30, 3e-30, 1e-36, -1e-36, 1.5e-36], dtype),
    }


# ------------------------------------------------------------------------------------------
# laying hand-built groups out in tensors


def slots(axis: str, g: int, shape=SHAPE) -> list[tuple]:
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


def place(groups, axis, dtype, g, *, anchor=(), shape=SHAPE, fill=None) -> list[np.ndarray]:
    """Lay `groups` (each <= g values, cycled to fill its group) into the complete groups
    along `axis` of tensors of `shape` (zeros, or copies of `fill`); as many tensors as
    needed, each starting with the `anchor` groups (e.g. the element that fixes an NVFP4
    tensor's global scale)."""
    where = slots(axis, g, shape)
    per = len(where) - len(anchor)
    assert per > 0 and groups
    tensors = []
    for start in range(0, len(groups), per):
        x = np.zeros(shape, dtype) if fill is None else fill.astype(dtype, copy=True)
        for slot, group in zip(where, [*anchor, *groups[start : start + per]], strict=False):
            x[slot] = np.resize(np.asarray(group, dtype), g)
        tensors.append(x)
    return tensors


def rows(values, dtype, *, shape=SHAPE) -> list[np.ndarray]:
    """FP8: lay rows of <= D values (cycled) into the (token, head) rows of `shape`."""
    return place(values, "channels", dtype, shape[2], shape=shape)


# ------------------------------------------------------------------------------------------
# numpy float32 mirrors of single format steps, used only to assert that an input was built
# right (the expected bytes always come from the oracle)


def int4_q(group) -> tuple[np.ndarray, np.float32]:
    """(x - mn) / scale and scale of one INT4 group (float32; for normal values)."""
    x = widen(group)
    mn, mx = x.min(), x.max()
    mn = np.float32(0.0) if mn == 0 else mn
    span = mx - mn
    scale = span / np.float32(15.0) if span > 0 else np.float32(1.0)
    return (x - mn) / scale, scale


def nv_steps(amax, vmax) -> dict[str, np.float32]:
    """FORMAT.md section 3 for one block (max |x| = vmax) of a tensor with max |x| = amax:
    the global scale g, the block scale s (before the clamp: min(s, 448) is applied), its
    E4M3 rounding sf and the decode step v, in numpy float32 with flush-to-zero."""
    with np.errstate(over="ignore", divide="ignore"):
        amax, vmax = widen(np.float32(amax)), widen(np.float32(vmax))
        g = np.float32(1.0) if amax == 0 else ftz(np.float32(2688.0) / amax)
        g = np.float32(F32_MAX) if np.isinf(g) else g
        s_raw = ftz(g * ftz(vmax * ONE_SIXTH))
        s = np.minimum(s_raw, np.float32(448.0))
        sf = s.astype(E4M3).astype(np.float32)
        v = ftz(sf * ftz(np.float32(1.0) / g))
    return {"g": g, "s_raw": s_raw, "s": s, "sf": sf, "v": v}


def nv_y(x, amax) -> np.ndarray:
    """y (before clamping) for the elements of one NVFP4 block, float32 with flush."""
    x = widen(x)
    steps = nv_steps(amax, np.abs(x).max())
    g, sf, v = steps["g"], steps["sf"], steps["v"]
    if v == 0 and sf > 0:
        return ftz(ftz(x * g) / sf)
    r = ftz(np.float32(1.0) / v) if v != 0 else np.float32(0.0)
    return ftz(x * r)


def nv_block(top, values, amax, dtype, *, expect_y=None, above=None, below=None) -> np.ndarray:
    """The NVFP4 block [top, *values] of a tensor with max |x| = amax; assert that the y of
    `values` equal `expect_y`, or lie just above / below the E2M1 midpoints `above` /
    `below` (under the next E2M1 value)."""
    block = np.r_[np.asarray(top, dtype), np.asarray(values, dtype)]
    y = np.abs(nv_y(block, amax))[1:]
    if expect_y is not None:
        np.testing.assert_array_equal(y, np.abs(np.asarray(expect_y, np.float32)))
    if above is not None:
        assert np.all(y > above) and np.all(y < above * 1.04), (y, above)
    if below is not None:
        assert np.all(y < below) and np.all(y > below * 0.96), (y, below)
    return block


# ------------------------------------------------------------------------------------------
# random data: a mix of distributions shared by grid, hypothesis and batched (vmap) tests

DISTS = ("normal", "heavy", "channel_offsets", "int4_ties", "e2m1", "e4m3", "magnitudes")


def random_values(rng, shape, dtype, dist, zeros=0.05) -> np.ndarray:
    """Random [T, H, D] data of `dtype` drawn from `dist` (one of DISTS), clipped to the
    dtype's range, with a fraction `zeros` of signed zeros."""
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
    x = np.clip(x, -dtype_max(dtype), dtype_max(dtype))
    if zeros:
        x = np.where(rng.random(shape) < zeros, rng.choice([0.0, -0.0], shape), x)
    return cast(x, dtype)


def mixed_values(rng, shape, dtype) -> np.ndarray:
    """One tensor whose token blocks come from different distributions (all but
    "magnitudes")."""
    dists = [d for d in DISTS if d != "magnitudes"]
    x = np.zeros(shape, dtype)
    for idx, dist in zip(np.array_split(np.arange(shape[0]), len(dists)), dists, strict=True):
        x[idx] = random_values(rng, (len(idx), *shape[1:]), dtype, dist)
    return x


# ------------------------------------------------------------------------------------------
# INT4 hand-built groups (G = G4)

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


def int4_exact_ties(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Groups [mn, mx, ties...] where (x - mn) / scale is exactly k + 0.5 (k = 0..14, even
    and odd); the same groups with every tie moved to the nearest value of `dtype` on either
    side whose q is no longer a tie; and, where it differs, with every tie moved by exactly
    one step (which can round back onto the tie when x - mn has a larger exponent than x)."""
    grids = INT4_TIE_GRIDS + (INT4_TIE_GRIDS_WIDE if dtype != F16 else [])
    groups = []
    for mn, sc in grids:
        for ks in (np.arange(0, 14), np.arange(14, 15)):
            group = exact([mn, mn + 15 * sc, *(mn + (ks + 0.5) * sc)], dtype)
            q, scale = int4_q(group)
            assert scale == sc and np.array_equal(q[2:], ks + 0.5), (mn, sc, q)
            groups.append(group)
            for toward in (-INF, INF):
                moved = group.copy()
                for _ in range(64):
                    on_tie = np.flatnonzero(int4_q(moved)[0][2:] == ks + 0.5) + 2
                    moved[on_tie] = next_toward(moved[on_tie], dtype, toward)
                assert np.all(int4_q(moved)[0][2:] != ks + 0.5)
                groups.append(moved)
                one_step = group.copy()
                one_step[2:] = next_toward(one_step[2:], dtype, toward)
                if not np.array_equal(one_step, moved):
                    groups.append(one_step)
    return place(groups, axis, dtype, G4, shape=shape)


def int4_rounded_ties(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
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
            xs += [x, next_toward(x, F32, -INF), next_toward(x, F32, INF), *cand[recip_differs]]
        for i in range(0, len(xs), G4 - 2):
            groups.append(np.array([mn, mx, *xs[i : i + G4 - 2]], np.float32))
    assert ties >= 80 and inexact >= 30 and recip_codes >= 5, (ties, inexact, recip_codes)
    return place(groups, axis, dtype, G4, shape=shape)


def int4_division_ties(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """float32 groups [0, span, x...] with random spans whose x sit next to a tie, chosen so
    that IEEE division and multiplication by the reciprocal of the scale round to different
    codes."""
    rng = np.random.default_rng(1)
    groups = []
    while len(groups) < 60:
        span = np.float32(rng.uniform(1, 100))
        scale = span / np.float32(15)
        k = rng.integers(0, 15)
        center = np.float32((k + 0.5) * np.float64(scale))
        xs = center + np.arange(-4, 5, dtype=np.float32) * np.spacing(center)
        q_div = xs / scale
        q_mul = xs * (np.float32(1) / scale)
        differ = np.round(q_div) != np.round(q_mul)
        if differ.any():
            groups.append(np.r_[np.float32(0), span, xs[differ]].astype(np.float32))
    return place(groups, axis, dtype, G4, shape=shape)


def int4_zeros(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Zero-span groups (constants), all-zero groups with both zeros, signed zeros next to
    non-zero values (a zero minimum is stored as +0.0), and an all -0.0 tensor."""
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
        [z, 0.0],
        [0.0, z, z],
        [1.5],
        [-2.0],
        [z, 3.0],
        [0.0, -3.0],
        [z, -1.0, 0.0, 1.0],
    ]
    if dtype != F16:
        groups.append([2.0**100])
    out = place([exact(g, dtype) for g in groups], axis, dtype, G4, shape=shape)
    return [*out, exact(-np.zeros(shape), dtype)]


def int4_tiny(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Tiny groups: flushed subnormal inputs (every value flushed: zero span), spans whose
    span / 15 flushes (q = inf or NaN: codes 15 / 0), a tie at scale 2**-126, spans near the
    float32 normal bound, tiny values next to normal ones."""
    tv = tiny_values(dtype)
    groups = [*tv.values(), np.concatenate(list(tv.values()))]
    groups += [np.concatenate([v, cast([1.0, -2.0], dtype)]) for v in tv.values()]
    if dtype == F16:  # float16 subnormals are normal float32 values
        groups += [exact([0.0, 15 * 2.0**-24, 7.5 * 2.0**-24 * 2, 2.0**-24], F16)]
        tiny = [[6e-8, -6e-8, 0.0], [2.0**-24, 2.0**-14, -(2.0**-20)], [2.0**-24] * 3]
        groups += [cast(g, dtype) for g in tiny]
        return place(groups, axis, dtype, G4, shape=shape)
    t = 2.0**-126
    sub = float(np.float32(2.0**-127))
    groups += [
        exact([t, 2 * t], dtype),  # span / 15 flushes: q = inf -> 15, 0 / 0 -> 0
        exact([-t, t], dtype),
        exact([0.0, 15 * t, 7.5 * t, 8.5 * t], dtype),  # scale 2**-126, ties
        cast([1e-36, 15e-36, 7e-36], dtype),
        cast([1e-30, 1e-36, -1e-38, 0.0], dtype),
    ]
    tiny = [
        [sub, -sub, 0.0],  # every value flushed: zero span
        [t, t + 3 * 2.0**-133, -sub],
        [2.0**-120, 2.0**-120 + t],  # span / 15 flushes to 0
        [2.0**-120, 2.0**-120 + 2.0**-122, 2.0**-120 + 2.0**-123],
        [-(2.0**-125), 2.0**-125],
        [2.0**-100, 2.0**-100 + 15 * t],
        [1e-38, -1e-38, 5e-39],
    ]
    groups += [cast(g, dtype) for g in tiny]
    return place(groups, axis, dtype, G4, shape=shape)


def int4_huge(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """float16 metadata near and past its range (65504: minimum or span / 15 stored as inf),
    spans past the float32 max, the dtype's max."""
    top = dtype_max(dtype)
    extra = [[-top, top], [top, top * 0.5], [-top], [65504.0, -65504.0], [-65504.0, 0.0]]
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
        groups = [exact(g, F16) for g in groups] + [cast(g, F16) for g in extra]
        return place(groups, axis, dtype, G4, shape=shape)
    groups = [
        [0.0, 1e6],
        [-1e5, 0.0],
        [-65504.0, 65504.0],
        [65504.0, 65520.0],
        [65519.0, 65520.0],
        [0.0, 65504.0 * 15],
        [0.0, 65520.0 * 15],
        [-3e38, 3e38],
        [top],
        [top, -top],
        [1e38, 2e38, -1e38],
        [-top, 0.0, 1.0],
        [1e30, -1e30, 5e29],
        [65536.0, 1.0],
        *extra,
        [1e5, 2e6],
        [-1e6, 1e6],
        [-3e38, 3e38, 1.0],
        [7e4, 7e4],
    ]
    return place([cast(g, dtype) for g in groups], axis, dtype, G4, shape=shape)


def int4_non_finite(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Groups holding inf / -inf / NaN (stored NaN, codes 0) next to finite groups: in a
    zero tensor, and in a tensor of normal random data."""
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
    out = place([cast(g, dtype) for g in groups], axis, dtype, G4, shape=shape)
    groups = [[inf, 1.0], [-inf, 2.0], [nan, 0.0], [inf, -inf], [nan, inf]]
    fill = random_values(np.random.default_rng(seed("int4 nf", str(dtype))), shape, dtype, "normal")
    out += place([cast(g, dtype) for g in groups], axis, dtype, G4, shape=shape, fill=fill)
    return out


# ------------------------------------------------------------------------------------------
# NVFP4 hand-built tensors (block size G_NV)


def nvfp4_e2m1_midpoints(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """amax = 21 gives g = 2688 / 21 = 128; a block with max 6 * 2**(j - 7) gets the block
    scale sf = 2**j (every power-of-two E4M3 value, subnormal ones included) and
    r = 1 / (sf / 128) exact, so y = x * r lands exactly on each E2M1 midpoint (and on the
    neighbours in `dtype` of each midpoint). Then tensors with amax 21 * 2**k (k = -4, 0, 3:
    g = 2**(7 - k)) whose blocks hold the ties, their negatives, both neighbours and the
    E2M1 grid values."""
    amax = 21.0
    assert nv_steps(amax, amax)["g"] == 128
    mids = np.array(E2M1_MIDPOINTS)
    groups = []
    for j in range(-9, 9):
        v = 2.0 ** (j - 7)
        assert nv_steps(amax, 6 * v)["sf"] == 2.0**j
        for sign in (1.0, -1.0):
            top = exact([sign * 6 * v], dtype)
            tie = exact(sign * mids * v, dtype)
            groups.append(nv_block(top, tie, amax, dtype, expect_y=mids))
            for toward, key in ((INF, "above"), (0.0, "below")):
                moved = next_toward(tie, dtype, sign * toward)
                groups.append(nv_block(top, moved, amax, dtype, **{key: mids}))
    out = place(groups, axis, dtype, G_NV, anchor=[exact([amax], dtype)], shape=shape)
    for k in (-4, 0, 3):
        s = 2.0**k
        anchor = [exact([21 * s], dtype)]
        ties = exact([6 * s, *(mids * s)], dtype)
        below = np.r_[ties[:1], next_toward(ties[1:], dtype, 0)]
        above = np.r_[ties[:1], next_toward(ties[1:], dtype, np.inf)]
        grid = exact([6 * s, *(np.array(E2M1_GRID) * s), *(-np.array(E2M1_GRID) * s)], dtype)
        blocks = [ties, -ties, below, above, -below, grid]
        out += place(blocks, axis, dtype, G_NV, anchor=anchor, shape=shape)
    return out


def nvfp4_fallback_midpoints(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Tiny-scale fallback: amax = 21 * 2**-120 gives g = 2**127, whose reciprocal 2**-127
    flushes, so v = 0 in every block and y = (x * g) / sf; blocks with sf = 2**j (j = 4, 6,
    7, 8) again put y exactly on the E2M1 midpoints."""
    amax = 21.0 * 2.0**-120
    steps = nv_steps(amax, amax)
    assert steps["g"] == 2.0**127 and steps["v"] == 0 and steps["sf"] > 0
    mids = np.array(E2M1_MIDPOINTS)
    groups = []
    for j in (4, 6, 8):
        v = 2.0 ** (j - 127)
        assert nv_steps(amax, 6 * v)["sf"] == 2.0**j and nv_steps(amax, 6 * v)["v"] == 0
        for sign in (1.0, -1.0):
            top = exact([sign * 6 * v], dtype)
            tie = exact(sign * mids * v, dtype)
            groups.append(nv_block(top, tie, amax, dtype, expect_y=mids))
            for toward, key in ((INF, "above"), (0.0, "below")):
                moved = next_toward(tie, dtype, sign * toward)
                groups.append(nv_block(top, moved, amax, dtype, **{key: mids}))
    s = 2.0**-120  # blocks with max 6 * 2**-120: s = 128
    assert nv_steps(21 * s, 6 * s)["s"] == 128
    ties = exact([6 * s, *(mids * s)], dtype)
    below = np.r_[ties[:1], next_toward(ties[1:], dtype, 0)]
    groups += [ties, -ties, below, exact([3 * s, 2.5 * s, 0.25 * s], dtype)]
    return place(groups, axis, dtype, G_NV, anchor=[exact([amax], dtype)], shape=shape)


def nvfp4_e4m3_scale_midpoints(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Block scales s on every E4M3 midpoint m (ties to the even pattern, the subnormal
    midpoint 2**-10 rounds to a zero scale) and on the neighbours of m, twice: with g = 128
    and vmax = 6 * m / 128, vmax * f32(1/6) = m / 128 * (1 + 2**-25) rounds to m / 128
    exactly; and with g = 1 (amax 2688), vmax = 6 m and its neighbours in `dtype`."""
    amax = 21.0
    groups = []
    for i, m in enumerate(E4M3_MIDPOINTS):
        lo, hi = E4M3_VALUES[i], E4M3_VALUES[i + 1]
        vmax = exact([6 * m / 128], dtype)
        assert nv_steps(amax, vmax[0])["s"] == m
        tops = [vmax]
        for toward, cond in (
            (INF, lambda s, m=m, hi=hi: m < s < hi),
            (0.0, lambda s, m=m, lo=lo: lo < s < m),
        ):
            # the nearest vmax in `dtype` whose s is off the midpoint
            top = vmax
            while nv_steps(amax, top[0])["s"] == m:
                top = next_toward(top, dtype, toward)
            assert cond(float(nv_steps(amax, top[0])["s"])), (m, top)
            tops.append(top)
        for top in tops:
            rest = cast(top[0].astype(np.float64) * np.array([-0.75, 0.5, -0.3, 0.1, 1 / 3]), dtype)
            groups.append(np.r_[top, rest])
    out = place(groups, axis, dtype, G_NV, anchor=[exact([amax], dtype)], shape=shape)
    blocks = []
    for m in E4M3_MIDPOINTS:
        top = exact([6 * m], dtype)
        assert nv_steps(2688.0, top[0])["s"] == np.float32(m), m
        blocks += [
            np.r_[top, exact([-m, m / 2], dtype)],
            next_toward(top, dtype, 0),
            next_toward(top, dtype, np.inf),
        ]
    out += place(blocks, axis, dtype, G_NV, anchor=[exact([2688.0], dtype)], shape=shape)
    return out


def nvfp4_scale_clamp(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Tensors whose largest block has s = g * (amax * f32(1/6)) slightly above 448 (two
    roundings): min(s, 448) and the E4M3 rounding both give 448. (s >= 464, where only the
    clamp would keep the E4M3 cast finite, is unreachable: s <= 448 * (1 + 2**-22).) Built
    on a few amax values in zero tensors, then up to 4 random tensors with such an amax."""
    cand = cast(np.geomspace(1.0, 1e4, 4000), dtype)
    over = [
        a
        for a in np.unique(cand)
        if nv_steps(a, a)["s"] == 448
        and np.float32(2688.0) / widen(a) * (widen(a) * ONE_SIXTH) > 448
    ]
    assert over, dtype
    tensors = []
    for a in over[:2]:
        groups = [
            np.r_[np.asarray([a], dtype), cast([a * 0.9, -a * 0.51, a * 0.25], dtype)],
            cast([-a, 0.3 * a], dtype),
        ]
        tensors += place(groups, axis, dtype, G_NV, shape=shape)
    rng = np.random.default_rng(seed("clamp", str(dtype)))
    hits = 0
    for amax in cast(rng.uniform(0.5, 60000, 400), dtype):
        if nv_steps(amax, amax)["s_raw"] > 448:
            hits += 1
            if hits <= 4:
                x = random_values(rng, shape, dtype, "normal")
                x.flat[rng.integers(x.size)] = amax
                tensors.append(x)
    assert hits, "no amax with s > 448"
    return tensors


def nvfp4_zeros(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """All-zero tensors (all +0, all -0, random and strided mixes: g = 1, block scales 0,
    codes 0 / 0x8), and signed zeros inside a non-zero tensor: -0.0 and negatives that round
    to 0 keep code 0x8, zero blocks next to non-zero ones get block scale 0."""
    rng = np.random.default_rng(seed("nvfp4 zeros", str(dtype), axis))
    mixed = np.where(rng.random(shape) < 0.5, -0.0, 0.0).astype(dtype)
    strided = np.zeros(shape, dtype)
    strided.flat[::3] = cast([-0.0], dtype)[0]
    z = -0.0
    groups = [
        [1.0, z, 0.0, -1e-3, 1e-3, -0.2],
        [z],
        [0.0, z],
        [6.0, -0.24, 0.24, z, -0.25],
        [z, -1.0, -0.0001],
        [0.0],
    ]
    blocks = [[0.0], [z], [z, 0.0], [z, 1.0], [0.0, -5.0], [z, z, 2.5]]
    groups = [cast(g, dtype) for g in groups] + [exact(b, dtype) for b in blocks]
    nonzero = place(groups, axis, dtype, G_NV, shape=shape)
    return [strided, np.zeros(shape, dtype), exact(-np.zeros(shape), dtype), mixed, *nonzero]


def nvfp4_tiny(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Tiny tensors: the tiny-tensor rule (2688 / amax overflows: g = f32 max) at and around
    its threshold, the tiny-scale fallback (1 / g flushes: tensor #3 for float32 / bfloat16),
    blocks whose vmax * f32(1/6) flushes (s = 0), a block whose decode step sf / g flushes,
    flushed subnormal inputs, blocks of 2**-125 next to normal data."""
    rng = np.random.default_rng(seed("nvfp4 tiny", str(dtype), axis))
    tensors = []
    tv = np.concatenate(list(tiny_values(dtype).values()))
    if dtype == F16:  # float16 cannot go below 2**-24: subnormal tensors, huge g
        for amax in (2.0**-24, 2.0**-14, 1e-5):
            x = cast(rng.uniform(-amax, amax, shape), F16)
            x.flat[rng.integers(x.size, size=tv.size)] = tv
            tensors.append(x)
        rng = np.random.default_rng(seed("nv tiny", str(dtype)))
        x = random_values(rng, shape, dtype, "normal") * cast([2.0**-14], dtype)
        x.flat[::7] = cast([6e-8], dtype)[0]
        return [*tensors, x]
    # threshold of the tiny-tensor rule: the smallest amax with a finite 2688 / amax
    a0 = cast([2688.0 / F32_MAX], dtype)
    with np.errstate(over="ignore"):
        while np.isinf(np.float32(2688.0) / widen(a0)[0]):
            a0 = next_toward(a0, dtype, INF)
        below = next_toward(a0, dtype, 0.0)
        assert np.isfinite(np.float32(2688.0) / widen(a0)[0])
        assert np.isinf(np.float32(2688.0) / widen(below)[0])
    for amax in (1e-36, float(a0[0]), float(below[0]), 1e-35, 1e-30):
        steps = nv_steps(amax, amax)
        if amax <= float(below[0]):
            assert steps["g"] == np.float32(F32_MAX)
        if amax in (1e-36, 1e-35):
            assert steps["v"] == 0 and steps["sf"] > 0  # tiny-scale fallback
        x = cast(rng.uniform(-amax, amax, shape) * rng.choice([1.0, 1e-2, 1e-4], shape), dtype)
        x.flat[rng.integers(x.size)] = amax
        x.flat[rng.integers(x.size, size=tv.size)] = tv
        tensors.append(x)
    # a block whose vmax * f32(1/6) flushes (s = 0) in a tensor with amax 1e-30
    assert nv_steps(1e-30, 5e-38)["s"] == 0
    groups = [
        cast([1e-30, -3e-31], dtype),
        cast([5e-38, -4e-38, 1e-38], dtype),
        cast([7.1e-38, -2e-38], dtype),
    ]
    tensors += place(groups, axis, dtype, G_NV, shape=shape)
    # sf / g flushes: g = 3.01 * 2**126 (so 1/g flushes) and a block with s in
    # [g * 2**-126, 3.125) that rounds down to sf = 3 < g * 2**-126
    amax = cast([2688.0 / (3.01 * 2.0**126)], dtype)[0]
    vmax = cast([6.05 * 2.0**-126], dtype)[0]
    steps = nv_steps(amax, vmax)
    assert steps["sf"] == 3 and ftz(steps["sf"] / steps["g"]) == 0, steps
    groups = [np.asarray([amax], dtype), cast([vmax, -vmax * 0.5, vmax * 0.2], dtype)]
    tensors += place(groups, axis, dtype, G_NV, shape=shape)
    # normal-distributed tensors with amax 1e-36, 1e-35, 7.9e-36, 1e-30
    rng = np.random.default_rng(seed("nv tiny", str(dtype)))
    for amax in (1e-36, 1e-35, 7.9e-36, 1e-30):
        x = cast(rng.standard_normal(shape) * amax / 4, dtype)
        x.flat[rng.integers(x.size)] = cast([amax], dtype)[0]
        tensors.append(x)
    x = cast(rng.standard_normal(shape), dtype)  # blocks of 2**-125 next to normal data
    x[:16] = cast(rng.standard_normal((16, *shape[1:])) * 2.0**-125, dtype)
    x[20, :, :16] = cast([2.0**-127, -(2.0**-128)], dtype)[0]
    tensors.append(x)
    return tensors


def nvfp4_huge(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Huge tensors: amax = the dtype's max, values above 65504 (float16 output overflows),
    and the dtype's max next to normal data."""
    rng = np.random.default_rng(seed("nvfp4 huge", str(dtype), axis))
    big = dtype_max(dtype)
    tensors = []
    for amax in [big, 3e38, 1e5, 65504.0] if dtype != F16 else [big, 60000.0]:
        x = cast(rng.uniform(-amax, amax, shape), dtype)
        x.flat[rng.integers(x.size, size=3)] = cast([amax, -amax, -0.0], dtype)
        tensors.append(x)
    rng = np.random.default_rng(seed("nv huge", str(dtype)))
    x = cast(rng.standard_normal(shape) * big / 8, dtype)
    x.flat[5] = cast([big], dtype)[0]
    y = cast(rng.standard_normal(shape), dtype)
    y.flat[9] = cast([-big], dtype)[0]
    return [*tensors, x, y]


def nvfp4_non_finite(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Any inf / NaN makes the whole tensor NaN: global scale NaN, block scales 0x7F."""
    rng = np.random.default_rng(seed("nvfp4 nan", str(dtype), axis))
    tensors = []
    for bad in ([np.inf], [-np.inf], [np.nan], [np.nan, np.inf, -np.inf]):
        x = random_values(rng, shape, dtype, "normal")
        x.flat[rng.integers(x.size, size=len(bad))] = cast(bad, dtype)
        tensors.append(x)
    return tensors


# ------------------------------------------------------------------------------------------
# FP8 E4M3 hand-built rows (one scale per (token, head) row of D values)


def fp8_e4m3_midpoints(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Rows with amax = 448 * s for s in {1, 2**-4, 2**5, 3, 2**-20}: x / s lands exactly on
    every E4M3 midpoint (subnormal ones included), and on the neighbours in `dtype`; then
    rows of +-448 * 2**k (k = -6, 0, 4) with the midpoints * 2**k and their lower
    neighbours."""
    d = shape[2]
    values_rows = []
    covered = 0
    for s in (1.0, 2.0**-4, 2.0**5, 3.0, 2.0**-20):
        anchor = np.asarray(cast([448.0 * s], dtype))
        if anchor[0] != 448.0 * s or 448.0 * s > dtype_max(dtype):
            continue
        tie = np.asarray(E4M3_MIDPOINTS * s, np.float64)
        is_exact = cast(tie, dtype).astype(np.float64) == tie
        tie = cast(tie[is_exact], dtype)
        q = widen(tie) / (widen(anchor)[0] / np.float32(448.0))
        np.testing.assert_array_equal(q, E4M3_MIDPOINTS[is_exact])
        covered += is_exact.sum()
        values = np.concatenate([tie, next_toward(tie, dtype, INF), next_toward(tie, dtype, 0.0)])
        values = values * np.resize(np.array([1, -1], dtype), values.size)
        for i in range(0, values.size, d - 1):
            sign = anchor * (-1 if (i // (d - 1)) % 2 else 1)
            values_rows.append(np.r_[sign, values[i : i + d - 1]].astype(dtype))
    assert covered >= (3 if dtype == F16 else 5) * len(E4M3_MIDPOINTS) - 40, covered
    for k in (-6, 0, 4) if dtype != F16 else (-6, 0):
        s = 2.0**k
        for chunk in np.array_split(E4M3_MIDPOINTS, 4):
            row = exact([448 * s, *(chunk * s)], dtype)
            values_rows += [row, -row, np.r_[row[:1], next_toward(row[1:], dtype, 0)]]
    return rows(values_rows, dtype, shape=shape)


def fp8_zeros(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """All-zero rows (+0 / -0: scale 0, codes +0) and -0.0 in non-zero rows (code 0x80)."""
    z = -0.0
    values_rows = [
        [0.0],
        [z],
        [0.0, z],
        [1.0, z, 0.0],
        [448.0, z, -1e-3],
        [z, -1.0],
        [-2.0, 0.0],
        [z, 0.0],
        [3.0, z, 0.0],
    ]
    values_rows = [cast(r, dtype) for r in values_rows] + [exact([z, 1.0], dtype)]
    return [np.zeros(shape, dtype), *rows(values_rows, dtype, shape=shape)]


def fp8_tiny(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Row scales that flush (amax < 448 * 2**-126: codes +0), that are exactly 2**-126 or
    just above, x / s that flushes to a signed zero, flushed subnormal inputs."""
    tv = tiny_values(dtype)
    values_rows = [*tv.values(), np.concatenate(list(tv.values()))]
    values_rows += [np.concatenate([v, cast([1.0, -2.0], dtype)]) for v in tv.values()]
    if dtype == F16:
        values_rows += [cast(r, dtype) for r in ([6e-8, -6e-8], [2.0**-24, 2.0**-14])]
        return rows(values_rows, dtype, shape=shape)
    edge = exact([448.0 * 2.0**-126], dtype)
    values_rows += [
        cast([1e-36, -1e-37, 0.0], dtype),
        edge,
        next_toward(edge, dtype, 0.0),
        np.r_[edge, exact([-(2.0**-126)], dtype)],
        cast([3e38, -1e-3, 1e-3, -1e-30], dtype),  # x / s flushes to -0 / +0
        cast([1.0, 2.0**-126, -(2.0**-126)], dtype),
    ]
    assert ftz(np.float32(1e-36) / np.float32(448.0)) == 0
    more = [
        [448 * 2.0**-127, -(2.0**-120)],
        [448 * 2.0**-126, 2.0**-126, -(2.0**-130)],
        [1e-37, 2e-38],
        [2.0**-127, -(2.0**-127)],
        [1e-35, -3e-36],
    ]
    values_rows += [cast(r, dtype) for r in more]
    return rows(values_rows, dtype, shape=shape)


def fp8_huge(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Rows with the dtype's max (scale near the float32 max), values past 65504 (float16
    output overflows)."""
    big = dtype_max(dtype)
    values_rows = [[big, -big, 1.0], [big, 0.5], [65504.0, -65504.0, 1.0], [60000.0, -3.0]]
    values_rows += [[big, big / 3, big / 7], [-65504.0, 1e-3]]
    if dtype != F16:
        values_rows += [[3e38, -1e38, 1e30], [1e5, -65504.0, 65520.0], [65536.0, -1e-20]]
    return rows([cast(r, dtype) for r in values_rows], dtype, shape=shape)


def fp8_non_finite(dtype, axis, *, shape=SHAPE) -> list[np.ndarray]:
    """Rows holding inf / -inf / NaN (NaN scale, NaN codes) next to finite rows: in a zero
    tensor, and in a tensor of normal random data."""
    nan, inf = np.nan, np.inf
    values_rows = [
        [inf, 1.0],
        [-inf],
        [nan, 1.0],
        [inf, -inf, nan],
        [-0.0, nan],
        [1.0, 448.0, -3.5],
    ]
    out = rows([cast(r, dtype) for r in values_rows], dtype, shape=shape)
    rng = np.random.default_rng(seed("fp8 nf", str(dtype)))
    x = random_values(rng, shape, dtype, "normal")
    for i, r in enumerate([[inf, 1.0], [-inf], [nan, 2.0], [nan, inf]]):
        x[2 * i, i % 2, : len(r)] = cast(r, dtype)
    return [*out, x]


# ------------------------------------------------------------------------------------------
# the edge-case tables: name -> (constructor, input dtypes)

INT4_CASES = {
    "exact_ties": (int4_exact_ties, DTYPES),
    "rounded_ties": (int4_rounded_ties, (F32,)),
    "division_ties": (int4_division_ties, (F32,)),
    "zeros": (int4_zeros, DTYPES),
    "tiny": (int4_tiny, DTYPES),
    "huge": (int4_huge, DTYPES),
    "non_finite": (int4_non_finite, DTYPES),
}
NVFP4_CASES = {
    "e2m1_midpoints": (nvfp4_e2m1_midpoints, DTYPES),
    "fallback_midpoints": (nvfp4_fallback_midpoints, (BF16, F32)),
    "e4m3_scale_midpoints": (nvfp4_e4m3_scale_midpoints, DTYPES),
    "scale_clamp": (nvfp4_scale_clamp, DTYPES),
    "zeros": (nvfp4_zeros, DTYPES),
    "tiny": (nvfp4_tiny, DTYPES),
    "huge": (nvfp4_huge, DTYPES),
    "non_finite": (nvfp4_non_finite, DTYPES),
}
FP8_CASES = {
    "e4m3_midpoints": (fp8_e4m3_midpoints, DTYPES),
    "zeros": (fp8_zeros, DTYPES),
    "tiny": (fp8_tiny, DTYPES),
    "huge": (fp8_huge, DTYPES),
    "non_finite": (fp8_non_finite, DTYPES),
}
#: format -> its edge-case table.
EDGE_CASES = {"int4": INT4_CASES, "nvfp4": NVFP4_CASES, "fp8_e4m3": FP8_CASES}


def edge_case_grid(formats=FORMATS) -> list[tuple[str, str, np.dtype, str]]:
    """(format, case, input dtype, kind) for every edge case of `formats`, every dtype the
    case supports and both kinds (each kind in its default layout, AXIS_OF)."""
    return [
        (fmt, name, dt, kind)
        for fmt in formats
        for name, (_, dtypes) in EDGE_CASES[fmt].items()
        for dt in dtypes
        for kind in KINDS
    ]
