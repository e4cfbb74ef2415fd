"""The Torch codec (`kvq_torch_bridge`) against the scalar oracle and against kvq_jax.

Every stored array must have the oracle's (and kvq_jax's) bytes, and decoded tensors the same
bytes except that a decoded NaN matches any NaN. The inputs (random distributions and
hand-built edge cases) come from `codec_cases`, shared with the kvq_jax tests: hand-built
inputs assert their own construction (ties really are ties), and the expected bytes always
come from the oracle or from kvq_jax, never from the Torch code under test.

Device: the tests that take `device` run on CPU and, with `--run-gpu` on a CUDA machine, on
CUDA as well. JAX compile budget: kvq_jax compiles once per (format, layout, shape, dtype), so
the JAX comparisons reuse a few fixed configurations and vary only the data.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from codec_cases import (
    AXIS_OF,
    BF16,
    DISTS,
    DTYPES,
    E2M1_GRID,
    E2M1_MIDPOINTS,
    E4M3,
    E4M3_MIDPOINTS,
    E4M3_VALUES,
    EDGE_CASES,
    F16,
    F32,
    FORMATS,
    G4,
    KINDS,
    SPECIALS,
    cast,
    edge_case_grid,
    ftz,
    mixed_values,
    random_values,
    seed,
)
from helpers import (
    assert_same_bytes,
    assert_same_values,
    numpy_to_torch,
    torch_to_numpy,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import kvq_jax as kq
from kvq_jax import oracle
from kvq_jax.core import constants
from kvq_jax.oracle import residual as oracle_residual
from kvq_torch_bridge.codecs import _numerics as tn
from kvq_torch_bridge.codecs import api as tapi
from kvq_torch_bridge.codecs import loops as tloops
from kvq_torch_bridge.codecs import packed as tpacked
from kvq_torch_bridge.codecs import registry as treg
from kvq_torch_bridge.codecs import residual as tres

TORCH_OF = {BF16: torch.bfloat16, F16: torch.float16, F32: torch.float32}

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]

#: Hand-built tensors (codec_cases constructors take it as `shape`): T = 40 and D = 37 leave
#: partial groups for G = 16 on both axes; two heads (kvq_jax's tests use three) keep the
#: Torch runs short.
SHAPE = (40, 2, 37)


# ------------------------------------------------------------------------------------------
# comparing


def _kwargs(group_size=None, axis=None, window=None):
    """Omit None arguments (so every kvq_jax call with one layout shares one jit entry)."""
    items = (("group_size", group_size), ("axis", axis), ("window", window))
    return {k: v for k, v in items if v is not None}


def assert_torch_arrays(packed, expected: dict, what: str) -> None:
    """A Torch PackedKV's arrays equal `expected` (name -> numpy array) byte for byte."""
    assert set(packed.arrays) == set(expected), f"{what}: {sorted(packed.arrays)}"
    for name, want in expected.items():
        got = packed.arrays[name]
        assert got.is_contiguous(), f"{what}.{name} is not contiguous"
        assert_same_bytes(torch_to_numpy(got), np.asarray(want), f"{what}.{name}")


def check_oracle(
    x,
    fmt,
    kind,
    *,
    group_size=None,
    axis=None,
    out_dtypes=DTYPES,
    device="cpu",
    x_torch=None,
    what="",
):
    """Pack numpy `x` with the oracle and (`x_torch`, default `x` on `device`) with the Torch
    codec; every stored array and every decoded dtype must agree. Returns the Torch packing."""
    what = what or f"{fmt} {kind} {np.dtype(x.dtype)} {x.shape}"
    expected = oracle.pack(np.asarray(x), format=fmt, kind=kind, group_size=group_size, axis=axis)
    xt = numpy_to_torch(x, device) if x_torch is None else x_torch
    packed = tapi.pack_kv(xt, kind=kind, format=fmt, **_kwargs(group_size, axis))
    meta = (packed.format, packed.kind, packed.axis, packed.group_size, packed.shape, packed.dtype)
    want = (
        expected.format,
        expected.kind,
        expected.axis,
        expected.group_size,
        expected.shape,
        expected.dtype,
    )
    assert meta == want, what
    assert isinstance(packed.dtype, np.dtype) and packed.torch_dtype == xt.dtype, what
    assert all(a.device == xt.device for a in packed.arrays.values()), what
    assert_torch_arrays(packed, expected.arrays, what)
    for dt in out_dtypes:
        got = tapi.unpack_kv(packed, dtype=dt)
        assert got.device == xt.device and got.is_contiguous(), what
        assert_same_values(torch_to_numpy(got), oracle.unpack(expected, dt), f"{what} -> {dt}")
    return packed


# conversion between the stacks (arrays through numpy; the DLPack bridge is tested elsewhere)

_TO_TORCH = {
    kq.PackedKV: tpacked.PackedKV,
    kq.WindowedKV: tpacked.WindowedKV,
    kq.KVResidual: tpacked.KVResidual,
    kq.LoopCode: tloops.LoopCode,
}
_TO_JAX = {v: k for k, v in _TO_TORCH.items()}


#: Static metadata fields of the containers (compared as Python values, never converted).
META = {"format", "kind", "axis", "group_size", "shape", "dtype", "window", "absolute"}


def to_torch(obj, device="cpu"):
    """A kvq_jax container (or array) -> the Torch container with the same bytes."""
    if obj is None:
        return None
    if isinstance(obj, tuple):
        return tuple(to_torch(o, device) for o in obj)
    if type(obj) in _TO_TORCH:
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        fields = {k: v if k in META else to_torch(v, device) for k, v in fields.items()}
        return _TO_TORCH[type(obj)](**fields)
    return numpy_to_torch(np.asarray(obj), device)


def to_jax(obj):
    """A Torch container (or tensor) -> the kvq_jax container with the same bytes."""
    if obj is None:
        return None
    if isinstance(obj, tuple):
        return tuple(to_jax(o) for o in obj)
    if type(obj) in _TO_JAX:
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        fields = {k: v if k in META else to_jax(v) for k, v in fields.items()}
        return _TO_JAX[type(obj)](**fields)
    return jnp.asarray(torch_to_numpy(obj))


def assert_trees_equal(tree_t, tree_j, what: str) -> None:
    """A Torch container and a kvq_jax container: same type, metadata and bytes."""
    if tree_j is None:
        assert tree_t is None, what
        return
    if isinstance(tree_j, tuple):
        assert isinstance(tree_t, tuple) and len(tree_t) == len(tree_j), what
        for i, (a, b) in enumerate(zip(tree_t, tree_j, strict=True)):
            assert_trees_equal(a, b, f"{what}[{i}]")
        return
    if type(tree_j) in _TO_TORCH:
        assert type(tree_t) is _TO_TORCH[type(tree_j)], f"{what}: {type(tree_t)}"
        for f in dataclasses.fields(tree_j):
            a, b = getattr(tree_t, f.name), getattr(tree_j, f.name)
            if f.name in META:
                assert a == b and type(a) is type(b), f"{what}.{f.name}: {a!r} != {b!r}"
            else:
                assert_trees_equal(a, b, f"{what}.{f.name}")
        return
    assert isinstance(tree_t, torch.Tensor), what
    assert_same_bytes(torch_to_numpy(tree_t), np.asarray(tree_j), what)


def check_jax(x, fmt, kind, *, group_size=None, axis=None, device="cpu", what=""):
    """Torch and kvq_jax pack `x` to the same bytes and metadata; each stack decodes the
    other's arrays to the same values."""
    what = what or f"{fmt} {kind} {np.dtype(x.dtype)} {x.shape}"
    args = dict(kind=kind, format=fmt, **_kwargs(group_size, axis))
    pj = kq.pack_kv(x, **args)
    pt = tapi.pack_kv(numpy_to_torch(x, device), **args)
    assert_trees_equal(pt, pj, what)
    want = np.asarray(kq.unpack_kv(pj))
    assert_same_values(torch_to_numpy(tapi.unpack_kv(pt)), want, f"{what} decoded")
    assert_same_values(torch_to_numpy(tapi.unpack_kv(to_torch(pj, device))), want, what)
    assert_same_values(np.asarray(kq.unpack_kv(to_jax(pt))), want, f"{what} cross-decoded")


# ------------------------------------------------------------------------------------------
# hand-built edge cases (codec_cases.EDGE_CASES; INT4 with G = 16)

EDGE_PARAMS = [
    pytest.param(fmt, name, dt, kind, id=f"{fmt}-{name}-{dt}-{kind}")
    for fmt, name, dt, kind in edge_case_grid()
]


@pytest.mark.parametrize(("fmt", "case", "dtype", "kind"), EDGE_PARAMS)
def test_edge_cases_match_oracle(fmt, case, dtype, kind):
    build, _ = EDGE_CASES[fmt][case]
    g = G4 if fmt == "int4" else None
    for i, x in enumerate(build(dtype, AXIS_OF[kind], shape=SHAPE)):
        check_oracle(x, fmt, kind, group_size=g, what=f"{fmt} {case} {dtype} {kind} #{i}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_edge_cases_on_device(fmt, device):
    """One tensor of every hand-built case, on `device` (CUDA with --run-gpu)."""
    g = G4 if fmt == "int4" else None
    for name, (build, dtypes) in EDGE_CASES[fmt].items():
        for kind in KINDS:
            dt = dtypes[-1]
            x = build(dt, AXIS_OF[kind], shape=SHAPE)[0]
            check_oracle(x, fmt, kind, group_size=g, device=device, what=f"{fmt} {name} {kind}")


# ------------------------------------------------------------------------------------------
# layouts: group sizes, partial groups on both axes, odd D, small and empty shapes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axis", ["tokens", "channels"])
def test_int4_group_sizes_partial_groups(axis, device):
    """G from 1 to 128 on T = 40, D = 37: partial last groups on both axes."""
    kind = "key" if axis == "tokens" else "value"
    for i, g in enumerate((1, 3, 7, 16, 32, 64, 128)):
        dtype = DTYPES[i % 3]
        rng = np.random.default_rng(seed("G", g, axis))
        for dist in ("int4_ties", "channel_offsets"):
            x = random_values(rng, SHAPE, dtype, dist)
            check_oracle(x, "int4", kind, group_size=g, out_dtypes=(dtype,), device=device)


SMALL_SHAPES = [(1, 1, 1), (1, 3, 37), (17, 2, 1), (0, 2, 8), (0, 1, 3), (2, 1, 33), (16, 1, 16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_small_and_empty_shapes(fmt, device):
    """T = 1, D = 1 (one nibble per byte), odd D, T = 0 (empty arrays, NVFP4 g = 1), both
    axes and every input dtype."""
    for i, shape in enumerate(SMALL_SHAPES):
        rng = np.random.default_rng(seed("small", fmt, shape))
        for kind, axis in (("key", None), ("value", None), ("key", "channels")):
            if fmt == "fp8_e4m3" and axis:
                continue
            dtype = DTYPES[(i + len(kind)) % 3]
            x = random_values(rng, shape, dtype, "heavy", zeros=0.2)
            if x.size:
                x.flat[0] = -0.0
            check_oracle(
                x, fmt, kind, group_size=3 if fmt == "int4" else None, axis=axis, device=device
            )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_torch_inputs(fmt, dtype, device):
    """Transposed + strided, flipped, expanded (stride 0) and offset sub-window views."""
    t, h, d = SHAPE
    g = G4 if fmt == "int4" else None
    rng = np.random.default_rng(seed("strided", fmt, str(dtype)))
    base_np = random_values(rng, (2 * t, d, h), dtype, "channel_offsets")
    base = numpy_to_torch(base_np, device)
    row = numpy_to_torch(random_values(rng, (1, h, d), dtype, "normal"), device)
    wide_np = random_values(rng, (t, h + 2, d + 7), dtype, "heavy")
    wide = numpy_to_torch(wide_np, device)
    views = {
        "strided-transposed": (base[::2].transpose(1, 2), base_np[::2].transpose(0, 2, 1)),
        "flipped": (
            base[:t].flip(0, 1).transpose(1, 2),
            base_np[:t][::-1, ::-1].transpose(0, 2, 1),
        ),
        "expanded": (row.expand(t, h, d), np.broadcast_to(torch_to_numpy(row), SHAPE)),
        "offset-window": (wide[:, 1 : 1 + h, 3 : 3 + d], wide_np[:, 1 : 1 + h, 3 : 3 + d]),
    }
    for name, (view, want) in views.items():
        assert tuple(view.shape) == SHAPE
        assert not view.is_contiguous()
        for kind in KINDS:
            check_oracle(
                np.ascontiguousarray(want),
                fmt,
                kind,
                group_size=g,
                x_torch=view,
                out_dtypes=(dtype,),
                device=device,
                what=f"{name} {kind}",
            )
    assert_same_bytes(torch_to_numpy(base), base_np, "input untouched")


# ------------------------------------------------------------------------------------------
# Torch vs kvq_jax: hypothesis and thousands of random tensors

#: Fixed layouts for the JAX comparisons (one kvq_jax compile each): every format, both
#: kinds, overridden axes, odd D, partial groups, every dtype.
JAX_CONFIGS = [
    ("int4", "key", None, 16, (40, 2, 37), BF16),
    ("int4", "value", None, 8, (9, 3, 21), F32),
    ("int4", "key", "channels", 5, (9, 3, 21), F16),
    ("nvfp4", "key", None, None, (40, 2, 37), F16),
    ("nvfp4", "value", None, None, (9, 3, 21), BF16),
    ("nvfp4", "value", "tokens", None, (20, 1, 16), F32),
    ("fp8_e4m3", "key", None, None, (40, 2, 37), F32),
    ("fp8_e4m3", "value", None, None, (9, 3, 21), BF16),
]


@st.composite
def _jax_cases(draw):
    config = draw(st.sampled_from(JAX_CONFIGS))
    dist = draw(st.sampled_from(DISTS))
    data_seed = draw(st.integers(0, 2**32 - 1))
    specials = draw(
        st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=4)
    )
    x = random_values(np.random.default_rng(data_seed), config[4], config[5], dist)
    for position, value in specials:
        x.flat[position % x.size] = cast([value], config[5])[0]
    return config, x


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(_jax_cases())
def test_property_torch_matches_jax(case):
    (fmt, kind, axis, g, _, _), x = case
    check_jax(x, fmt, kind, group_size=g, axis=axis)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_matches_jax_mixed(device):
    """Every JAX layout on mixed-distribution data, on `device`."""
    for fmt, kind, axis, g, shape, dt in JAX_CONFIGS:
        rng = np.random.default_rng(seed("mixed", fmt, kind, axis, shape))
        check_jax(mixed_values(rng, shape, dt), fmt, kind, group_size=g, axis=axis, device=device)


BATCH_SPECS = {
    "int4": ((6, 2, 11), 4),  # partial groups on both axes, odd D
    "nvfp4": ((18, 1, 8), None),  # tokens: 16 + 2; channels: one partial block of 8
    "fp8_e4m3": ((4, 3, 12), None),
}
BATCH_LAYOUTS = (("key", BF16), ("value", F16), ("key", F32))
BATCH_PER_LAYOUT = 240  # x 3 layouts x 3 formats = 2160 tensors


def _stack_fields(packs) -> dict[str, np.ndarray]:
    return {
        name: np.stack([torch_to_numpy(p.arrays[name]) for p in packs]) for name in packs[0].arrays
    }


@pytest.mark.parametrize("fmt", FORMATS)
def test_thousands_of_random_tensors_match_jax(fmt):
    """720 random small tensors per format (2160 in all), every distribution, three dtypes:
    Torch packs one by one, kvq_jax packs the batch under vmap (one compile per layout);
    every stored byte and every decoded value agrees, and each stack decodes the other's."""
    shape, g = BATCH_SPECS[fmt]
    rng = np.random.default_rng(seed("batch", fmt))
    batches = []
    for c, (_, dt) in enumerate(BATCH_LAYOUTS):
        xs = [
            random_values(rng, shape, dt, DISTS[(i + c) % len(DISTS)], zeros=0.02 * (i % 4))
            for i in range(BATCH_PER_LAYOUT)
        ]
        for i in range(0, BATCH_PER_LAYOUT, 17):  # sprinkle specials into a few
            xs[i].flat[i % xs[i].size] = cast([SPECIALS[i % len(SPECIALS)]], dt)[0]
        batches.append(np.stack(xs))

    @jax.jit
    def jax_all(*batches):
        out = []
        for (kind, _), b in zip(BATCH_LAYOUTS, batches, strict=True):
            p = jax.vmap(lambda v, kind=kind: kq.pack_kv(v, kind=kind, format=fmt, **_kwargs(g)))(b)
            out.append((p, jax.vmap(kq.unpack_kv)(p)))
        return out

    for (kind, _), b, (pj, uj) in zip(BATCH_LAYOUTS, batches, jax_all(*batches), strict=True):
        packs = [tapi.pack_kv(numpy_to_torch(x), kind=kind, format=fmt, **_kwargs(g)) for x in b]
        got = _stack_fields(packs)
        assert set(got) == set(pj.arrays)
        for name, array in pj.arrays.items():
            assert_same_bytes(got[name], np.asarray(array), f"{fmt} {kind} batch {name}")
        decoded = np.stack([torch_to_numpy(tapi.unpack_kv(p)) for p in packs])
        assert_same_values(decoded, np.asarray(uj), f"{fmt} {kind} batch decoded")
        # Torch decodes kvq_jax's arrays (here: one in nine) to the same values
        for i in range(0, len(b), 9):
            one = jax.tree.map(lambda a, i=i: a[i], pj)
            assert_same_values(
                torch_to_numpy(tapi.unpack_kv(to_torch(one))),
                np.asarray(uj[i]),
                f"{fmt} {kind} #{i} cross",
            )


# ------------------------------------------------------------------------------------------
# output dtypes and the window


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_output_dtype_matches_jax(fmt):
    """unpack_kv(dtype=...) for each output dtype, torch and numpy dtype spellings."""
    shape, g = (9, 3, 21), (5 if fmt == "int4" else None)
    x = random_values(np.random.default_rng(seed("out", fmt)), shape, BF16, "heavy")
    pj = kq.pack_kv(x, kind="value", format=fmt, **_kwargs(g))
    pt = tapi.pack_kv(numpy_to_torch(x), kind="value", format=fmt, **_kwargs(g))
    for dt in DTYPES:
        want = np.asarray(kq.unpack_kv(pj, dtype=dt))
        for spelling in (dt, TORCH_OF[dt], dt.name if dt != BF16 else ml_dtypes.bfloat16):
            got = tapi.unpack_kv(pt, dtype=spelling)
            assert got.dtype == TORCH_OF[dt]
            assert_same_values(torch_to_numpy(got), want, f"{fmt} -> {spelling}")


def _random_arrays(rng, fmt, shape, axis, g) -> dict[str, np.ndarray]:
    """Arbitrary stored bits for every array of `fmt` (NaN, inf, subnormal and negative
    metadata included); the odd-D padding nibble is 0 (anything else is not a payload)."""
    arrays = {}
    for name, (dt, shp) in oracle.array_spec(fmt, shape, axis, g).items():
        bits = np.dtype(f"u{dt.itemsize}")
        a = rng.integers(0, 2 ** (8 * dt.itemsize), size=shp, dtype=np.uint64).astype(bits)
        if name == "codes" and dt == np.uint8 and shape[2] % 2:
            a[..., -1] &= 0x0F
        arrays[name] = a.view(dt)
    if fmt == "nvfp4":  # a few meaningful global scales among the random ones
        specials = [1.0, 2.0**-127, 2.0**-140, -3.5, 0.0, np.inf, 3e38, 1e-38, 128.0]
        arrays["global_scale"] = np.asarray(specials[rng.integers(len(specials))], F32)
    return arrays


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_arbitrary_bits(fmt):
    """Torch decodes arbitrary stored bits like the oracle and kvq_jax (NaN, inf, subnormal
    and negative scales; the oracle flushes subnormal scales on input)."""
    (_, kind, axis, g, shape, dt) = next(c for c in JAX_CONFIGS if c[0] == fmt and c[4][0] == 9)
    axis, g = kq.get_codec(fmt).resolve(shape, kind, axis, g)
    rng = np.random.default_rng(seed("bits", fmt))
    for _ in range(40):
        arrays = _random_arrays(rng, fmt, shape, axis, g)
        meta = dict(format=fmt, kind=kind, axis=axis, group_size=g, shape=shape, dtype=dt)
        want = oracle.unpack(oracle.OraclePacked(**meta, arrays=arrays))
        pt = tpacked.PackedKV(**{k: numpy_to_torch(v) for k, v in arrays.items()}, **meta)
        pj = kq.PackedKV(**{k: jnp.asarray(v) for k, v in arrays.items()}, **meta)
        assert_same_values(torch_to_numpy(tapi.unpack_kv(pt)), want, f"{fmt} torch")
        assert_same_values(np.asarray(kq.unpack_kv(pj)), want, f"{fmt} jax")


def test_requires_grad_inputs():
    """Inputs that require grad pack to the same bytes and leave no autograd graph."""
    x = random_values(np.random.default_rng(2), (9, 3, 21), F32, "normal")
    xt = numpy_to_torch(x).requires_grad_(True)
    for fmt in FORMATS:
        p = tapi.pack_kv(xt, kind="key", format=fmt)
        assert all(not a.requires_grad for a in p.arrays.values())
        assert_torch_arrays(p, oracle.pack(x, format=fmt, kind="key").arrays, fmt)
        assert not tapi.unpack_kv(p).requires_grad


WINDOWS = [kq.Window(sink=4, recent=6), kq.Window(sink=0, recent=3), kq.Window(sink=50, recent=0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_window_matches_oracle_and_jax(fmt, device):
    """Window rows raw (copied, not aliased), middle rows packed; sink larger than T."""
    g = 8 if fmt == "int4" else None
    rng = np.random.default_rng(seed("window", fmt))
    x = random_values(rng, (30, 2, 13), BF16, "channel_offsets")
    x[3, 0, :3] = cast([1e-39, -1e-40, -0.0], BF16)  # raw rows keep subnormals
    for window in WINDOWS:
        xt = numpy_to_torch(x, device)
        wt = tapi.pack_kv(xt, kind="key", format=fmt, window=window, **_kwargs(g))
        want = oracle_residual.pack_windowed(x, window=window, format=fmt, kind="key", group_size=g)
        assert isinstance(wt, tpacked.WindowedKV) and wt.window == window
        assert wt.shape == x.shape and wt.dtype == BF16 and wt.format == fmt
        assert_same_bytes(torch_to_numpy(wt.head), want.head, "head")
        assert_same_bytes(torch_to_numpy(wt.tail), want.tail, "tail")
        assert_torch_arrays(wt.middle, want.middle.arrays, f"{fmt} {window} middle")
        assert_same_bytes(torch_to_numpy(tapi.unpack_kv(wt)), oracle_residual.unpack_any(want))
        xt.zero_()  # the window rows are owned copies, not views of the input
        assert_same_bytes(torch_to_numpy(wt.head), want.head, "head after input changed")
        wj = kq.pack_kv(x, kind="key", format=fmt, window=window, **_kwargs(g))
        assert_trees_equal(wt, wj, f"{fmt} {window}")
        for dt in DTYPES:  # raw rows cast like kvq_jax's (subnormals included)
            assert_same_values(
                torch_to_numpy(tapi.unpack_kv(wt, dt)),
                np.asarray(kq.unpack_kv(wj, dt)),
                f"{fmt} {window} -> {dt}",
            )


# ------------------------------------------------------------------------------------------
# residual chains


def make_chain(loops=4, t=40, h=2, d=20, step=0.3, seed=0, dtype=BF16) -> np.ndarray:
    """[L, T, H, D]: loop 0 KV-like, each later loop = previous + step * noise."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h, d)).astype(np.float32) + rng.standard_normal((1, h, d)) * 2
    out = [x]
    for _ in range(loops - 1):
        out.append(out[-1] + step * rng.standard_normal((t, h, d)).astype(np.float32))
    return np.stack(out).astype(dtype)


def sparse_maps(t: int, seed: int = 0, window=None):
    """Loop 2 keeps ~25% of the rows, loop 3 a ~10% subset of those (nested maps)."""
    rng = np.random.default_rng(seed)
    p2 = np.sort(rng.choice(t, size=max(1, t // 4), replace=False))
    p3 = np.sort(rng.choice(p2, size=max(1, t // 10), replace=False))
    if window is not None:
        head, _, tail = window.split_sizes(t)
        must = np.r_[np.arange(head), np.arange(t - tail, t)]
        p2, p3 = np.union1d(p2, must), np.union1d(p3, must)
    return [None, p2.astype(np.int32), p3.astype(np.int32)]


def assert_code_matches_oracle(code, base, residuals, window=None):
    if window is None:
        assert_torch_arrays(code.base, base.arrays, "base")
    else:
        assert_same_bytes(torch_to_numpy(code.base.head), base.head, "base.head")
        assert_same_bytes(torch_to_numpy(code.base.tail), base.tail, "base.tail")
        assert_torch_arrays(code.base.middle, base.middle.arrays, "base.middle")
    assert len(code.residuals) == len(residuals)
    for i, (ours, theirs) in enumerate(zip(code.residuals, residuals, strict=True)):
        assert_torch_arrays(ours.payload, theirs.payload.arrays, f"residual {i + 1}")
        for field in ("positions", "head", "tail"):
            want = getattr(theirs, field)
            if want is None:
                assert getattr(ours, field) is None, f"residual {i + 1}.{field}"
            else:
                want = want.astype(np.int32) if field == "positions" else want
                assert_same_bytes(torch_to_numpy(getattr(ours, field)), want, field)


def _positions_on(positions, device):
    if positions is None:
        return None
    return [None if p is None else numpy_to_torch(p, device) for p in positions]


CHAIN_PARAMS = [
    pytest.param(b, r, sparse, id=f"{b}-{r}-{'sparse' if sparse else 'dense'}")
    for b, r in itertools.product(FORMATS, FORMATS)
    for sparse in (False, True)
]


@pytest.mark.parametrize(("base_format", "residual_format", "sparse"), CHAIN_PARAMS)
def test_chain_matches_oracle(base_format, residual_format, sparse):
    loops = make_chain(seed=len(base_format) + 3 * len(residual_format))
    kind = "value" if sparse else "key"
    group_size = 16 if base_format != "fp8_e4m3" else None
    positions = sparse_maps(loops.shape[1]) if sparse else None
    args = dict(
        kind=kind, base_format=base_format, residual_format=residual_format, group_size=group_size
    )
    code = tloops.encode_loops(
        numpy_to_torch(loops), positions=_positions_on(positions, "cpu"), **args
    )
    base, residuals = oracle_residual.encode_loops(loops, positions=positions, **args)
    assert_code_matches_oracle(code, base, residuals)
    want = oracle_residual.decode_loops(base, residuals)
    assert_same_bytes(torch_to_numpy(tloops.decode_loops(code)), want)
    for loop in range(code.num_loops):
        assert_same_bytes(torch_to_numpy(tloops.decode_loop(code, loop=loop)), want[loop])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("residual_format", FORMATS)
def test_window_sparse_chain_matches_oracle(residual_format, device):
    window = kq.Window(sink=4, recent=6)
    loops = make_chain(t=48, seed=3)
    positions = sparse_maps(48, seed=3, window=window)
    for p in positions[1:]:
        tres.validate_positions(numpy_to_torch(p), 48, window=window)
    args = dict(
        kind="key", base_format="int4", residual_format=residual_format, group_size=8, window=window
    )
    code = tloops.encode_loops(
        numpy_to_torch(loops, device), positions=_positions_on(positions, device), **args
    )
    base, residuals = oracle_residual.encode_loops(loops, positions=positions, **args)
    assert_code_matches_oracle(code, base, residuals, window)
    recon = torch_to_numpy(tloops.decode_loops(code))
    assert_same_bytes(recon, oracle_residual.decode_loops(base, residuals, window))
    for loop in range(4):
        assert_same_bytes(recon[loop, :4], loops[loop, :4], f"loop {loop} sink rows")
        assert_same_bytes(recon[loop, -6:], loops[loop, -6:], f"loop {loop} recent rows")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_residuals_match_oracle(dtype):
    """Dense, sparse and windowed single residuals in every dtype, with signed zeros and
    subnormal deltas (flushed), against the oracle."""
    loops = make_chain(loops=2, t=17, d=9, dtype=dtype)
    loops[1, 0, 0, :3] = cast([-0.0, 0.0, -0.0], dtype)
    loops[0, 0, 0, :3] = cast([0.0, -0.0, -0.0], dtype)
    prev_np = oracle.unpack(oracle.pack(loops[0], format="int4", kind="value"))
    prev_np[1, 0, :2] = cast([0.0, 1e-40 if dtype != F16 else 0.0], dtype)
    prev = numpy_to_torch(prev_np)
    pos = np.array([0, 2, 3, 9, 16], np.int32)
    window = kq.Window(sink=1, recent=1)
    cases = [(None, None), (pos, None), (None, window), (pos, window)]
    for fmt, (p, w) in itertools.product(FORMATS, cases):
        cur = loops[1] if p is None else loops[1][p]
        res = tres.encode_residual(
            numpy_to_torch(cur),
            prev,
            kind="value",
            format=fmt,
            positions=None if p is None else numpy_to_torch(p),
            window=w,
        )
        want = oracle_residual.encode_residual(
            cur, prev_np, kind="value", format=fmt, positions=p, window=w
        )
        what = f"{fmt} {p is not None} {w}"
        assert_torch_arrays(res.payload, want.payload.arrays, what)
        assert res.shape == prev_np.shape and res.window == w and res.dtype == dtype
        for field in ("positions", "head", "tail"):
            w_arr = getattr(want, field)
            assert (getattr(res, field) is None) == (w_arr is None), f"{what} {field}"
            if w_arr is not None:
                assert_same_bytes(torch_to_numpy(getattr(res, field)), w_arr, f"{what} {field}")
        got = tres.decode_residual(res, prev)
        assert_same_bytes(
            torch_to_numpy(got), oracle_residual.decode_residual(want, prev_np, w), what
        )
        assert_same_bytes(torch_to_numpy(prev), prev_np, "previous untouched")


#: (args, positions?) for the chains exchanged between the stacks (one kvq_jax compile each).
CROSS_CHAINS = {
    "dense-int4-nvfp4": dict(
        kind="key", base_format="int4", residual_format="nvfp4", group_size=16
    ),
    "sparse-nested-fp8": dict(kind="value", base_format="nvfp4", residual_format="fp8_e4m3"),
    "window-sparse-int4": dict(
        kind="key", base_format="int4", group_size=8, window=kq.Window(sink=4, recent=6)
    ),
}


@pytest.mark.parametrize("name", list(CROSS_CHAINS))
def test_chains_cross_stacks(name):
    """Chains encoded by kvq_jax decode in Torch and chains encoded by Torch decode in
    kvq_jax, to the same bytes; both encodings are byte-identical."""
    args = CROSS_CHAINS[name]
    loops = make_chain(t=48, seed=7)
    positions = None
    if "sparse" in name:
        positions = sparse_maps(48, seed=7, window=args.get("window"))
    code_j = kq.encode_loops(loops, positions=positions, **args)
    code_t = tloops.encode_loops(
        numpy_to_torch(loops), positions=_positions_on(positions, "cpu"), **args
    )
    assert_trees_equal(code_t, code_j, name)
    want = np.asarray(kq.decode_loops(code_j))
    assert_same_bytes(torch_to_numpy(tloops.decode_loops(to_torch(code_j))), want, "jax->torch")
    assert_same_bytes(np.asarray(kq.decode_loops(to_jax(code_t))), want, "torch->jax")
    assert_same_bytes(torch_to_numpy(tloops.decode_loops(code_t)), want, "torch")
    assert_same_bytes(torch_to_numpy(tloops.decode_loop(to_torch(code_j), loop=2)), want[2])
    # one residual step across the stacks: kvq_jax's residual on Torch's reconstruction
    prev = tloops.decode_loop(code_t, loop=1)
    assert_same_bytes(
        torch_to_numpy(tres.decode_residual(to_torch(code_j.residuals[1]), prev)),
        want[2],
        "decode_residual(jax residual)",
    )
    assert code_t.storage_bytes == code_j.storage_bytes
    assert code_t.bits_per_element == code_j.bits_per_element


def test_residual_does_not_alias_inputs():
    """Positions and window rows are owned copies: changing the inputs afterwards changes
    nothing stored."""
    loops = numpy_to_torch(make_chain(loops=2, t=12, d=8))
    prev = tapi.unpack_kv(tapi.pack_kv(loops[0], kind="key"))
    pos = torch.tensor([0, 1, 5, 11], dtype=torch.int32)
    cur = loops[1][pos.long()].clone()
    res = tres.encode_residual(
        cur, prev, kind="key", positions=pos, window=kq.Window(sink=1, recent=1)
    )
    before = [torch_to_numpy(a).copy() for a in (res.positions, res.head, res.tail)]
    pos.fill_(3)
    cur.fill_(7.0)
    for a, b in zip((res.positions, res.head, res.tail), before, strict=True):
        assert_same_bytes(torch_to_numpy(a), b)


# ------------------------------------------------------------------------------------------
# API contract: errors, metadata, sizes, pytrees, registry, no host sync


def _outcome(fn):
    try:
        fn()
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


def _pair(arr):
    """(jax input, torch input) for the same data."""
    return arr, numpy_to_torch(arr)


X = random_values(np.random.default_rng(0), (8, 2, 6), BF16, "normal")
W = kq.Window(sink=1, recent=1)
BAD_PACK_ARGS = [
    dict(kind="keys"),
    dict(kind=None),
    dict(kind="key", format="int8"),
    dict(kind="key", format=None),
    dict(kind="key", axis="heads"),
    dict(kind="key", group_size=0),
    dict(kind="key", group_size=1.5),
    dict(kind="key", group_size=True),
    dict(kind="key", group_size="16"),
    dict(kind="key", format="nvfp4", group_size=8),
    dict(kind="value", format="nvfp4", group_size=32),
    dict(kind="key", format="fp8_e4m3", axis="tokens"),
    dict(kind="key", format="fp8_e4m3", group_size=4),
    dict(kind="key", format="fp8_e4m3", group_size=0),
    dict(kind="key", window=(1, 2)),
]


@pytest.fixture
def builtin_registries():
    """Both stacks' registries as a fresh process has them (the built-in formats) during the
    test: codecs other test modules of this worker registered (engine policies' INTB tables,
    heavy-row formats) are set aside and put back afterwards. Error texts list the formats."""
    builtin = {*constants.FORMATS, *constants.ROTATED_FORMATS}
    saved = []
    for registry in (kq, treg):
        extra = [registry.CODECS[n] for n in list(registry.CODECS) if n not in builtin]
        for codec in extra:
            registry.unregister_codec(codec.name)
        saved.append((registry, extra))
    yield
    for registry, extra in saved:
        for codec in extra:
            registry.register_codec(codec, replace=True)


@pytest.mark.usefixtures("builtin_registries")
@pytest.mark.parametrize("args", BAD_PACK_ARGS, ids=repr)
def test_argument_errors_match_jax(args):
    xj, xt = _pair(X)
    expected = _outcome(lambda: kq.pack_kv(xj, **args))
    assert expected is not None
    got = _outcome(lambda: tapi.pack_kv(xt, **args))
    assert got == expected, f"{got} != {expected}"


def test_value_errors_match_jax():
    bad_values = [X[0], X[None], X[:, :0], X[:, :, :0], X.astype(np.int32)]
    for v in bad_values:
        expected = _outcome(lambda v=v: kq.pack_kv(v, kind="key"))
        got = _outcome(lambda v=v: tapi.pack_kv(numpy_to_torch(v), kind="key"))
        assert expected is not None and got == expected, (v.shape, v.dtype, got, expected)
    # dtypes numpy cannot hold (JAX never sees them) still get a TypeError naming values.dtype
    for td in (torch.float64, torch.int64, torch.complex64, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match=r"values\.dtype must have dtype in"):
            tapi.pack_kv(torch.zeros(2, 1, 4, dtype=td), kind="key")
    with pytest.raises(TypeError, match=r"values must be a torch\.Tensor"):
        tapi.pack_kv(X, kind="key")
    pt = tapi.pack_kv(numpy_to_torch(X), kind="key")
    pj = kq.pack_kv(X, kind="key")
    for dt in ("int8", np.float64, "nope"):
        assert _outcome(lambda dt=dt: tapi.unpack_kv(pt, dt)) == _outcome(
            lambda dt=dt: kq.unpack_kv(pj, dt)
        )
    with pytest.raises(TypeError, match="dtype must have dtype in"):
        tapi.unpack_kv(pt, torch.int32)
    with pytest.raises(TypeError, match="packed must be a PackedKV or WindowedKV"):
        tapi.unpack_kv(pj)


@pytest.mark.usefixtures("builtin_registries")
def test_residual_errors_match_jax():
    loops = make_chain(loops=2, t=12, d=8)
    prev = loops[0]
    p_ok = np.array([0, 3, 5], np.int32)
    cases = [
        (loops[1], prev.astype(np.float32), {}),
        (loops[1][:, :1], prev, {}),
        (loops[1][:5], prev, {}),
        (loops[1][:3], prev, {"positions": p_ok[None]}),
        (loops[1][:3], prev, {"positions": p_ok[:2]}),
        (np.concatenate([loops[1]] * 2), prev, {"positions": np.arange(24, dtype=np.int32)}),
        (loops[1], prev, {"window": 3}),
        (loops[1], prev, {"kind": "values"}),
        (loops[1], prev, {"format": "int3"}),
    ]
    for cur, pre, extra in cases:
        args = {"kind": "key", **extra}
        expected = _outcome(
            lambda cur=cur, pre=pre, args=args: kq.encode_residual(cur, pre, **args)
        )
        targs = {
            k: (numpy_to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in args.items()
        }
        got = _outcome(
            lambda cur=cur, pre=pre, targs=targs: tres.encode_residual(
                numpy_to_torch(cur), numpy_to_torch(pre), **targs
            )
        )
        assert expected is not None and got == expected, (extra, got, expected)
    with pytest.raises(TypeError, match="positions must have dtype int32, got int64"):
        tres.encode_residual(
            numpy_to_torch(loops[1][:3]),
            numpy_to_torch(prev),
            kind="key",
            positions=torch.tensor([0, 3, 5]),
        )
    res = tres.encode_residual(numpy_to_torch(loops[1]), numpy_to_torch(prev), kind="key")
    res_j = kq.encode_residual(loops[1], prev, kind="key")
    for bad_prev in (prev[:6], prev.astype(np.float16)):
        assert _outcome(
            lambda b=bad_prev: tres.decode_residual(res, numpy_to_torch(b))
        ) == _outcome(lambda b=bad_prev: kq.decode_residual(res_j, b))
    with pytest.raises(TypeError, match="residual must be a KVResidual"):
        tres.decode_residual(res_j, numpy_to_torch(prev))


def test_validate_positions_matches_jax():
    window = kq.Window(sink=2, recent=2)
    maps = [
        np.array([0, 1, 4, 8, 9], np.int32),
        np.array([0, 1, 4, 4, 9], np.int32),
        np.array([0, 1, 10], np.int32),
        np.array([-1, 1], np.int32),
        np.array([0, 1, 8], np.int32),
        np.zeros((2, 2), np.int32),
        np.array([0, 1, 8, 9], np.int64),
        np.array([], np.int32),
    ]
    for p in maps:
        for w in (None, window):
            expected = _outcome(lambda p=p, w=w: kq.validate_positions(p, 10, window=w))
            for given_ in (p, numpy_to_torch(p)):
                got = _outcome(lambda g=given_, w=w: tres.validate_positions(g, 10, window=w))
                assert got == expected, (p, w, got, expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_codec_layout_describes_the_real_arrays(fmt):
    """Each stack's layout (array_shapes, resolve, storage_bytes) describes the arrays its
    codec and the scalar oracle actually produce, and both stacks refuse the same arguments
    with the same message."""
    tc, jc = treg.get_codec(fmt), kq.get_codec(fmt)
    for shape in [(40, 2, 37), (1, 3, 1), (64, 2, 16)]:
        x = random_values(np.random.default_rng(0), shape, np.dtype(np.float32), "normal")
        for kind, axis in itertools.product(KINDS, (None, "tokens", "channels")):
            r_t = _outcome(lambda s=shape, k=kind, a=axis: tc.resolve(s, k, a, None))
            r_j = _outcome(lambda s=shape, k=kind, a=axis: jc.resolve(s, k, a, None))
            r_o = _outcome(lambda x=x, k=kind, a=axis: oracle.pack(x, format=fmt, kind=k, axis=a))
            assert r_t == r_j and (r_t is None) == (r_o is None)
            if r_t is not None:
                continue
            ax, g = tc.resolve(shape, kind, axis, None)
            want = oracle.pack(x, format=fmt, kind=kind, axis=axis).arrays
            for codec, packed in (
                (tc, tapi.pack_kv(numpy_to_torch(x), kind=kind, format=fmt, axis=axis)),
                (jc, kq.pack_kv(jnp.asarray(x), kind=kind, format=fmt, axis=axis)),
            ):
                real = {
                    n: (tuple(a.shape), np.dtype(_np_dtype(a))) for n, a in packed.arrays.items()
                }
                assert real == codec.array_shapes(shape, ax, g)
                assert real == {n: (a.shape, a.dtype) for n, a in want.items()}
                assert packed.storage_bytes == codec.storage_bytes(shape, ax, g)


def _np_dtype(a):
    return torch_to_numpy(a[:0] if a.ndim else a).dtype if isinstance(a, torch.Tensor) else a.dtype


@pytest.mark.parametrize("fmt", FORMATS)
def test_storage_bytes_are_real_bytes(fmt):
    shape = (40, 2, 37)
    x = random_values(np.random.default_rng(3), shape, F16, "normal")
    window = kq.Window(sink=3, recent=5)
    for kind in KINDS:
        p = tapi.pack_kv(numpy_to_torch(x), kind=kind, format=fmt)
        real = sum(a.untyped_storage().nbytes() for a in p.arrays.values())
        codec = treg.get_codec(fmt)
        assert p.storage_bytes == real == codec.storage_bytes(shape, p.axis, p.group_size)
        assert p.storage_bytes == kq.pack_kv(x, kind=kind, format=fmt).storage_bytes
        assert p.num_elements == x.size and p.batch_shape == ()
        assert p.bits_per_element == p.storage_bytes * 8 / x.size
        w = tapi.pack_kv(numpy_to_torch(x), kind=kind, format=fmt, window=window)
        real_w = real_bytes_of(w)
        assert w.storage_bytes == real_w
        assert w.storage_bytes == kq.pack_kv(x, kind=kind, format=fmt, window=window).storage_bytes
    empty = tapi.pack_kv(torch.zeros(0, 2, 8), kind="key", format=fmt)
    assert empty.num_elements == 0 and np.isnan(empty.bits_per_element)
    assert empty.storage_bytes == (4 if fmt == "nvfp4" else 0)


def real_bytes_of(tree) -> int:
    """Bytes of the distinct storages under a Torch container."""
    leaves = [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]
    storages = {
        leaf.untyped_storage().data_ptr(): leaf.untyped_storage().nbytes() for leaf in leaves
    }
    return sum(storages.values())


def test_residual_storage_bytes_are_real_bytes():
    loops = make_chain(t=48, seed=1)
    window = kq.Window(sink=4, recent=6)
    positions = sparse_maps(48, seed=1, window=window)
    code = tloops.encode_loops(
        numpy_to_torch(loops),
        kind="key",
        group_size=8,
        window=window,
        positions=_positions_on(positions, "cpu"),
    )
    assert code.storage_bytes == real_bytes_of(code)
    for r in code.residuals:
        assert r.storage_bytes == real_bytes_of(r)
        assert r.num_elements == 48 * 2 * 20 and r.format == "int4"
    code_j = kq.encode_loops(loops, kind="key", group_size=8, window=window, positions=positions)
    assert [r.storage_bytes for r in code.residuals] == [r.storage_bytes for r in code_j.residuals]


def test_pytree_registration():
    x = numpy_to_torch(X)
    window = kq.Window(sink=1, recent=2)
    trees = [tapi.pack_kv(x, kind="key", format=fmt) for fmt in FORMATS]
    trees.append(tapi.pack_kv(x, kind="value", format="nvfp4", window=window))
    trees.append(
        tloops.encode_loops(
            torch.stack([x, x * 2, x * 3]),
            kind="key",
            window=window,
            positions=[None, torch.tensor([0, 3, 7], dtype=torch.int32)],
        )
    )
    for tree in trees:
        leaves, spec_ = pytree.tree_flatten(tree)
        assert all(isinstance(leaf, torch.Tensor) for leaf in leaves)
        rebuilt = pytree.tree_unflatten(leaves, spec_)
        assert type(rebuilt) is type(tree)
        copied = pytree.tree_map(lambda t: t.clone(), tree)
        assert_trees_equal(copied, to_jax(tree), "tree_map copy")
        keyed, _ = pytree.tree_flatten_with_path(tree)
        assert len(keyed) == len(leaves)
    p = trees[0]
    leaves, _ = pytree.tree_flatten(p)
    assert len(leaves) == len(p.arrays)  # None fields are empty subtrees


def test_metadata_equals_jax_metadata():
    for dt in DTYPES:
        x = random_values(np.random.default_rng(0), (5, 1, 4), dt, "normal")
        pt = tapi.pack_kv(numpy_to_torch(x), kind="value", format="int4", group_size=2)
        pj = kq.pack_kv(x, kind="value", format="int4", group_size=2)
        for name in ("format", "kind", "axis", "group_size", "shape", "dtype"):
            assert getattr(pt, name) == getattr(pj, name)
            assert type(getattr(pt, name)) is type(getattr(pj, name)), name
        assert pt.torch_dtype == TORCH_OF[dt]
        assert hash(pt.dtype) == hash(pj.dtype)


@pytest.mark.usefixtures("builtin_registries")
def test_registry():
    class Twice(treg.CODECS["int4"].__class__):
        name = "int4_twice"

    codec = Twice()
    assert treg.register_codec(codec) is codec
    try:
        p = tapi.pack_kv(numpy_to_torch(X), kind="key", format="int4_twice")
        assert p.format == "int4_twice"
        assert_same_bytes(
            torch_to_numpy(tapi.unpack_kv(p)),
            torch_to_numpy(tapi.unpack_kv(tapi.pack_kv(numpy_to_torch(X), kind="key"))),
        )
        with pytest.raises(ValueError, match="already registered"):
            treg.register_codec(Twice())
        treg.register_codec(Twice(), replace=True)
    finally:
        treg.unregister_codec("int4_twice")
    assert "int4_twice" not in treg.CODECS and "int4_twice" not in kq.CODECS
    with pytest.raises(ValueError, match="format must be one of"):
        treg.get_codec("int4_twice")
    with pytest.raises(TypeError, match="codec must be a kvq_torch_bridge Codec"):
        treg.register_codec(kq.get_codec("int4"))
    with pytest.raises(TypeError, match=r"codec must be a kvq_jax\.Codec"):
        kq.register_codec(treg.get_codec("int4"))
    builtin = [*constants.FORMATS, *constants.ROTATED_FORMATS]
    assert list(treg.CODECS) == list(kq.CODECS) == builtin


def _run_everything(device):
    """pack / unpack of every format, windowed, and a sparse windowed residual chain."""
    x = numpy_to_torch(random_values(np.random.default_rng(5), (40, 2, 37), BF16, "heavy"), device)
    for fmt in FORMATS:
        for kind in KINDS:
            tapi.unpack_kv(tapi.pack_kv(x, kind=kind, format=fmt))
        tapi.unpack_kv(tapi.pack_kv(x, kind="key", format=fmt, window=W), torch.float32)
    window = kq.Window(sink=2, recent=3)
    loops = numpy_to_torch(make_chain(t=40, seed=2), device)
    positions = _positions_on(sparse_maps(40, seed=2, window=window), device)
    code = tloops.encode_loops(
        loops, kind="key", residual_format="nvfp4", positions=positions, window=window
    )
    tloops.decode_loops(code)
    tloops.decode_loop(code, loop=2)


def test_no_host_reads_on_the_hot_path(monkeypatch):
    """Nothing in pack/unpack/encode/decode turns tensor data into Python values (the CPU
    stand-in for a CUDA host-device sync)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of tensor data on the hot path")

    # reading values (item, bool(), ...) or shapes that depend on them (nonzero, unique)
    for name in (
        "item",
        "tolist",
        "numpy",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "nonzero",
        "unique",
        "masked_select",
    ):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    _run_everything("cpu")


@pytest.mark.gpu
def test_cuda_no_sync():
    """On CUDA, no call synchronizes with the host (torch's sync debug mode raises)."""
    _run_everything("cuda")  # warm up: first-use allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run_everything("cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------------------------------
# numerics and the torch dtype-conversion facts the codec relies on


def test_e2m1_tables_and_encoding():
    assert tuple(m for m, _ in constants.E2M1_MIDPOINTS) == E2M1_MIDPOINTS  # codec_cases copy
    codes = torch.arange(16, dtype=torch.uint8)
    assert_same_bytes(torch_to_numpy(tn.e2m1_decode(codes)), constants.E2M1_VALUES)
    # every E2M1 midpoint, its float32 neighbours and random values vs ml_dtypes' float4
    mids = np.array(E2M1_MIDPOINTS + E2M1_GRID, np.float32)
    ys = np.concatenate(
        [
            mids,
            np.nextafter(mids, 0),
            np.nextafter(mids, 7),
            np.random.default_rng(0).uniform(0, 6, 10000).astype(np.float32),
        ]
    )
    ys = np.clip(ys, 0, 6).astype(np.float32)
    ys = np.concatenate([ys, -ys])
    got = tn.e2m1_encode(torch.from_numpy(ys), torch.from_numpy(np.signbit(ys)))
    want = ys.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    assert_same_bytes(got.numpy(), want)


def test_flush_and_divide():
    x = np.array(
        [2.0**-126, -(2.0**-126), 2.0**-127, -(2.0**-149), 0.0, -0.0, np.inf, -np.inf, np.nan, 1.0],
        np.float32,
    )
    got = tn.flush_subnormal(torch.from_numpy(x)).numpy()
    assert_same_bytes(got[:8], ftz(x[:8]))
    assert np.isnan(got[8]) and got[9] == 1.0
    assert np.signbit(got[3]) and not np.signbit(got[2])
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(100000) * 10.0 ** rng.integers(-30, 30, 100000)).astype(np.float32)
    with np.errstate(over="ignore", under="ignore"):
        for num in (2688.0, 1.0, np.float32(15.0)):
            assert_same_bytes(tn.divide(num, torch.from_numpy(a)).numpy(), np.float32(num) / a)
            assert_same_bytes(tn.divide(torch.from_numpy(a), num).numpy(), a / np.float32(num))
    # the trap `divide` avoids: torch computes `scalar / tensor` as reciprocal * scalar
    with np.errstate(over="ignore", under="ignore"):
        assert not np.array_equal((2688.0 / torch.from_numpy(a)).numpy(), np.float32(2688) / a)


def test_torch_conversion_facts():
    """The torch behaviours FORMAT.md section 0 needs (RNE casts, half-even round) and the
    ones the codec works around (saturating fp8 casts, wrapping integer casts)."""
    half = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 4.5, 2.0**23 + 1], np.float32)
    assert_same_bytes(torch.round(torch.from_numpy(half)).numpy(), np.round(half))
    # float32 -> float8_e4m3fn / float16 / bfloat16: every midpoint and neighbours vs ml_dtypes
    # (the exhaustive version over every float32 is test_exhaustive_casts, --run-slow)
    m = np.concatenate([E4M3_MIDPOINTS, E4M3_VALUES]).astype(np.float32)
    m = np.concatenate([m, np.nextafter(m, 0), np.nextafter(m, np.float32(449))])
    m = np.concatenate([m, -m])
    m = m[np.abs(m) <= 448]
    got = torch.from_numpy(m).to(torch.float8_e4m3fn)
    assert_same_bytes(torch_to_numpy(got), m.astype(E4M3))
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32)
    f = bits.view(np.float32)
    f = f[~np.isnan(f)]
    mid = (np.arange(0, 2**16, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    f = np.concatenate([f, mid[~np.isnan(mid)]])
    with np.errstate(over="ignore"):
        for td, nd in ((torch.float16, F16), (torch.bfloat16, BF16)):
            assert_same_bytes(torch_to_numpy(torch.from_numpy(f).to(td)), f.astype(nd))
    big = torch.tensor([449.0, 1e4, np.inf, -np.inf])
    assert torch_to_numpy(big.to(torch.float8_e4m3fn)).view(np.uint8).tolist() == [
        0x7E,
        0x7E,
        0x7E,
        0xFE,
    ]  # saturates (ml_dtypes / XLA give NaN): clamp first
    assert torch.tensor([300.0, -1.0]).to(torch.uint8).tolist() == [44, 255]  # wraps


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_compile_same_bytes(fmt, device):
    """pack + unpack under torch.compile (inductor) give the eager bytes on edge cases and
    random data, both layouts (partial groups on both axes)."""
    from torch._dynamo.utils import counters

    rng = np.random.default_rng(seed("compile", fmt))
    g = G4 if fmt == "int4" else None
    for kind in KINDS:
        xs = [
            build(dtypes[i % len(dtypes)], AXIS_OF[kind], shape=SHAPE)[0]
            for i, (build, dtypes) in enumerate(EDGE_CASES[fmt].values())
        ]
        xs += [random_values(rng, SHAPE, BF16, dist) for dist in DISTS]

        def run(x, kind=kind):
            p = tapi.pack_kv(x, kind=kind, format=fmt, **_kwargs(g))
            return p, tapi.unpack_kv(p, torch.float32)

        torch._dynamo.reset()
        compiled = torch.compile(run)
        # one recompile per input dtype: stay below the limit, never fall back to eager
        with torch._dynamo.config.patch(recompile_limit=64):
            results = [(run(xt), compiled(xt)) for xt in (numpy_to_torch(x, device) for x in xs)]
        for i, ((p, u), (pc, uc)) in enumerate(results):
            what = f"{fmt} {kind} #{i}"
            assert_torch_arrays(pc, {k: torch_to_numpy(a) for k, a in p.arrays.items()}, what)
            assert_same_values(torch_to_numpy(uc), torch_to_numpy(u), what)
        assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"


@pytest.mark.slow
@pytest.mark.parametrize("target", ["e4m3", "bf16", "f16"])
def test_exhaustive_casts(target):
    """Every float32 (|x| <= 448 for E4M3) cast by torch equals ml_dtypes / numpy (RNE)."""
    td, nd = {
        "e4m3": (torch.float8_e4m3fn, E4M3),
        "bf16": (torch.bfloat16, BF16),
        "f16": (torch.float16, F16),
    }[target]
    hi = int(np.float32(448).view(np.uint32)) + 1 if target == "e4m3" else 0x7F800001
    chunk = 1 << 24
    for start in range(0, hi, chunk):
        b = np.arange(start, min(start + chunk, hi), dtype=np.uint32)
        for sign in (0, 0x80000000):
            f = (b | np.uint32(sign)).view(np.float32)
            got = torch_to_numpy(torch.from_numpy(f).to(td))
            with np.errstate(over="ignore"):
                want = f.astype(nd)
            assert np.array_equal(
                got.view(np.uint8 if nd.itemsize == 1 else np.uint16),
                want.view(np.uint8 if nd.itemsize == 1 else np.uint16),
            ), start
