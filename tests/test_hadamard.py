"""HINT4 / HINT2 (INT4 / INT2 of Hadamard-rotated rows, docs/FORMAT.md section 2c) on every
stack.

The oracle's rotation is checked against hand-worked values and an independent numpy Hadamard
matrix (float64, on data where every butterfly sum is exact), its payload against the INT4 /
INT2 oracle of those rotated rows; the jitted, eager and vmapped JAX codec and the Torch codec
against the oracle byte for byte (special values included); residual chains against the
oracle's; the kernels take HINT values (decode attention in the rotated space, page
reconstruction and packing rotating in the tile) and decode attention declines HINT keys with
a reason; bad arguments raise naming the argument. The rotation earns its
place: on rows with outlier channels it lowers INT4's error.
Planted defects (strict xfails) show the checks can fail.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_packed_equal, assert_same_bytes, assert_same_values, numpy_to_torch

import kvq_jax as kq
from kvq_jax import oracle
from kvq_jax.codecs.formats import hadamard as jhad
from kvq_jax.conformance import check_pack, load_vectors
from kvq_jax.core import registry
from kvq_jax.oracle import hadamard as ohad
from kvq_jax.oracle import residual as ores

torch = pytest.importorskip("torch")
import kvq_torch_bridge as kt  # noqa: E402
from kvq_torch_bridge.codecs import registry as treg  # noqa: E402
from kvq_torch_bridge.codecs._dtypes import to_numpy  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = (BF16, F16, F32)
FORMATS = ("hint4", "hint2")
BASE = {"hint4": "int4", "hint2": "int2"}


def _hadamard(d: int) -> np.ndarray:
    """The Sylvester-Hadamard matrix of order d (float64), built by Kronecker products."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


def _kv(rng, shape, dtype, outliers: int = 2):
    """K/V-like rows [..., T, H, D]: noise with a per-(head, channel) offset and a few outlier
    channels (x 8), as real value caches have."""
    d = shape[-1]
    gain = np.ones(d)
    gain[rng.choice(d, size=min(outliers, d), replace=False)] = 8.0
    x = (rng.standard_normal(shape) + rng.standard_normal((1, *shape[-2:]))) * gain
    return x.astype(np.float32).astype(dtype)


# ------------------------------------------------------------------------------------------
# the oracle


def test_oracle_rotation_hand_worked():
    # D = 4: stage 1 pairs (0, 1), (2, 3); stage 2 pairs (0, 2), (1, 3); then x 2^-1.
    # [1, 2, 3, 4] -> [3, -1, 7, -1] -> [10, -2, -4, 0] -> [5, -1, -2, 0]
    assert ohad.rotate([1.0, 2.0, 3.0, 4.0], (1, 1, 4)) == [5.0, -1.0, -2.0, 0.0]
    assert ohad.unrotate([5.0, -1.0, -2.0, 0.0], (1, 1, 4)) == [1.0, 2.0, 3.0, 4.0]
    # D = 8 scales by 2^-1 forward and 2^-2 back (n = 3); D = 1 is the identity.
    assert ohad.rotate([1.0] * 8, (1, 1, 8)) == [4.0] + [0.0] * 7
    assert ohad.unrotate([4.0] + [0.0] * 7, (1, 1, 8)) == [1.0] * 8
    assert ohad.rotate([-3.5], (1, 1, 1)) == [-3.5]


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128])
def test_oracle_rotation_equals_a_hadamard_matrix(d):
    """On small integers every butterfly sum is exact in float32, so R(x) equals the float64
    matrix product H x * 2^-floor(n/2), and Rinv undoes it exactly."""
    rng = np.random.default_rng(d)
    rows = rng.integers(-100, 100, size=(3, d)).astype(np.float64)
    n = d.bit_length() - 1
    want = rows @ _hadamard(d).T * 2.0 ** -(n // 2)
    got = ohad.rotate(rows.reshape(-1).tolist(), (3, 1, d))
    assert got == want.reshape(-1).tolist()
    assert ohad.unrotate(got, (3, 1, d)) == rows.reshape(-1).tolist()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "kind, g, axis", [("value", 64, None), ("key", 8, None), ("value", 4, "tokens")]
)
def test_oracle_payload_is_the_base_format_of_the_rotated_rows(fmt, kind, g, axis):
    """hint4 / hint2 store exactly what int4 / int2 store for the numpy-rotated tensor."""
    rng = np.random.default_rng(len(fmt) + g)
    x = rng.integers(-64, 64, size=(20, 2, 16)).astype(np.float32) / 8  # exact sums
    rotated = (x.astype(np.float64) @ _hadamard(16).T / 4).astype(np.float32)
    enc = oracle.pack(x, format=fmt, kind=kind, group_size=g, axis=axis)
    base = oracle.pack(rotated, format=BASE[fmt], kind=kind, group_size=g, axis=axis)
    assert not oracle.mismatches(base.arrays, enc.arrays)
    decoded = oracle.unpack(enc).astype(np.float64)
    want = oracle.unpack(base).astype(np.float64) @ _hadamard(16).T / 4
    np.testing.assert_allclose(decoded, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_rotation_lowers_int4_error_on_outlier_channels():
    """The reason the format exists: with a few large channels per row, INT4 groups over the
    channels waste their range; the rotated rows quantize with ~2x less error."""
    x = _kv(np.random.default_rng(0), (256, 4, 64), F32, outliers=3)
    err = {}
    for fmt in ("int4", "hint4"):
        enc = oracle.pack(x[:32], format=fmt, kind="value")
        err[fmt] = np.linalg.norm(oracle.unpack(enc) - x[:32]) / np.linalg.norm(x[:32])
    assert err["hint4"] < 0.7 * err["int4"], err


# ------------------------------------------------------------------------------------------
# JAX (jit, eager, vmap) and Torch against the oracle

GRID = [
    ((37, 3, 16), "key", 16, None),
    ((37, 3, 16), "value", 8, None),
    ((19, 2, 64), "value", 64, None),
    ((19, 2, 128), "value", 64, None),
    ((9, 2, 32), "key", 64, None),
    ((6, 1, 1), "key", 4, None),
    ((5, 2, 2), "value", 1, None),
    ((20, 2, 8), "key", 8, "channels"),
    ((20, 2, 8), "value", 3, "tokens"),
    ((0, 2, 8), "value", 64, None),
]


def _edge_tensor(dtype) -> np.ndarray:
    """[24, 2, 8] float32 cast to `dtype`: zero rows, signed zeros, a NaN, an inf, rows whose
    rotated span overflows float16, flushed tiny values, equal rows and a large-magnitude
    block."""
    x = np.zeros((24, 2, 8), np.float32)
    x[0:4, :, ::2] = -0.0
    x[4:8] = np.random.default_rng(3).standard_normal((4, 2, 8))
    x[5, 0, 3] = np.nan
    x[6, 1, 7] = np.inf
    x[8:12, 0] = np.array([-9e4, 9e4, 1.0, 2.0, 0, 0, 0, 0], np.float32)
    x[8:12, 1] = np.array([1e-39, -3e-39, 2.0**-126, 0.0, 1e-39, 0, 0, 0], np.float32)
    x[12:16] = 1.25
    x[16:20] = np.random.default_rng(4).standard_normal((4, 2, 8)) * 1e3
    x[20:24] = np.array([0.5, 0.5, -0.5, -0.5, 0.25, 0.25, -0.25, -0.25], np.float32)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def _check_jax(x, fmt, kind, g, axis, *, eager=False):
    expected = oracle.pack(x, format=fmt, kind=kind, group_size=g, axis=axis)

    def run():
        packed = kq.pack_kv(jnp.asarray(x), kind=kind, format=fmt, group_size=g, axis=axis)
        return packed, [kq.unpack_kv(packed, dtype=dt) for dt in DTYPES]

    if eager:
        with jax.disable_jit():
            packed, decoded = run()
    else:
        packed, decoded = run()
    assert (packed.format, packed.axis, packed.group_size) == (fmt, expected.axis, g)
    assert packed.dtype == x.dtype
    assert_packed_equal(packed, expected.arrays, f"{fmt} {kind} {x.shape}")
    for dt, got in zip(DTYPES, decoded, strict=True):
        assert_same_values(got, oracle.unpack(expected, dt), f"decoded as {dt}")
    return expected


def _check_torch(x, fmt, kind, g, axis):
    expected = oracle.pack(x, format=fmt, kind=kind, group_size=g, axis=axis)
    packed = kt.pack_kv(numpy_to_torch(x), kind=kind, format=fmt, group_size=g, axis=axis)
    assert (packed.format, packed.axis, packed.group_size) == (fmt, expected.axis, g)
    for name, array in expected.arrays.items():
        assert_same_bytes(to_numpy(getattr(packed, name)), array, f"torch {name}")
    for dt in DTYPES:
        got = to_numpy(kt.unpack_kv(packed, dtype=dt))
        assert_same_values(got, oracle.unpack(expected, dt), f"torch decoded as {dt}")


@pytest.mark.thin(3)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, kind, g, axis", GRID, ids=str)
def test_jax_and_torch_equal_the_oracle(shape, kind, g, axis, dtype, fmt):
    x = _kv(np.random.default_rng(sum(shape) + g), shape, dtype)
    _check_jax(x, fmt, kind, g, axis)
    _check_torch(x, fmt, kind, g, axis)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["key", "value"])
def test_edge_cases_on_every_stack(kind, dtype, fmt):
    x = _edge_tensor(dtype)
    expected = _check_jax(x, fmt, kind, 4, None)
    _check_jax(x, fmt, kind, 4, None, eager=True)
    _check_torch(x, fmt, kind, 4, None)
    if kind == "value" and dtype == F32:  # the cases really are where they should be
        scale = expected.arrays["scale"].astype(np.float32)
        assert np.isnan(scale[5, 0]).all() and np.isnan(scale[6, 1]).all()  # whole rows
        assert not np.isnan(scale[5, 1]).any() and not np.isnan(scale[6, 0]).any()
        decoded = oracle.unpack(expected)
        assert np.isnan(decoded[5, 0]).all() and np.isfinite(decoded[5, 1]).all()
        # equal rows rotate to one non-zero channel (the others code 0 exactly)
        np.testing.assert_allclose(decoded[12:16], 1.25, rtol=1e-3)


def test_vmap_equals_one_at_a_time():
    xs = _kv(np.random.default_rng(5), (3, 40, 2, 32), BF16)
    batched = jax.vmap(lambda x: kq.pack_kv(x, kind="value", format="hint4"))(xs)
    for i in range(3):
        expected = oracle.pack(xs[i], format="hint4", kind="value")
        one = jax.tree.map(lambda a, i=i: a[i], batched)
        assert_packed_equal(one, expected.arrays, f"vmap {i}")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="planted defect: b - a")
def test_planted_defect_butterfly_operand_order_is_caught():
    x = _kv(np.random.default_rng(6), (16, 2, 16), F32)
    expected = oracle.pack(x, format="hint4", kind="value", group_size=16)

    def swapped(y):  # (a + b, b - a): still a Hadamard-like transform, not the normative one
        d, h = y.shape[-1], 1
        while h < d:
            pairs = y.reshape(*y.shape[:-1], d // (2 * h), 2, h)
            a, b = pairs[..., 0, :], pairs[..., 1, :]
            y = jnp.stack([a + b, b - a], axis=-2).reshape(*y.shape)
            h *= 2
        return y * 0.25

    packed = kq.pack_kv(swapped(jnp.asarray(x)), kind="value", format="int4", group_size=16)
    assert_packed_equal(packed, expected.arrays, "swapped butterfly")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="planted defect: normalization")
def test_planted_defect_forward_scale_is_caught():
    x = _kv(np.random.default_rng(7), (16, 2, 128), F32)  # n = 7: forward 2^-3, not 2^-4
    expected = oracle.pack(x, format="hint4", kind="value")
    wrong = jhad.butterfly(jnp.asarray(x)) * jnp.float32(2.0**-4)
    packed = kq.pack_kv(wrong, kind="value", format="int4")
    assert_packed_equal(packed, expected.arrays, "ceil-normalized rotation")


# ------------------------------------------------------------------------------------------
# residual chains, conformance vectors, registries, layout, errors, kernels


@pytest.mark.parametrize(
    "kind, base, residual, g",
    [
        ("value", "hint4", ("hint2", "hint4"), None),
        ("key", "int4", "hint4", 16),
        ("value", "hint2", "int4", 8),
    ],
)
def test_residual_chains_equal_the_oracle(kind, base, residual, g):
    loops = _kv(np.random.default_rng(8), (3, 40, 2, 16), BF16)
    args = dict(kind=kind, base_format=base, residual_format=residual, group_size=g)
    want_base, want_res = ores.encode_loops(loops, **args)
    want = ores.decode_loops(want_base, want_res)
    assert_same_bytes(np.asarray(kq.decode_loops(kq.encode_loops(loops, **args))), want, "jax")
    from kvq_torch_bridge.codecs import loops as tloops

    code = tloops.encode_loops(numpy_to_torch(loops), **args)
    assert_same_bytes(to_numpy(tloops.decode_loops(code)), want, "torch")


def test_conformance_vectors_cover_hint_and_catch_a_wrong_code():
    cases = [c for c in load_vectors() if c.format in FORMATS]
    assert {c.format for c in cases} == set(FORMATS)
    assert len(cases) >= 30
    assert {c.axis for c in cases} == {"tokens", "channels"}
    assert {c.values.shape[2] for c in cases} >= {1, 2, 8, 16, 32, 128}
    assert any(np.isnan(c.values.astype(np.float32)).any() for c in cases)
    # JAX runs every vector in test_conformance; Torch (eager, no compilation) runs them here.
    results = check_pack(kt.pack_kv, unpack_fn=kt.unpack_kv, input_kind="torch", cases=cases)
    assert all(r.passed for r in results), [r.detail for r in results if not r.passed]

    def unrotated(values, **kwargs):  # the base format without the rotation
        fmt = kwargs.pop("format")
        packed = kq.pack_kv(values, format=BASE[fmt], **kwargs)
        return dataclasses.replace(packed, format=fmt)

    # (a sample: one JAX compilation per shape)
    nontrivial = [c for c in cases if c.values.size and c.values.shape[2] > 1 and np.any(c.values)]
    sample = nontrivial[::5]
    failed = {r.name for r in check_pack(unrotated, cases=sample) if not r.passed}
    assert len(sample) >= 10 and failed == {c.name for c in sample}


def test_registries_and_layout():
    for fmt in FORMATS:
        assert fmt in kq.CODECS and fmt in treg.CODECS and fmt in registry.known_formats()
        layout, base = registry.layout(fmt), registry.layout(BASE[fmt])
        assert layout.default_group_size == 64 and not layout.fixed_group_size
        shape = (64, 2, 64)
        assert layout.array_shapes(shape, "channels", 64) == base.array_shapes(
            shape, "channels", 64
        )
        x = np.zeros(shape, BF16)
        for pack in (kq.pack_kv, lambda v, **kw: kt.pack_kv(numpy_to_torch(v), **kw)):
            packed = pack(x, kind="value", format=fmt)
            assert packed.bits_per_element == {"hint4": 4.5, "hint2": 2.5}[fmt]
            assert packed.storage_bytes == layout.storage_bytes(shape, "channels", 64)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "shape, kwargs, error, match",
    [
        ((8, 2, 12), {}, ValueError, "D \\(channels\\) a power of two, got D=12"),
        ((8, 2, 8), dict(group_size=0), ValueError, "group_size"),
        ((8, 2, 8), dict(group_size=2.5), TypeError, "group_size"),
        ((8, 2, 8), dict(kind="query"), ValueError, "kind"),
        ((8, 2, 8), dict(axis="heads"), ValueError, "axis"),
    ],
)
def test_bad_arguments_name_the_argument(fmt, shape, kwargs, error, match):
    x = np.ones(shape, np.float32)
    args = {"kind": "value", "format": fmt, **kwargs}
    with pytest.raises(error, match=match) as jax_error:
        kq.pack_kv(x, **args)
    with pytest.raises(error, match=match) as torch_error:
        kt.pack_kv(numpy_to_torch(x), **args)
    assert str(jax_error.value) == str(torch_error.value)
    with pytest.raises((ValueError, TypeError), match=match.split(",")[0]):
        oracle.pack(x, **args)


def test_kernels_serve_hint_values_and_decline_the_rest_with_a_reason():
    """Decode attention's kernel attends HINT values (in the rotated space), page
    reconstruction un-rotates them in the tile, page packing takes HINT4 and HINT2 (rotated
    in the tile); HINT keys in decode attention stay on the XLA path, declined with a reason
    naming the format."""
    from kvq_jax.cache.paged_cache import PagedCacheConfig, init_cache
    from kvq_jax.kernels import page_pack, page_reconstruct, paged_attention

    q = np.zeros((1, 2, 64), np.float32)
    shape = dict(num_pages=4, page_size=16, num_heads=2, head_dim=64, dtype="bfloat16")
    for fmt in FORMATS:
        assert page_pack.config_support((4, 16, 2, 64), jnp.bfloat16, kind="value",
                                        format=fmt) is None  # fmt: skip
        values = PagedCacheConfig(**shape, v_base_format=fmt)
        assert page_reconstruct.config_support(values, "value") is None
        assert page_reconstruct.config_support(values, "key") is None
        assert paged_attention.config_support(q, init_cache(values), None) is None
        keys = PagedCacheConfig(**shape, k_base_format=fmt)
        reason = paged_attention.config_support(q, init_cache(keys), None)
        assert f"key loop 0 format '{fmt}'" in reason and "rotated" in reason
