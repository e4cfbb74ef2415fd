"""Every JAX codec against the scalar oracle, bit for bit (docs/FORMAT.md, docs/ORACLE.md).

Each input goes through the oracle (`kvq_jax.oracle`, plain Python) and through the jitted
codec (`kvq_jax.pack_kv` / `unpack_kv`). Every stored array (codes and all metadata) must have
the same bytes, and the decoded tensor in every output dtype must have the same bytes, except
that a decoded NaN matches any NaN (its sign and payload depend on the device).

The inputs (random distributions and hand-built edge cases: ties, midpoints, tiny and huge
values, non-finite values) come from `codec_cases`, shared with the Torch tests; the
hand-built ones assert their own construction, and the expected bytes always come from the
oracle, never from the codec.

Compile budget: `pack_kv` compiles once per (format, kind, axis, group size, shape, dtype).
All hand-built tensors are laid out in the one shape `SHAPE` and use the two default layouts
(int4 with group size `G4`), so they share their compiles with the random grid test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from codec_cases import (
    AXIS_OF,
    BF16,
    DISTS,
    DTYPES,
    EDGE_CASES,
    F16,
    F32,
    FORMATS,
    G4,
    KINDS,
    SHAPE,
    SPECIALS,
    cast,
    edge_case_grid,
    fp8_e4m3_midpoints,
    fp8_non_finite,
    fp8_tiny,
    int4_non_finite,
    int4_rounded_ties,
    int4_tiny,
    mixed_values,
    nvfp4_e2m1_midpoints,
    nvfp4_tiny,
    random_values,
    seed,
)
from helpers import assert_packed_equal, assert_same_bytes, assert_same_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvq_jax import oracle, pack_kv, unpack_kv

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
    rng = np.random.default_rng(seed("grid", fmt, kind, axis, str(dtype)))
    g = G4 if fmt == "int4" else None
    check(mixed_values(rng, SHAPE, dtype), fmt, kind, group_size=g, axis=axis)
    for dist in DISTS:
        x = random_values(rng, SHAPE, dtype, dist)
        check(x, fmt, kind, group_size=g, axis=axis, out_dtypes=(dtype,), what=dist)


# ------------------------------------------------------------------------------------------
# hand-built edge cases (codec_cases.EDGE_CASES), both default layouts: INT4 (G = 16),
# NVFP4, FP8 E4M3 rows


def _edge_params(fmt):
    return [
        pytest.param(name, dt, kind, id=f"{name}-{dt}-{kind}")
        for _, name, dt, kind in edge_case_grid([fmt])
    ]


@pytest.mark.parametrize(("case", "dtype", "kind"), _edge_params("int4"))
def test_int4_edge_cases(case, dtype, kind):
    build, _ = EDGE_CASES["int4"][case]
    for i, x in enumerate(build(dtype, AXIS_OF[kind])):
        check(x, "int4", kind, group_size=G4, what=f"int4 {case} {dtype} {kind} #{i}")


@pytest.mark.parametrize(("case", "dtype", "kind"), _edge_params("nvfp4"))
def test_nvfp4_edge_cases(case, dtype, kind):
    build, _ = EDGE_CASES["nvfp4"][case]
    for i, x in enumerate(build(dtype, AXIS_OF[kind])):
        check(x, "nvfp4", kind, what=f"nvfp4 {case} {dtype} {kind} #{i}")


@pytest.mark.parametrize(("case", "dtype", "kind"), _edge_params("fp8_e4m3"))
def test_fp8_edge_cases(case, dtype, kind):
    build, _ = EDGE_CASES["fp8_e4m3"][case]
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
    rng = np.random.default_rng(seed("G", group_size, axis))
    for dist in ("int4_ties", "channel_offsets"):
        x = random_values(rng, SHAPE, dtype, dist)
        check(x, "int4", kind, group_size=group_size, out_dtypes=(dtype,))


SMALL_SHAPES = [(1, 1, 1), (1, 3, 37), (17, 2, 1), (0, 2, 8)]


@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_small_and_empty_shapes(fmt, shape):
    """T = 1, D = 1 (one nibble per byte), odd D, T = 0 (empty arrays, NVFP4 g = 1)."""
    i = SMALL_SHAPES.index(shape)
    kind = KINDS[(i + FORMATS.index(fmt)) % 2]
    dtype = DTYPES[(i + FORMATS.index(fmt)) % 3]
    rng = np.random.default_rng(seed("small", fmt, shape))
    x = random_values(rng, shape, dtype, "heavy", zeros=0.2)
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
    rng = np.random.default_rng(seed("strided", fmt, str(dtype)))
    base = random_values(rng, (2 * t, d, h), dtype, "channel_offsets")
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
        x = int4_non_finite(F32, "channels")[0]
        x[SHAPE[0] // 2 :] = int4_tiny(F32, "channels")[0][: SHAPE[0] // 2]
        return [int4_rounded_ties(F32, "channels")[0], x]
    if fmt == "nvfp4":
        return [nvfp4_e2m1_midpoints(F32, "channels")[0], nvfp4_tiny(F32, "channels")[3]]
    x = fp8_non_finite(F32, "channels")[0]
    x[SHAPE[0] // 2 :] = fp8_tiny(F32, "channels")[0][: SHAPE[0] // 2]
    return [fp8_e4m3_midpoints(F32, "channels")[0], x]


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
    data_seed = draw(st.integers(0, 2**32 - 1))
    specials = draw(
        st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=5)
    )
    x = random_values(np.random.default_rng(data_seed), shape, dtype, dist)
    for position, value in specials:
        if x.size:
            x.flat[position % x.size] = cast([value], dtype)[0]
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
    rng = np.random.default_rng(seed("vmap", fmt))
    configs = [(kind, dt) for kind in KINDS for dt in DTYPES]
    batches = []
    for c, (_, dt) in enumerate(configs):
        xs = np.stack(
            [
                random_values(rng, shape, dt, DISTS[(i + c) % len(DISTS)], zeros=0.02 * (i % 4))
                for i in range(VMAP_PER_LAYOUT)
            ]
        )
        for i in range(5, VMAP_PER_LAYOUT, 37):  # a few tensors with an inf or a NaN
            xs[i].flat[rng.integers(xs[i].size)] = cast([(np.inf, -np.inf, np.nan)[i % 3]], dt)[0]
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
