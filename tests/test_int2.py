"""INT2 (FlashLoop's 2-bit affine stream, docs/FORMAT.md section 2a) on every stack.

The scalar oracle is checked against hand-worked bytes and an independent numpy float32
re-derivation; the jitted (and eager, and vmapped) JAX codec and the Torch codec against the
oracle, byte for byte; per-loop residual formats (FlashLoop's profiles) against the oracle's
residual chain; the kernels serve INT2 (page packing, in interpret mode, equal to the
oracle); bad arguments raise naming the argument. Planted defects (strict xfails) show that
the checks can fail.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_packed_equal, assert_same_bytes, assert_same_values, numpy_to_torch

import kvq_jax as kq
from kvq_jax import oracle
from kvq_jax.codecs.formats import int2 as jint2
from kvq_jax.conformance import check_pack, load_vectors
from kvq_jax.core import registry
from kvq_jax.core.policies import POLICIES, Policy
from kvq_jax.oracle import residual as ores

torch = pytest.importorskip("torch")
import kvq_torch_bridge as kt  # noqa: E402
from kvq_torch_bridge.codecs import registry as treg  # noqa: E402
from kvq_torch_bridge.codecs._dtypes import to_numpy  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = (BF16, F16, F32)


def _kv(rng, shape, dtype, scale=2.0):
    """Random K/V-like values [..., T, H, D]: a per-(head, channel) offset plus noise."""
    x = rng.standard_normal(shape) + scale * rng.standard_normal((1, *shape[-2:]))
    return x.astype(np.float32).astype(dtype)


# ------------------------------------------------------------------------------------------
# the oracle


def test_oracle_hand_worked_bytes_and_bit_order():
    # one value group of 9 channels: min 0, max 3, so scale = 3 / 3 = 1 and q = x exactly.
    x = np.array([0, 3, 1.5, 0.5, 2.5, 1, 2, 0.25, 2.9], np.float32).reshape(1, 1, 9)
    enc = oracle.pack(x, format="int2", kind="value")
    # codes 0 3 2 0 | 2 1 2 0 | 3 (ties 1.5 -> 2, 0.5 -> 0, 2.5 -> 2: half to even);
    # channel 4j + i in bits 2i..2i+1: 0 | 3<<2 | 2<<4 = 44; 2 | 1<<2 | 2<<4 = 38; 3.
    assert enc.arrays["codes"].tolist() == [[[44, 38, 3]]]
    assert enc.arrays["minimum"].tolist() == [[[0.0]]]
    assert enc.arrays["scale"].tolist() == [[[1.0]]]
    assert oracle.unpack(enc).ravel().tolist() == [0, 3, 2, 0, 2, 1, 2, 0, 3]
    # span 1: the code uses float32 1/3, decode the float16 rounding of it
    y = np.array([[-0.5], [0.5], [0.0], [1 / 6]], np.float32).reshape(4, 1, 1)
    enc = oracle.pack(y, format="int2", kind="key")
    assert enc.arrays["scale"].item() == np.float16(np.float32(1) / np.float32(3))
    assert enc.arrays["minimum"].item() == np.float16(-0.5)
    # q = (x + 0.5) / f32(1/3): 0, 3, 1.5 -> 2, 2 (0.6667 / 0.3333 = 2.0000...)
    assert enc.arrays["codes"].ravel().tolist() == [0, 3, 2, 2]


def _numpy_int2(x, kind, group_size, axis):
    """An independent vectorized float32 re-derivation (normal, finite data only)."""
    x = x.astype(np.float32)
    t, h, d = x.shape
    g = group_size
    if axis == "tokens":
        starts = range(0, t, g)
        parts = [x[s : s + g] for s in starts]
        red = 0
    else:
        starts = range(0, d, g)
        parts = [x[..., s : s + g] for s in starts]
        red = 2
    codes, mins, scales = [], [], []
    for p in parts:
        mn = p.min(axis=red, keepdims=True)
        mn = np.where(mn == 0, np.float32(0), mn)
        span = p.max(axis=red, keepdims=True) - mn
        scale = np.where(span > 0, span / np.float32(3), np.float32(1)).astype(np.float32)
        q = np.rint((p - mn) / scale)  # numpy float32 division is IEEE; rint ties to even
        codes.append(np.clip(q, 0, 3).astype(np.uint8))
        mins.append(mn.astype(np.float16))
        scales.append(scale.astype(np.float16))
    codes = np.concatenate(codes, axis=red)
    mins, scales = np.concatenate(mins, axis=red), np.concatenate(scales, axis=red)
    pad = np.zeros((t, h, -d % 4), np.uint8)
    quads = np.concatenate([codes, pad], axis=2).reshape(t, h, -1, 4)
    packed = quads[..., 0] | quads[..., 1] << 2 | quads[..., 2] << 4 | quads[..., 3] << 6
    rep = lambda m: np.repeat(m, g, axis=red)[:t] if red == 0 else np.repeat(m, g, axis=2)[..., :d]  # noqa: E731
    decoded = codes.astype(np.float32) * rep(scales).astype(np.float32) + rep(mins).astype(
        np.float32
    )
    return {"codes": packed, "minimum": mins, "scale": scales}, decoded


@pytest.mark.parametrize(
    "shape, kind, g, axis",
    [
        ((37, 3, 22), "key", 16, "tokens"),
        ((37, 3, 22), "value", 8, "channels"),
        ((70, 2, 64), "key", 64, "tokens"),
        ((9, 2, 13), "value", 64, "channels"),
        ((20, 1, 7), "key", 3, "channels"),
    ],
)
def test_oracle_equals_a_numpy_rederivation(shape, kind, g, axis):
    rng = np.random.default_rng(hash((shape, g)) % 2**32)
    x = _kv(rng, shape, F32)
    x.reshape(-1)[::17] = np.round(x.reshape(-1)[::17] * 2) / 2  # some exact halves
    enc = oracle.pack(x, format="int2", kind=kind, group_size=g, axis=axis)
    arrays, decoded = _numpy_int2(x, kind, g, axis)
    assert not oracle.mismatches(enc.arrays, arrays)
    assert not oracle.mismatches(oracle.unpack(enc), decoded)


def test_oracle_rejects_a_nonzero_padding_code():
    x = np.ones((2, 1, 5), np.float32)
    enc = oracle.pack(x, format="int2", kind="value")
    codes = enc.arrays["codes"].copy()
    codes[0, 0, 1] |= 0b100  # channel 5: past D
    bad = dataclasses.replace(enc, arrays={**enc.arrays, "codes": codes})
    with pytest.raises(ValueError, match="padding code"):
        oracle.unpack(bad)


# ------------------------------------------------------------------------------------------
# JAX (jit, eager, vmap) and Torch against the oracle

GRID = [
    ((37, 3, 22), "key", 16, None),
    ((37, 3, 22), "value", 8, None),
    ((19, 2, 7), "key", 64, None),
    ((19, 2, 5), "value", 3, None),
    ((6, 1, 1), "key", 4, None),
    ((70, 2, 24), "key", 8, "channels"),
    ((70, 2, 24), "value", 32, "tokens"),
    ((0, 2, 8), "value", 64, None),
]


def _edge_tensor(dtype) -> np.ndarray:
    """[24, 2, 12] float32 cast to `dtype`: key token groups of 4 hold ties, signed zeros, a
    NaN, an inf, float16-overflowing spans, flushed tiny values and a zero span."""
    x = np.zeros((24, 2, 12), np.float32)
    ties = np.array([0.0, 3.0, 0.5, 1.5], np.float32)
    x[0:4, 0, :] = ties[:, None] * np.float32(0.5) ** np.arange(12, dtype=np.float32)
    x[0:4, 1, :] = np.array([0.0, 3.0, 2.5, 1.5], np.float32)[:, None]
    x[4:8, :, ::2] = -0.0
    x[8:12] = np.random.default_rng(3).standard_normal((4, 2, 12))
    x[9, 0, 3] = np.nan
    x[10, 1, 7] = np.inf
    x[12:16, 0] = np.array([-1.2e5, 1.2e5, 1.0, 2.0], np.float32)[:, None]  # span / 3 > 65504
    x[12:16, 1] = np.array([1e-39, -3e-39, 2.0**-126, 0.0], np.float32)[:, None]
    x[16:20] = 1.25  # zero span
    x[20:24] = np.random.default_rng(4).standard_normal((4, 2, 12)) * 1e3
    with np.errstate(over="ignore"):  # +-1.2e5 overflows float16 (then a NaN group)
        return x.astype(dtype)


def _check_jax(x, kind, g, axis, *, eager=False):
    expected = oracle.pack(x, format="int2", kind=kind, group_size=g, axis=axis)
    if eager:
        with jax.disable_jit():
            packed = kq.pack_kv(jnp.asarray(x), kind=kind, format="int2", group_size=g, axis=axis)
            decoded = [kq.unpack_kv(packed, dtype=dt) for dt in DTYPES]
    else:
        packed = kq.pack_kv(x, kind=kind, format="int2", group_size=g, axis=axis)
        decoded = [kq.unpack_kv(packed, dtype=dt) for dt in DTYPES]
    assert (packed.format, packed.axis, packed.group_size) == ("int2", expected.axis, g)
    assert_packed_equal(packed, expected.arrays, f"int2 {kind} {x.shape}")
    for dt, got in zip(DTYPES, decoded, strict=True):
        assert_same_values(got, oracle.unpack(expected, dt), f"decoded as {dt}")
    return expected


def _check_torch(x, kind, g, axis):
    expected = oracle.pack(x, format="int2", kind=kind, group_size=g, axis=axis)
    packed = kt.pack_kv(numpy_to_torch(x), kind=kind, format="int2", group_size=g, axis=axis)
    assert (packed.format, packed.axis, packed.group_size) == ("int2", expected.axis, g)
    for name, array in expected.arrays.items():
        assert_same_bytes(to_numpy(getattr(packed, name)), array, f"torch {name}")
    for dt in DTYPES:
        got = to_numpy(kt.unpack_kv(packed, dtype=dt))
        assert_same_values(got, oracle.unpack(expected, dt), f"torch decoded as {dt}")


@pytest.mark.thin(2)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, kind, g, axis", GRID, ids=str)
def test_jax_and_torch_equal_the_oracle(shape, kind, g, axis, dtype):
    x = _kv(np.random.default_rng(sum(shape) + g), shape, dtype)
    _check_jax(x, kind, g, axis)
    _check_torch(x, kind, g, axis)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["key", "value"])
def test_edge_cases_on_every_stack(kind, dtype):
    x = _edge_tensor(dtype)
    expected = _check_jax(x, kind, 4, None)
    _check_jax(x, kind, 4, None, eager=True)
    _check_torch(x, kind, 4, None)
    if kind == "key" and dtype == F32:  # the cases really are where they should be
        scale = expected.arrays["scale"].astype(np.float32)
        assert np.isnan(scale[2, 0, 3]) and np.isnan(scale[2, 1, 7])  # the NaN / inf groups
        assert np.isinf(scale[3, 0]).all()  # span 2.4e5 / 3 overflows float16
        assert (scale[4] == 1.0).all()  # zero span
        # head 1: every channel 0, 3, 2.5 -> 2, 1.5 -> 2; four codes per byte
        assert expected.arrays["codes"][0:4, 1].ravel().tolist() == [0] * 3 + [255] * 3 + [170] * 6


def test_vmap_equals_one_at_a_time():
    rng = np.random.default_rng(5)
    xs = _kv(rng, (3, 40, 2, 18), BF16)
    batched = jax.vmap(lambda x: kq.pack_kv(x, kind="key", format="int2", group_size=16))(xs)
    for i in range(3):
        expected = oracle.pack(xs[i], format="int2", kind="key", group_size=16)
        one = jax.tree.map(lambda a, i=i: a[i], batched)
        assert_packed_equal(one, expected.arrays, f"vmap {i}")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="planted defect: bit order")
def test_planted_defect_bit_order_is_caught():
    x = _kv(np.random.default_rng(6), (16, 2, 8), F32)
    expected = oracle.pack(x, format="int2", kind="key", group_size=16)
    codes = jint2.unpack_2bit(kq.pack_kv(x, kind="key", format="int2", group_size=16).codes, 8)
    q = codes.reshape(16, 2, 2, 4)
    reversed_order = q[..., 3] | q[..., 2] << 2 | q[..., 1] << 4 | q[..., 0] << 6  # MSB first
    assert_same_bytes(reversed_order, expected.arrays["codes"], "codes")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="planted defect: 4 levels")
def test_planted_defect_scale_span_over_4_is_caught():
    x = _kv(np.random.default_rng(7), (16, 2, 8), F32)
    expected = oracle.pack(x, format="int2", kind="value", group_size=8)
    xg = jnp.asarray(x).reshape(16, 2, 1, 8)
    # the wrong divisor (2**2 instead of 2**2 - 1 levels)
    mn, mx = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
    scale = ((mx - mn) / 4).astype(jnp.float16)
    assert_same_bytes(np.asarray(scale[..., 0]), expected.arrays["scale"], "scale")


# ------------------------------------------------------------------------------------------
# conformance vectors, registries, layout, errors


def test_conformance_vectors_cover_int2_and_catch_a_wrong_code():
    cases = [c for c in load_vectors() if c.format == "int2"]
    assert len(cases) >= 40
    assert {c.axis for c in cases} == {"tokens", "channels"}
    assert {c.values.shape[2] % 4 for c in cases} == {0, 1, 2, 3}
    ties = next(c for c in cases if c.name == "ties/int2").values.astype(np.float64)
    q = (ties - ties.min(axis=0)) / ((ties.max(axis=0) - ties.min(axis=0)) / 3)
    assert np.sum(q % 1 == 0.5) >= 9
    for stack, pack, unpack, kind in (
        ("jax", kq.pack_kv, kq.unpack_kv, "jax"),
        ("torch", kt.pack_kv, kt.unpack_kv, "torch"),
    ):
        results = check_pack(pack, unpack_fn=unpack, input_kind=kind, cases=cases)
        assert all(r.passed for r in results), (stack, [r.detail for r in results if not r.passed])

    def wrong_top_code(values, **kwargs):
        packed = kq.pack_kv(values, **kwargs)
        if packed.codes.size == 0:
            return packed
        codes = packed.codes.at[(0,) * packed.codes.ndim].add(64)  # channel 3 of byte 0
        return dataclasses.replace(packed, codes=codes)

    failed = {r.name for r in check_pack(wrong_top_code, cases=cases) if not r.passed}
    assert failed == {c.name for c in cases if c.values.size}


def test_registries_and_layout():
    assert "int2" in kq.CODECS and "int2" in treg.CODECS and "int2" in registry.known_formats()
    layout = registry.layout("int2")
    assert layout.default_group_size == 64 and not layout.fixed_group_size
    assert layout.array_shapes((64, 2, 64), "tokens", 64) == {
        "codes": ((64, 2, 16), np.dtype(np.uint8)),
        "minimum": ((1, 2, 64), F16),
        "scale": ((1, 2, 64), F16),
    }
    x = np.zeros((64, 2, 64), BF16)
    for pack in (kq.pack_kv, lambda v, **kw: kt.pack_kv(numpy_to_torch(v), **kw)):
        for kind in ("key", "value"):
            packed = pack(x, kind=kind, format="int2")
            assert packed.group_size == 64 and packed.bits_per_element == 2.5
            assert packed.storage_bytes == layout.storage_bytes((64, 2, 64), packed.axis, 64)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(group_size=0), ValueError, "group_size"),
        (dict(group_size=2.5), TypeError, "group_size"),
        (dict(group_size=True), TypeError, "group_size"),
        (dict(kind="query"), ValueError, "kind"),
        (dict(axis="heads"), ValueError, "axis"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    x = np.ones((8, 2, 8), np.float32)
    args = {"kind": "key", "format": "int2", **kwargs}
    with pytest.raises(error, match=match) as jax_error:
        kq.pack_kv(x, **args)
    with pytest.raises(error, match=match) as torch_error:
        kt.pack_kv(numpy_to_torch(x), **args)
    assert str(jax_error.value) == str(torch_error.value)
    if "group_size" in kwargs or "kind" in kwargs or "axis" in kwargs:
        with pytest.raises((ValueError, TypeError), match=match):
            oracle.pack(x, **args)
    with pytest.raises(TypeError, match="values"):
        kq.pack_kv(x.astype(np.int32), kind="key", format="int2")


# ------------------------------------------------------------------------------------------
# per-loop formats in residual chains (FlashLoop's profiles)

#: flashloop_torch.kv_quantization.CODEC_PROFILES (bits per loop, 4 loops, groups of 64).
FLASHLOOP_PROFILES = {
    "flashloop-legacy": {"key": (2, 2, 2, 2), "value": (4, 4, 2, 2)},
    "flashloop-kivi": {"key": (2, 2, 2, 2), "value": (2, 2, 2, 2)},
}


@pytest.mark.parametrize("name", FLASHLOOP_PROFILES)
def test_flashloop_profiles_as_policies(name):
    bits = {2: "int2", 4: "int4"}
    for window in ("", "+win"):
        policy = POLICIES[name + window]
        for kind, per_loop in FLASHLOOP_PROFILES[name].items():
            assert policy.loop_formats(kind, 4) == tuple(bits[b] for b in per_loop)
            assert policy.loop_formats(kind, 2) == tuple(bits[b] for b in per_loop[:2])
            assert all(policy.stream(kind, loop)[1] in (64, None) for loop in range(4))
    # 3.0 bits/element for legacy (FlashLoop's figure), 2.5 for kivi, on complete groups
    rng = np.random.default_rng(8)
    x = _kv(rng, (4, 128, 2, 64), BF16)
    policy = POLICIES[name]
    nbytes = sum(
        kq.encode_loops(x, **policy.loop_kwargs(kind, 4)).storage_bytes for kind in ("key", "value")
    )
    assert 8 * nbytes / (2 * x.size) == {"flashloop-legacy": 3.0, "flashloop-kivi": 2.5}[name]


def test_policy_argument_errors():
    legacy = POLICIES["flashloop-legacy"]
    with pytest.raises(ValueError, match="num_loops"):
        legacy.loop_kwargs("value")
    assert legacy.loop_kwargs("key")["residual_format"] == "int2"
    with pytest.raises(ValueError, match="kind"):
        legacy.formats("query")
    short = Policy("p", "int4", ("int2",))
    assert short.loop_formats("key", 4) == ("int4", "int2", "int2", "int2")


CHAINS = [
    # (kind, base, residual formats, group_size, window, sparse)
    ("value", "int4", ("int4", "int2", "int2"), 64, None, False),
    ("key", "int2", ("int2", "int2", "int2"), 16, None, False),
    ("value", "int2", ("nvfp4", "int2", "int4"), 8, kq.Window(sink=2, recent=3), False),
    ("key", "int4", ("int2", "fp8_e4m3", "int2"), 4, kq.Window(sink=1, recent=2), True),
]


@pytest.mark.parametrize("kind, base, residual, g, window, sparse", CHAINS, ids=str)
def test_per_loop_chains_equal_the_oracle(kind, base, residual, g, window, sparse):
    rng = np.random.default_rng(9)
    x = np.cumsum(rng.standard_normal((4, 24, 2, 10)), axis=0).astype(BF16)
    positions = None
    if sparse:
        positions = [np.arange(24, dtype=np.int32), np.array([0, 3, 5, 8, 21, 22, 23], np.int32),
                     None]  # fmt: skip
    args = dict(kind=kind, base_format=base, residual_format=residual, group_size=g,
                window=window, positions=positions)  # fmt: skip
    o_base, o_res = ores.encode_loops(x, **args)
    want = ores.decode_loops(o_base, o_res, window)
    code = kq.encode_loops(x, **{**args, "residual_format": list(residual)})
    assert [r.payload.format for r in code.residuals] == list(residual)
    for got, exp in zip(code.residuals, o_res, strict=True):
        assert_packed_equal(got.payload, exp.payload.arrays, "residual payload")
    assert_same_values(kq.decode_loops(code), want, "JAX decode_loops")
    t_pos = None if positions is None else [None if p is None else torch.from_numpy(p)
                                            for p in positions]  # fmt: skip
    t_code = kt.encode_loops(numpy_to_torch(x), **{**args, "positions": t_pos})
    assert_same_values(to_numpy(kt.decode_loops(t_code)), want, "Torch decode_loops")
    for loop in range(4):
        assert_same_values(kq.decode_loop(code, loop=loop), want[loop], f"decode_loop {loop}")


def test_residual_format_errors_name_the_argument():
    x = np.zeros((4, 8, 1, 8), np.float32)
    for encode, xx in ((kq.encode_loops, x), (kt.encode_loops, numpy_to_torch(x))):
        with pytest.raises(ValueError, match="residual_format must name one format per later"):
            encode(xx, kind="key", residual_format=("int2", "int4"))
        with pytest.raises(ValueError, match="format must be one of"):
            encode(xx, kind="key", residual_format=("int2", "int3", "int2"))
        with pytest.raises(TypeError, match="residual_format"):
            encode(xx, kind="key", residual_format=5)


# ------------------------------------------------------------------------------------------
# page packing, page reconstruction and decode attention serve INT2 (tests/kernels)


def test_kernels_serve_int2():
    from kvq_jax.cache.paged_cache import PagedCacheConfig, init_cache
    from kvq_jax.kernels import page_pack, page_reconstruct, paged_attention

    support = functools.partial(page_pack.config_support, dtype=jnp.bfloat16, kind="key",
                                format="int2")  # fmt: skip
    assert support((4, 16, 2, 64)) is None
    assert "not a power of two >= 4" in support((4, 16, 2, 2))  # four codes per byte
    config = PagedCacheConfig(num_pages=4, page_size=16, num_heads=2, head_dim=64,
                              dtype="bfloat16", num_loops=2, k_base_format="int2",
                              k_residual_format="int2", v_residual_format="int2")  # fmt: skip
    assert page_reconstruct.config_support(config, "key") is None
    assert page_reconstruct.config_support(config, "value") is None
    q = np.zeros((1, 2, 64), np.float32)
    for loop in range(2):
        assert paged_attention.config_support(q, init_cache(config), None, loop=loop) is None
    pages = _kv(np.random.default_rng(10), (3 * 16, 2, 64), BF16).reshape(3, 16, 2, 64)
    for backend in ("xla", "pallas_interpret"):
        packed = kq.pack_paged(pages, kind="key", format="int2", backend=backend)
        for p in range(3):
            expected = oracle.pack(pages[p], format="int2", kind="key", group_size=16)
            got = jax.tree.map(lambda a, p=p: a[p], packed)
            assert_packed_equal(got, expected.arrays, f"{backend} page {p}")


def test_engine_cache_config_for_flashloop_profiles():
    from kvq_jax.engine.engine import cache_config_for

    shape = dict(num_pages=8, page_size=64, num_heads=2, head_dim=64, dtype="bfloat16",
                 max_seqs=1)  # fmt: skip
    kivi = cache_config_for(POLICIES["flashloop-kivi+win"], num_loops=4, **shape)
    assert kivi.formats == ("int2",) and kivi.sink == 4
    legacy = cache_config_for(POLICIES["flashloop-legacy"], num_loops=2, **shape)
    assert (legacy.k_base_format, legacy.v_base_format, legacy.v_residual_format) == (
        "int2", "int4", "int4")  # fmt: skip
    # At 4 loops the values' later loops differ (INT4 then INT2): the cache keeps one plane per
    # run of later loops of one format, each loop in the policy's own format.
    legacy4 = cache_config_for(POLICIES["flashloop-legacy"], num_loops=4, **shape)
    assert legacy4.v_residual_format == ("int4", "int2", "int2")
    assert legacy4.k_residual_format == "int2"
    assert [legacy4.loop_format("value", loop) for loop in range(4)] == [
        "int4", "int4", "int2", "int2"]  # fmt: skip
    assert legacy4.delta_runs("value") == ((1,), (2, 3)) and legacy4.per_loop("value")


def test_model_eval_coder_follows_the_per_loop_formats():
    from kvq_torch_bridge.model_eval.codecs import TorchLoopCoder

    policy = POLICIES["flashloop-legacy+win"]
    x = numpy_to_torch(np.cumsum(np.random.default_rng(11).standard_normal((4, 70, 2, 16)),
                                 axis=0).astype(BF16))  # fmt: skip
    coder = TorchLoopCoder()
    for kind in ("key", "value"):
        want = kt.decode_loops(kt.encode_loops(x, **policy.loop_kwargs(kind, 4)))
        recon = coder.base(x[0], policy, kind)
        assert torch.equal(recon.view(torch.int16), want[0].view(torch.int16))
        for loop in range(1, 4):
            recon = coder.residual(x[loop], recon, policy, kind, loop)
            assert torch.equal(recon.view(torch.int16), want[loop].view(torch.int16)), loop
