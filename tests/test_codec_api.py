"""Properties of the jitted JAX codec API (`pack_kv` / `unpack_kv` / `PackedKV` / registry).

Bit-exactness against the scalar oracle lives elsewhere; this file checks the contract around
it: argument validation at trace time, defaults, array layouts and sizes, pytree behaviour
under jit / scan / vmap, output dtypes, an independent ml_dtypes check of the rounding steps,
non-finite inputs and the flush-to-zero model (docs/FORMAT.md).

Most tests reuse the shapes below so the jit cache keeps compilation time down.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_bytes

import kvq_jax
from kvq_jax import (
    CODECS,
    Codec,
    PackedKV,
    pack_kv,
    register_codec,
    unpack_kv,
    unregister_codec,
)
from kvq_jax.codecs._numerics import e2m1_magnitude_code
from kvq_jax.codecs.packed import ARRAY_FIELDS

BUILTIN_FORMATS = ("int4", "nvfp4", "fp8_e4m3")
KINDS = ("key", "value")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = (BF16, F16, F32)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
U8 = np.dtype(np.uint8)
F32_TINY = np.float32(np.finfo(np.float32).tiny)

PARTIAL = (40, 3, 37)  # T, D not multiples of 16 / 64; odd D
ONE = (1, 2, 8)  # T = 1
FULL = (64, 2, 128)  # complete groups for G in {16, 32, 64}; even D
NARROW = (17, 1, 1)  # D = 1: one nibble per byte, high nibble 0
EMPTY = (0, 2, 8)  # T = 0

#: E2M1 values by 4-bit code (bit 3 = sign), written out independently of the library.
E2M1_TABLE = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32
)


# ------------------------------------------------------------------------------------------
# helpers


def _data(shape, dtype=BF16, seed=0, scale=1.0):
    """Normal-range test data; channel magnitudes spread over ~3 decades."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, np.float32)
    if shape[-1]:
        x *= np.float32(2.0) ** rng.integers(-5, 5, size=shape[-1]).astype(np.float32)
    return (x * np.float32(scale)).astype(dtype)


def _pack(x, kind, fmt, **kwargs):
    """pack_kv, omitting None arguments: jit caches `axis=None` and an omitted `axis` (and a
    numpy and a jax input) separately, so every test calls it the same way to share compiles."""
    return pack_kv(x, kind=kind, format=fmt, **{k: v for k, v in kwargs.items() if v is not None})


@functools.cache
def _packed(fmt, kind, shape, dtype=BF16, seed=0, axis=None, group_size=None):
    """(numpy input, its PackedKV), cached across tests."""
    x = _data(shape, dtype, seed)
    return x, _pack(x, kind, fmt, axis=axis, group_size=group_size)


def _b(a) -> bytes:
    return np.asarray(a).tobytes()


def _meta(p: PackedKV):
    return (p.format, p.kind, p.axis, p.group_size, p.shape, p.dtype)


def _assert_same_packed(p: PackedKV, q: PackedKV, *, check_kind=True):
    mp, mq = _meta(p), _meta(q)
    if not check_kind:
        mp, mq = mp[:1] + mp[2:], mq[:1] + mq[2:]
    assert mp == mq
    assert sorted(p.arrays) == sorted(q.arrays)
    for name, a in p.arrays.items():
        assert_same_bytes(a, q.arrays[name], name)


def _index(p: PackedKV, i) -> PackedKV:
    return jax.tree_util.tree_map(lambda a: a[i], p)


def _unpack_nibbles(codes, d):
    codes = np.asarray(codes)
    out = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    return out[..., :d]


def _expand(meta, axis, g, shape):
    """Per-group metadata -> per-element [T, H, D] (independent of kvq_jax.codecs._grouping)."""
    t, _, d = shape
    if axis == "tokens":
        return np.repeat(meta, g, axis=0)[:t]
    return np.repeat(meta, g, axis=2)[..., :d]


def _group_max_abs(x, axis, g):
    t, h, d = x.shape
    a = np.abs(x)
    if axis == "tokens":
        a = np.pad(a, [(0, -t % g), (0, 0), (0, 0)])
        return a.reshape(-1, g, h, d).max(axis=1)
    a = np.pad(a, [(0, 0), (0, 0), (0, -d % g)])
    return a.reshape(t, h, -1, g).max(axis=3)


def _group_ids(shape, axis, g):
    """[T, H, D] int array: flat index of each element's group in the metadata array."""
    t, h, d = shape
    ti, hi, di = np.indices(shape)
    if axis == "tokens":
        return np.ravel_multi_index((ti // g, hi, di), (-(-t // g), h, d))
    return np.ravel_multi_index((ti, hi, di // g), (t, h, -(-d // g)))


def _expected_arrays(fmt, shape, axis, g):
    """{field: (shape, dtype)} written out from FORMAT.md, not from the codec."""
    t, h, d = shape
    meta = (-(-t // g), h, d) if axis == "tokens" else (t, h, -(-d // g))
    nibbles = (t, h, (d + 1) // 2)
    if fmt == "int4":
        return {"codes": (nibbles, U8), "minimum": (meta, F16), "scale": (meta, F16)}
    if fmt == "nvfp4":
        return {"codes": (nibbles, U8), "block_scale": (meta, E4M3), "global_scale": ((), F32)}
    return {"codes": ((t, h, d), E4M3), "scale": ((t, h), F32)}


def _default_layout(fmt, kind, shape):
    if fmt == "fp8_e4m3":
        return "channels", shape[2]
    return {"key": "tokens", "value": "channels"}[kind], {"int4": 64, "nvfp4": 16}[fmt]


# ------------------------------------------------------------------------------------------
# argument errors, at trace time, naming the argument


def _err(case_id, exc, match, shape=(4, 2, 16), dtype=BF16, **kwargs):
    """One pack_kv argument error: pack_kv(zeros(shape, dtype), kind="key", **kwargs)."""
    return pytest.param(shape, dtype, kwargs, exc, match, id=case_id)


_PACK_ERRORS = [
    _err("rank2", ValueError, r"^values ", shape=(8, 16)),
    _err("rank4", ValueError, r"^values ", shape=(2, 4, 2, 16)),
    _err("H0", ValueError, r"^values .*H >= 1", shape=(4, 0, 16)),
    _err("D0", ValueError, r"^values .*D >= 1", shape=(4, 2, 0)),
    _err("int32", TypeError, r"^values\.dtype ", dtype=np.dtype(np.int32)),
    _err("uint8", TypeError, r"^values\.dtype ", dtype=U8),
    _err("bool", TypeError, r"^values\.dtype ", dtype=np.dtype(bool)),
    _err("kind-query", ValueError, r"^kind ", kind="query"),
    _err("kind-None", ValueError, r"^kind ", kind=None),
    _err("format-int8", ValueError, r"^format ", format="int8"),
    _err("format-INT4", ValueError, r"^format ", format="INT4"),
    _err("int4-axis", ValueError, r"^axis ", axis="heads"),
    _err("nvfp4-axis", ValueError, r"^axis ", format="nvfp4", axis="heads"),
    _err("fp8-axis-heads", ValueError, r"^axis ", format="fp8_e4m3", axis="heads"),
    _err("fp8-axis-tokens", ValueError, r"^axis ", format="fp8_e4m3", axis="tokens"),
    _err("int4-G0", ValueError, r"^group_size ", group_size=0),
    _err("int4-G-1", ValueError, r"^group_size ", group_size=-1),
    _err("int4-G2.5", TypeError, r"^group_size ", group_size=2.5),
    _err("int4-G64.0", TypeError, r"^group_size ", group_size=64.0),
    _err("int4-GTrue", TypeError, r"^group_size ", group_size=True),
    _err("nvfp4-G0", ValueError, r"^group_size ", format="nvfp4", group_size=0),
    _err("nvfp4-G-1", ValueError, r"^group_size ", format="nvfp4", group_size=-1),
    _err("nvfp4-G2.5", TypeError, r"^group_size ", format="nvfp4", group_size=2.5),
    _err("nvfp4-GTrue", TypeError, r"^group_size ", format="nvfp4", group_size=True),
    _err("nvfp4-G8", ValueError, r"^group_size .*16", format="nvfp4", group_size=8),
    _err("nvfp4-G32", ValueError, r"^group_size .*16", format="nvfp4", group_size=32),
    _err("fp8-G0", ValueError, r"^group_size ", format="fp8_e4m3", group_size=0),
    _err("fp8-G-1", ValueError, r"^group_size ", format="fp8_e4m3", group_size=-1),
    _err("fp8-G2.5", TypeError, r"^group_size ", format="fp8_e4m3", group_size=2.5),
    _err("fp8-GTrue", TypeError, r"^group_size ", format="fp8_e4m3", group_size=True),
    _err("fp8-G16.0", TypeError, r"^group_size ", format="fp8_e4m3", group_size=16.0),
    _err(
        "fp8-GTrue-D1",
        TypeError,
        r"^group_size ",
        shape=(4, 2, 1),
        format="fp8_e4m3",
        group_size=True,
    ),
    _err("fp8-G8", ValueError, r"^group_size .*D=16", format="fp8_e4m3", group_size=8),
    _err("fp8-G32", ValueError, r"^group_size .*D=16", format="fp8_e4m3", group_size=32),
]


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _call_in_mode(mode, fn, arg, shape_struct):
    """Run fn(arg) directly, under an outer jit (arg is a tracer), or under eval_shape (no data
    exists at all)."""
    if mode == "direct":
        return fn(arg)
    if mode == "outer_jit":

        def traced(a):
            leaves = jax.tree_util.tree_leaves(a)
            assert leaves and all(_is_tracer(leaf) for leaf in leaves)
            return fn(a)

        return jax.jit(traced)(arg)
    return jax.eval_shape(fn, shape_struct)


@pytest.mark.parametrize("mode", ["direct", "outer_jit", "eval_shape"])
@pytest.mark.parametrize(
    ("shape", "dtype", "kwargs", "exc", "match"),
    _PACK_ERRORS,
)
def test_pack_argument_errors(mode, shape, dtype, kwargs, exc, match):
    kwargs = {"kind": "key", **kwargs}
    with pytest.raises(exc, match=match):
        _call_in_mode(
            mode,
            lambda v: pack_kv(v, **kwargs),
            jnp.zeros(shape, dtype),
            jax.ShapeDtypeStruct(shape, dtype),
        )


@pytest.mark.parametrize("mode", ["direct", "outer_jit", "eval_shape"])
@pytest.mark.parametrize(
    ("dtype", "match"),
    [
        pytest.param(np.dtype(np.int32), r"^dtype ", id="int32"),
        pytest.param(np.dtype(np.int8), r"^dtype ", id="int8"),
        pytest.param(np.dtype(bool), r"^dtype ", id="bool"),
        pytest.param(np.dtype(np.float64), r"^dtype ", id="float64"),
        pytest.param("not-a-dtype", r"^dtype: ", id="garbage"),
    ],
)
def test_unpack_dtype_errors(mode, dtype, match):
    _, p = _packed("int4", "key", ONE)
    with pytest.raises(TypeError, match=match):
        _call_in_mode(mode, lambda q: unpack_kv(q, dtype=dtype), p, jax.eval_shape(lambda: p))


@pytest.mark.parametrize("mode", ["direct", "outer_jit", "eval_shape"])
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: jnp.zeros(ONE, BF16), id="array"),
        pytest.param(lambda: {"codes": jnp.zeros((1, 2, 4), U8)}, id="dict"),
        pytest.param(lambda: [jnp.zeros((1, 2, 4), U8)], id="list"),
    ],
)
def test_unpack_rejects_non_packedkv(mode, make):
    arg = make()
    with pytest.raises(TypeError, match=r"^packed must be a PackedKV"):
        _call_in_mode(mode, unpack_kv, arg, jax.eval_shape(lambda: arg))


# ------------------------------------------------------------------------------------------
# defaults


def test_default_axis_table():
    assert kvq_jax.DEFAULT_AXIS == {"key": "tokens", "value": "channels"}
    assert set(BUILTIN_FORMATS) <= set(CODECS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_defaults(fmt, kind):
    x, p = _packed(fmt, kind, PARTIAL)
    axis, g = _default_layout(fmt, kind, PARTIAL)
    assert _meta(p) == (fmt, kind, axis, g, PARTIAL, BF16)
    explicit = {"kind": kind, "format": fmt, "axis": axis, "group_size": g}
    assert _meta(jax.eval_shape(lambda v: pack_kv(v, **explicit), x)) == _meta(p)
    # same computation as spelling the defaults out (lowered, not compiled, to save time)
    default_hlo = pack_kv.lower(x, kind=kind, format=fmt).as_text()
    assert pack_kv.lower(x, **explicit).as_text() == default_hlo
    other_axis = "tokens" if axis == "channels" else "channels"
    if fmt != "fp8_e4m3":  # the comparison can fail: another axis lowers differently
        assert pack_kv.lower(x, **{**explicit, "axis": other_axis}).as_text() != default_hlo


def test_default_format_is_int4():
    x, _ = _packed("int4", "key", PARTIAL)
    assert jax.eval_shape(lambda v: pack_kv(v, kind="key"), x).format == "int4"
    hlo = pack_kv.lower(x, kind="key").as_text()
    assert hlo == pack_kv.lower(x, kind="key", format="int4").as_text()
    assert hlo != pack_kv.lower(x, kind="key", format="nvfp4").as_text()


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_axis_override(fmt):
    x, key_default = _packed(fmt, "key", PARTIAL)
    _, value_default = _packed(fmt, "value", PARTIAL)
    key_channels = pack_kv(x, kind="key", format=fmt, axis="channels")
    value_tokens = pack_kv(x, kind="value", format=fmt, axis="tokens")
    assert (key_channels.kind, key_channels.axis) == ("key", "channels")
    assert (value_tokens.kind, value_tokens.axis) == ("value", "tokens")
    # the kind only picks the default axis: the bytes depend on the axis alone
    _assert_same_packed(key_channels, value_default, check_kind=False)
    _assert_same_packed(value_tokens, key_default, check_kind=False)


# ------------------------------------------------------------------------------------------
# layouts and sizes


@pytest.mark.parametrize("shape", [PARTIAL, ONE, FULL, NARROW], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_array_fields_shapes_dtypes(fmt, kind, shape):
    _, p = _packed(fmt, kind, shape)
    axis, g = _default_layout(fmt, kind, shape)
    expected = _expected_arrays(fmt, shape, axis, g)
    assert set(p.arrays) == set(expected) == set(CODECS[fmt].array_fields)
    for name in set(ARRAY_FIELDS) - set(expected):
        assert getattr(p, name) is None
    for name, (s, dt) in expected.items():
        a = p.arrays[name]
        assert (a.shape, np.dtype(a.dtype)) == (s, dt), name
    assert CODECS[fmt].array_shapes(shape, axis, g) == expected
    assert p.batch_shape == ()
    if fmt != "fp8_e4m3" and shape[2] % 2:
        assert not np.any(np.asarray(p.codes)[..., -1] >> 4), "odd D: last high nibble not 0"
    out = unpack_kv(p)
    assert out.shape == shape and out.dtype == BF16


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_empty_tensor(fmt, kind):
    x = np.zeros(EMPTY, BF16)
    p = _pack(x, kind, fmt)
    axis, g = _default_layout(fmt, kind, EMPTY)
    expected = _expected_arrays(fmt, EMPTY, axis, g)
    assert {k: (a.shape, np.dtype(a.dtype)) for k, a in p.arrays.items()} == expected
    assert p.storage_bytes == (4 if fmt == "nvfp4" else 0)
    assert p.num_elements == 0 and math.isnan(p.bits_per_element)
    if fmt == "nvfp4":
        assert float(p.global_scale) == 1.0
    out = unpack_kv(p)
    assert out.shape == EMPTY and out.dtype == BF16


@pytest.mark.parametrize("shape", [PARTIAL, ONE, FULL, NARROW], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_storage_bytes(fmt, kind, shape):
    _, p = _packed(fmt, kind, shape)
    real = sum(np.asarray(a).nbytes for a in p.arrays.values())
    assert p.storage_bytes == real
    assert CODECS[fmt].storage_bytes(shape, p.axis, p.group_size) == real
    assert p.num_elements == math.prod(shape)
    assert p.bits_per_element == real * 8 / math.prod(shape)


_N_FULL = math.prod(FULL)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("fmt", "group_size", "bits"),
    [
        ("int4", None, Fraction(9, 2)),
        ("int4", 32, Fraction(5)),
        ("int4", 16, Fraction(6)),
        ("nvfp4", None, Fraction(9, 2) + Fraction(32, _N_FULL)),
        ("fp8_e4m3", None, 8 + Fraction(32, FULL[2])),
    ],
)
def test_bits_per_element(fmt, group_size, bits, kind):
    _, p = _packed(fmt, kind, FULL, group_size=group_size)
    real = sum(np.asarray(a).nbytes for a in p.arrays.values())
    assert Fraction(real * 8, _N_FULL) == bits
    assert Fraction(p.storage_bytes * 8, p.num_elements) == bits
    assert p.bits_per_element == float(bits)


# ------------------------------------------------------------------------------------------
# pytree behaviour


@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_pytree_flatten(fmt):
    _, p = _packed(fmt, "key", PARTIAL)
    leaves, treedef = jax.tree_util.tree_flatten(p)
    used = [getattr(p, n) for n in ARRAY_FIELDS if n in CODECS[fmt].array_fields]
    assert len(leaves) == len(used) == len(CODECS[fmt].array_fields)
    assert all(a is b for a, b in zip(leaves, used, strict=True))
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    q = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(q, PackedKV)
    _assert_same_packed(p, q)
    # the static metadata lives in the treedef
    _, other_kind = _packed(fmt, "value", PARTIAL)
    _, other_dtype = _packed(fmt, "key", PARTIAL, F32)
    assert jax.tree_util.tree_structure(other_kind) != treedef
    assert jax.tree_util.tree_structure(other_dtype) != treedef
    assert jax.tree_util.tree_structure(_packed(fmt, "key", PARTIAL, seed=1)[1]) == treedef


@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_jit_argument_and_result(fmt):
    x, p = _packed(fmt, "key", PARTIAL)
    _assert_same_packed(p, jax.jit(lambda p: p)(p))
    _assert_same_packed(p, jax.jit(lambda v: pack_kv(v, kind="key", format=fmt))(x))
    assert _b(jax.jit(lambda p: unpack_kv(p))(p)) == _b(unpack_kv(p))


@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_scan_carry_and_outputs(fmt):
    pairs = [_packed(fmt, "key", PARTIAL, seed=s) for s in range(3)]
    xs = np.stack([x for x, _ in pairs])

    def body(carry, x):
        assert isinstance(carry, PackedKV)
        return _pack(x, "key", fmt), carry

    final, outs = jax.lax.scan(body, pairs[0][1], xs[1:])
    _assert_same_packed(final, pairs[2][1])
    assert outs.batch_shape == (2,) and outs.shape == PARTIAL
    _assert_same_packed(_index(outs, 0), pairs[0][1])
    _assert_same_packed(_index(outs, 1), pairs[1][1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_vmap(fmt, kind):
    # different magnitudes per example: nvfp4's global scale must be per example
    xs = np.stack([_data(PARTIAL, BF16, seed=s, scale=4.0**s) for s in range(3)])
    pb = jax.vmap(lambda v: pack_kv(v, kind=kind, format=fmt))(xs)
    assert pb.batch_shape == (3,) and pb.shape == PARTIAL
    if fmt == "nvfp4":
        assert len(set(np.asarray(pb.global_scale).tolist())) == 3
    assert pb.storage_bytes == 3 * CODECS[fmt].storage_bytes(PARTIAL, pb.axis, pb.group_size)
    ub = jax.vmap(unpack_kv)(pb)
    assert ub.shape == (3, *PARTIAL) and ub.dtype == BF16
    for i in range(3):
        p = _pack(xs[i], kind, fmt)
        _assert_same_packed(_index(pb, i), p)
        assert _b(ub[i]) == _b(unpack_kv(p))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_jit_matches_eager(fmt, kind):
    x, p = _packed(fmt, kind, PARTIAL)
    jitted_out = unpack_kv(p)
    with jax.disable_jit():
        q = _pack(x, kind, fmt)
        eager_out = unpack_kv(q)
        assert not isinstance(q.codes, jax.core.Tracer)
    _assert_same_packed(p, q)
    assert _b(eager_out) == _b(jitted_out)


# ------------------------------------------------------------------------------------------
# dtypes and input layouts


@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_unpack_dtype(fmt):
    for dt in DTYPES:
        _, p = _packed(fmt, "value", PARTIAL, dt)
        assert p.dtype == dt
        out = unpack_kv(p)
        assert out.dtype == dt and out.shape == PARTIAL
    _, p = _packed(fmt, "value", PARTIAL, BF16)
    outs = {dt: unpack_kv(p, dtype=dt) for dt in DTYPES}
    for dt, out in outs.items():
        assert np.dtype(out.dtype) == dt and out.shape == PARTIAL
    assert _b(outs[BF16]) == _b(unpack_kv(p))
    f32 = np.asarray(outs[F32])
    assert np.all(np.isfinite(f32))
    assert _b(f32.astype(BF16)) == _b(outs[BF16])
    assert _b(f32.astype(F16)) == _b(outs[F16])
    assert _b(jnp.asarray(f32).astype(jnp.bfloat16)) == _b(outs[BF16])
    # dtype given as a scalar type or a string is the same choice
    assert _b(unpack_kv(p, dtype=jnp.float32)) == _b(outs[F32])
    assert _b(unpack_kv(p, dtype="bfloat16")) == _b(outs[BF16])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_non_contiguous_inputs(fmt, dtype):
    t, h, d = PARTIAL
    base = _data((2 * t, d, h), dtype, seed=11)
    strided = base[::2].transpose(0, 2, 1)
    assert strided.shape == PARTIAL and not strided.flags.c_contiguous
    contiguous = np.ascontiguousarray(strided)
    transposed = jnp.transpose(jnp.asarray(base[::2]), (0, 2, 1))
    ref = pack_kv(contiguous, kind="value", format=fmt)
    assert ref.dtype == dtype
    _assert_same_packed(pack_kv(strided, kind="value", format=fmt), ref)
    _assert_same_packed(pack_kv(transposed, kind="value", format=fmt), ref)


# ------------------------------------------------------------------------------------------
# ml_dtypes as an independent check of the rounding steps (normal-range inputs)

_ROUNDING_CASES = [("value", BF16), ("value", F16), ("value", F32), ("key", F32)]
_SIXTH = np.float32(1.0 / 6.0)
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
#: Midpoints between consecutive finite positive E4M3 values (exact in float32).
_E4M3_POSITIVE = np.arange(0x7F, dtype=np.uint8).view(E4M3).astype(np.float32)
_E4M3_MIDPOINTS = (_E4M3_POSITIVE[1:] + _E4M3_POSITIVE[:-1]) / np.float32(2.0)


def _ulp_neighbourhood(x0, radius):
    """float32 values within `radius` ulps of each (positive) x0: shape [..., 2 * radius + 1]."""
    bits = np.asarray(x0, np.float32).view(np.int32)[..., None]
    return (bits + np.arange(-radius, radius + 1, dtype=np.int32)).view(np.float32)


def _pick(candidates, score):
    """Per row of the last axis, the candidate with the highest score (first on ties)."""
    idx = np.argmax(score, axis=-1)[..., None]
    return np.take_along_axis(candidates, idx, axis=-1)[..., 0]


def _check_nvfp4_against_ml_dtypes(x, p):
    """Recompute block scales and codes in numpy float32 with ml_dtypes roundings."""
    shape = x.shape
    xf = np.asarray(x).astype(np.float32)
    assert np.all(np.abs(xf) >= F32_TINY), "normal-range inputs only"
    g = np.float32(np.asarray(p.global_scale))
    assert g == np.float32(2688.0) / np.max(np.abs(xf))

    # block scales: e4m3(min(g * (vmax * f32(1/6)), 448))
    vmax = _group_max_abs(xf, p.axis, 16)
    s = np.minimum(g * (vmax * _SIXTH), np.float32(448.0))
    assert s.dtype == np.float32
    assert_same_bytes(p.block_scale, s.astype(E4M3), "block_scale")

    # codes: E2M1 rounding of clip(x * r, -6, 6) with r = 1 / (sf * (1 / g))
    sf = _expand(np.asarray(p.block_scale).astype(np.float32), p.axis, 16, shape)
    v = sf * (np.float32(1.0) / g)
    assert np.all(v != 0)
    y = np.clip(xf * (np.float32(1.0) / v), np.float32(-6.0), np.float32(6.0))
    assert y.dtype == np.float32
    codes = _unpack_nibbles(p.codes, shape[2])
    expected = y.astype(E2M1)
    np.testing.assert_array_equal(E2M1_TABLE[codes], expected.astype(np.float32))
    np.testing.assert_array_equal(codes, expected.view(U8))  # sign bit included
    return codes


def _check_fp8_against_ml_dtypes(x, p):
    xf = np.asarray(x).astype(np.float32)
    s = np.asarray(p.scale)
    np.testing.assert_array_equal(s, np.max(np.abs(xf), axis=-1) / np.float32(448.0))
    assert_same_bytes(p.codes, (xf / s[..., None]).astype(E4M3), "codes")


@pytest.mark.parametrize(("kind", "dtype"), _ROUNDING_CASES, ids=str)
def test_nvfp4_rounding_matches_ml_dtypes(kind, dtype):
    x, p = _packed("nvfp4", kind, PARTIAL, dtype)
    codes = _check_nvfp4_against_ml_dtypes(x, p)
    assert len(np.unique(codes)) == 16


@pytest.mark.parametrize(("kind", "dtype"), _ROUNDING_CASES, ids=str)
def test_fp8_rounding_matches_ml_dtypes(kind, dtype):
    x, p = _packed("fp8_e4m3", kind, PARTIAL, dtype)
    _check_fp8_against_ml_dtypes(x, p)


def _nvfp4_near_ties(axis, seed=0):
    """float32 [T, H, D] data on which the order of the roundings shows.

    Half the groups have a maximum where g * (vmax * (1/6)) and (g * vmax) * (1/6) round to
    different E4M3 block scales, and six members per group sit within a few ulps of an E2M1
    midpoint, where x * r and x / v round to different codes (or x * r is an exact tie).
    """
    rng = np.random.default_rng(seed)
    t, h, d = PARTIAL
    amax = np.float32(5.37)
    g = np.float32(2688.0) / amax
    mids = _E4M3_MIDPOINTS[(_E4M3_MIDPOINTS > 2.0**-6) & (_E4M3_MIDPOINTS < 448.0)]
    v = _ulp_neighbourhood(mids * np.float32(6.0) / g, 24).ravel()
    v = v[v < amax]
    split = (g * (v * _SIXTH)).astype(E4M3).view(U8) != ((g * v) * _SIXTH).astype(E4M3).view(U8)
    hard_vmax = v[split]
    assert len(hard_vmax) >= 20

    group_shape = (-(-t // 16), h, d) if axis == "tokens" else (t, h, -(-d // 16))
    # half the groups take a split maximum; the others a random one (their steps give the
    # E2M1 splits below more chances)
    vmax = np.where(
        rng.random(group_shape) < 0.5,
        hard_vmax[rng.integers(len(hard_vmax), size=group_shape)],
        rng.uniform(0.01, 5.0, group_shape).astype(np.float32),
    )
    vmax.flat[0] = amax
    sf = np.minimum(g * (vmax * _SIXTH), np.float32(448.0)).astype(E4M3).astype(np.float32)
    step = sf * (np.float32(1.0) / g)
    r = np.float32(1.0) / step
    members = rng.uniform(-0.9, 0.9, (*group_shape, 16)).astype(np.float32) * vmax[..., None]
    members[..., 0] = vmax * rng.choice(np.float32([-1, 1]), group_shape)  # always a real member
    mid = rng.choice(_E2M1_MIDPOINTS, (*group_shape, 6))
    cand = _ulp_neighbourhood(mid / r[..., None], 6)
    y_mul = cand * r[..., None, None]
    y_div = cand / step[..., None, None]
    split = y_mul.astype(E2M1).view(U8) != y_div.astype(E2M1).view(U8)
    tie = y_mul == mid[..., None]
    near = _pick(cand, 2 * split + tie)
    assert np.all(near < vmax[..., None])
    members[..., 1:7] = near * rng.choice(np.float32([-1, 1]), near.shape)
    if axis == "tokens":  # [nG, H, D, G] -> [nG * G, H, D] -> crop
        return np.moveaxis(members, -1, 1).reshape(-1, h, d)[:t]
    return members.reshape(t, h, -1)[..., :d]


@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_rounding_near_ties(kind):
    _, reference = _packed("nvfp4", kind, PARTIAL, F32)  # compiled already: same shape, dtype
    x = _nvfp4_near_ties(reference.axis)
    p = _pack(x, kind, "nvfp4")
    _check_nvfp4_against_ml_dtypes(x, p)
    # the data has teeth: the other rounding orders would give other bytes
    g = np.float32(np.asarray(p.global_scale))
    vmax = _group_max_abs(x, p.axis, 16)
    other_scales = np.minimum((g * vmax) * _SIXTH, np.float32(448.0)).astype(E4M3)
    assert np.sum(other_scales.view(U8) != np.asarray(p.block_scale).view(U8)) > 50
    sf = _expand(np.asarray(p.block_scale).astype(np.float32), p.axis, 16, PARTIAL)
    step = sf * (np.float32(1.0) / g)
    y_div = np.clip(x / step, np.float32(-6.0), np.float32(6.0)).astype(E2M1).view(U8)
    assert np.sum(y_div != _unpack_nibbles(p.codes, PARTIAL[2])) > 50


def _fp8_near_ties(seed=0):
    """float32 [T, H, D] data where x / s and x * (1 / s) round to different E4M3 codes (or
    x / s is an exact E4M3 tie) for twelve channels per row."""
    rng = np.random.default_rng(seed)
    amax = rng.uniform(0.5, 4.0, PARTIAL[:2]).astype(np.float32)
    x = rng.uniform(-0.9, 0.9, PARTIAL).astype(np.float32) * amax[..., None]
    x[..., 0] = amax
    s = amax / np.float32(448.0)
    mids = _E4M3_MIDPOINTS[(_E4M3_MIDPOINTS > 1.0) & (_E4M3_MIDPOINTS < 400.0)]
    mid = rng.choice(mids, (*PARTIAL[:2], 12))
    cand = _ulp_neighbourhood(mid * s[..., None], 6)
    q_div = cand / s[..., None, None]
    q_mul = cand * (np.float32(1.0) / s)[..., None, None]
    split = q_div.astype(E4M3).view(U8) != q_mul.astype(E4M3).view(U8)
    near = _pick(cand, 2 * split + (q_div == mid[..., None]))
    assert np.all(near < amax[..., None])
    x[..., 1:13] = near * rng.choice(np.float32([-1, 1]), near.shape)
    return x


def test_fp8_rounding_near_ties():
    x = _fp8_near_ties()
    p = _pack(x, "value", "fp8_e4m3")
    _check_fp8_against_ml_dtypes(x, p)
    s = np.asarray(p.scale)
    by_reciprocal = (x * (np.float32(1.0) / s)[..., None]).astype(E4M3)
    assert np.sum(by_reciprocal.view(U8) != np.asarray(p.codes).view(U8)) > 50


def test_e2m1_magnitude_code_matches_ml_dtypes():
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    rng = np.random.default_rng(0)
    vals = np.concatenate(
        [
            mids,
            np.nextafter(mids, np.float32(0)),
            np.nextafter(mids, np.float32(np.inf)),
            grid,
            np.nextafter(grid[1:], np.float32(0)),
            np.nextafter(grid[:-1], np.float32(np.inf)),
            rng.uniform(0, 6, 10_000).astype(np.float32),
        ]
    ).astype(np.float32)
    got = np.asarray(e2m1_magnitude_code(jnp.asarray(vals)))
    assert got.dtype == U8
    np.testing.assert_array_equal(got, vals.astype(E2M1).view(U8))
    # ties to even, as listed in FORMAT.md section 3
    assert list(np.asarray(e2m1_magnitude_code(jnp.asarray(mids)))) == [0, 2, 2, 4, 4, 6, 6]


# ------------------------------------------------------------------------------------------
# non-finite inputs (FORMAT.md sections 2-4)


@pytest.mark.parametrize(
    "bad_value",
    [np.inf, -np.inf, np.nan],
    ids=["inf", "-inf", "nan"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_int4_non_finite_groups(kind, bad_value):
    g = 16
    x = _data(PARTIAL, F32, seed=21)
    clean = _pack(x, kind, "int4", group_size=g)
    axis = clean.axis
    bad = x.copy()
    bad[3, 0, 5] = bad_value  # a complete group along either axis
    bad[38, 2, 36] = bad_value  # the partial last group along either axis
    bad[20, 1, 17] = bad_value
    p = _pack(bad, kind, "int4", group_size=g)

    ids = _group_ids(PARTIAL, axis, g)
    bad_groups = np.unique(ids[~np.isfinite(bad)])
    assert len(bad_groups) == 3
    elem_bad = np.isin(ids, bad_groups)
    meta_shape = p.minimum.shape
    meta_bad = np.isin(np.arange(math.prod(meta_shape)).reshape(meta_shape), bad_groups)

    minimum, scale = np.asarray(p.minimum), np.asarray(p.scale)
    assert np.all(np.isnan(minimum[meta_bad])) and np.all(np.isnan(scale[meta_bad]))
    assert np.all(np.isfinite(minimum[~meta_bad])) and np.all(np.isfinite(scale[~meta_bad]))
    codes = _unpack_nibbles(p.codes, PARTIAL[2])
    assert np.all(codes[elem_bad] == 0)
    # other groups are unaffected
    np.testing.assert_array_equal(minimum[~meta_bad], np.asarray(clean.minimum)[~meta_bad])
    np.testing.assert_array_equal(scale[~meta_bad], np.asarray(clean.scale)[~meta_bad])
    np.testing.assert_array_equal(
        codes[~elem_bad], _unpack_nibbles(clean.codes, PARTIAL[2])[~elem_bad]
    )
    out = np.asarray(unpack_kv(p))
    np.testing.assert_array_equal(np.isnan(out), elem_bad)


@pytest.mark.parametrize("bad_value", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_non_finite_tensor(kind, bad_value):
    x, _ = _packed("nvfp4", kind, PARTIAL, F32)
    bad = x.copy()
    bad[17, 1, 30] = bad_value
    p = pack_kv(bad, kind=kind, format="nvfp4")
    assert np.isnan(np.asarray(p.global_scale))
    assert np.all(np.asarray(p.block_scale).view(U8) == 0x7F)
    assert np.all(np.asarray(p.codes) == 0)
    assert np.all(np.isnan(np.asarray(unpack_kv(p))))


def test_fp8_non_finite_rows():
    x, clean = _packed("fp8_e4m3", "value", PARTIAL, F32)
    bad = x.copy()
    bad[3, 1, 0] = np.nan
    bad[10, 2, 36] = np.inf
    bad[39, 0, 17] = -np.inf
    p = pack_kv(bad, kind="value", format="fp8_e4m3")
    row_bad = ~np.all(np.isfinite(bad), axis=-1)
    assert row_bad.sum() == 3
    scale = np.asarray(p.scale)
    assert np.all(np.isnan(scale[row_bad])) and np.all(np.isfinite(scale[~row_bad]))
    codes = np.asarray(p.codes).view(U8)
    assert np.all(codes[row_bad] == 0)
    np.testing.assert_array_equal(scale[~row_bad], np.asarray(clean.scale)[~row_bad])
    np.testing.assert_array_equal(codes[~row_bad], np.asarray(clean.codes).view(U8)[~row_bad])
    out = np.asarray(unpack_kv(p))
    np.testing.assert_array_equal(np.isnan(out), np.broadcast_to(row_bad[..., None], PARTIAL))


# ------------------------------------------------------------------------------------------
# flush-to-zero model (FORMAT.md section 0)


def _with_subnormals(bits, positions, rng, mantissa_bits, sign_bit):
    """Put random subnormal bit patterns at `positions` of an unsigned view; also return the
    same array with signed zeros there."""
    n = int(positions.sum())
    sign = rng.integers(0, 2, n).astype(bits.dtype) << sign_bit
    mantissa = rng.integers(1, 1 << mantissa_bits, n).astype(bits.dtype)
    sub, zero = bits.copy(), bits.copy()
    sub[positions] = sign | mantissa
    zero[positions] = sign
    return sub, zero


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_bf16_subnormals_pack_as_signed_zeros(fmt, kind):
    rng = np.random.default_rng(31)
    bits = _data(PARTIAL, BF16, seed=30).view(np.uint16)
    for positions in (rng.random(PARTIAL) < 0.15, np.ones(PARTIAL, bool)):
        sub, zero = _with_subnormals(bits, positions, rng, mantissa_bits=7, sign_bit=15)
        sub, zero = sub.view(BF16), zero.view(BF16)
        mags = np.abs(sub[positions].astype(np.float32))
        assert np.all((mags > 0) & (mags < F32_TINY))
        assert np.any(np.signbit(sub[positions].astype(np.float32)))
        p_sub = pack_kv(sub, kind=kind, format=fmt)
        _assert_same_packed(p_sub, pack_kv(zero, kind=kind, format=fmt))
        assert _b(unpack_kv(p_sub)) == _b(unpack_kv(pack_kv(zero, kind=kind, format=fmt)))


@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_f16_subnormals_are_kept(fmt):
    """Control for the test above: fp16 subnormals are normal in f32 and must not be flushed."""
    rng = np.random.default_rng(41)
    bits = np.zeros(PARTIAL, np.uint16)
    sub, zero = _with_subnormals(bits, np.ones(PARTIAL, bool), rng, mantissa_bits=10, sign_bit=15)
    sub, zero = sub.view(F16), zero.view(F16)
    p_sub = pack_kv(sub, kind="value", format=fmt)
    p_zero = pack_kv(zero, kind="value", format=fmt)
    assert _b(p_sub.codes) != _b(p_zero.codes)
    assert np.any(np.asarray(unpack_kv(p_sub)) != 0)


# ------------------------------------------------------------------------------------------
# registry (last in the file: replacing or removing a codec clears every jit cache)


class _Identity16(Codec):
    """Toy format: the values as float16 codes (overrides `pack` itself, the older way)."""

    name = "identity16"
    array_fields = ("codes",)
    default_group_size = 1

    def array_shapes(self, shape, axis, group_size):
        return {"codes": (tuple(shape), F16)}

    def pack(self, values, *, kind, axis, group_size):
        return self._packed(
            {"codes": values.astype(jnp.float16)},
            kind=kind,
            axis=axis,
            group_size=group_size,
            shape=values.shape,
            dtype=values.dtype,
        )

    def unpack(self, packed, dtype):
        return packed.codes.astype(dtype)


class _Doubling16(_Identity16):
    def pack(self, values, *, kind, axis, group_size):
        return super().pack(values * 2, kind=kind, axis=axis, group_size=group_size)


@pytest.fixture
def identity16():
    before = dict(CODECS)
    codec = _Identity16()
    assert register_codec(codec) is codec
    yield codec
    if codec.name in CODECS:
        unregister_codec(codec.name)
    assert before == CODECS


@pytest.mark.parametrize("fmt", BUILTIN_FORMATS)
def test_register_rejects_duplicates(fmt):
    before = dict(CODECS)
    with pytest.raises(ValueError, match=rf"^format '{fmt}' is already registered"):
        register_codec(CODECS[fmt])
    with pytest.raises(ValueError, match="already registered"):
        register_codec(type(CODECS[fmt])())
    assert before == CODECS


@pytest.mark.parametrize(
    "obj", [object(), "int4", type(CODECS["int4"]), None], ids=["object", "str", "class", "None"]
)
def test_register_rejects_non_codec(obj):
    before = dict(CODECS)
    with pytest.raises(TypeError, match=r"^codec must be a kvq_jax.Codec"):
        register_codec(obj)
    assert before == CODECS


def test_toy_codec_through_api(identity16):
    assert kvq_jax.get_codec("identity16") is identity16
    with pytest.raises(ValueError, match="already registered"):
        register_codec(_Identity16())
    x = _data(PARTIAL, F32, seed=7)
    p = pack_kv(x, kind="value", format="identity16")
    assert isinstance(p, PackedKV)
    assert _meta(p) == ("identity16", "value", "channels", 1, PARTIAL, F32)
    assert set(p.arrays) == {"codes"}
    assert _b(p.codes) == _b(x.astype(F16))
    assert (
        p.storage_bytes
        == 2 * math.prod(PARTIAL)
        == identity16.storage_bytes(PARTIAL, "channels", 1)
    )
    out = unpack_kv(p)
    assert out.dtype == F32
    assert _b(out) == _b(x.astype(F16).astype(F32))
    assert _b(unpack_kv(p, dtype=BF16)) == _b(x.astype(F16).astype(F32).astype(BF16))
    # the shared argument checks apply to a new codec too
    with pytest.raises(ValueError, match=r"^kind "):
        pack_kv(x, kind="query", format="identity16")
    with pytest.raises(ValueError, match=r"^group_size "):
        pack_kv(x, kind="key", format="identity16", group_size=0)
    with pytest.raises(ValueError, match="identity16"):  # listed among the known formats
        pack_kv(x, kind="key", format="no-such-format")


def test_register_replace_takes_effect_after_compile(identity16):
    x = _data(ONE, F32, seed=8)
    first = pack_kv(x, kind="key", format="identity16")
    assert _b(first.codes) == _b(x.astype(F16))
    register_codec(_Doubling16(), replace=True)
    second = pack_kv(x, kind="key", format="identity16")
    assert _b(second.codes) == _b((x * 2).astype(F16)), "replaced codec not used"


def test_unregister_takes_effect_after_compile(identity16):
    x = _data(ONE, F32, seed=9)
    pack_kv(x, kind="key", format="identity16")  # compiled for this shape
    assert unregister_codec("identity16") is identity16
    assert "identity16" not in CODECS
    with pytest.raises(ValueError, match=r"^format "):
        pack_kv(x, kind="key", format="identity16")
    with pytest.raises(ValueError, match=r"^format "):
        unregister_codec("identity16")
