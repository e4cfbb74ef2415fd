"""INTB's Torch codec (docs/FORMAT.md section 2b) against the JAX codec, byte for byte.

The same bit table is registered in both stacks (`IntBCodec(table)`, one name per table):
stored codes, minimum and scale must be byte-identical and decoded values equal (a NaN matches
any NaN) over bf16/fp16/fp32 inputs, irregular tables whose codes straddle bytes, all-4 / all-2
/ all-8 tables, G in {1, 7, 64}, a partial last group, T = 0 and T = 1, and groups with zero
span, signed zeros, inf / NaN and float16 overflow. The Torch bit stream is also checked
against an independent numpy re-derivation (float32 affine codes written LSB first with
`np.packbits`); an all-4 table must give Torch INT4's bytes (axis tokens), an all-2 table
INT2's. Bad arguments raise the same exception with the same message in both stacks, the
DLPack bridge carries an INTB PackedKV both ways, and planted defects (strict xfails) show that
the comparisons fail when a bit is wrong.
"""

from __future__ import annotations

import dataclasses
import warnings

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_bytes, assert_same_values, numpy_to_torch

import kvq_jax as kq
from kvq_jax.codecs.formats import intb as jintb
from kvq_jax.core.layouts import intb_name

torch = pytest.importorskip("torch")
import kvq_torch_bridge as kt  # noqa: E402
from kvq_torch_bridge.codecs._dtypes import to_numpy  # noqa: E402
from kvq_torch_bridge.codecs.formats import intb as tintb  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = (BF16, F16, F32)

#: Bit tables [H][D]: every row sums to the same multiple of 8 (W bytes per row).
TABLES = {
    # H2 D7 W4: 6 bits at 3..8, 7 at 10..16, 8 at 17..24 straddle bytes; head 1 all different
    "irregular": [[3, 6, 1, 7, 8, 2, 5], [5, 5, 5, 5, 4, 4, 4]],
    # H3 D5 W3: widths 1 and 8 next to each other, an 8-bit code across a byte boundary
    "mixed": [[1, 8, 8, 6, 1], [5, 5, 5, 5, 4], [2, 3, 7, 4, 8]],
    "all4": [[4] * 6, [4] * 6],  # INT4 (even D), byte for byte
    "all8": [[8] * 3, [8] * 3],
}

_REGISTERED: dict[str, tuple] = {}


def _codecs(table):
    """(JAX codec, Torch codec) for `table`, registered once in each stack (same name)."""
    name = intb_name(table)
    if name not in _REGISTERED:
        jc, tc = kq.IntBCodec(table), kt.IntBCodec(table)
        assert jc.name == tc.name == name
        kq.register_codec(jc, replace=True)
        kt.register_codec(tc, replace=True)
        _REGISTERED[name] = (jc, tc)
    return _REGISTERED[name]


@pytest.fixture(autouse=True, scope="module")
def _unregister_tables():
    yield
    for name in _REGISTERED:
        kq.unregister_codec(name)
        kt.unregister_codec(name)
    _REGISTERED.clear()


def _kv(rng, shape, dtype, scale=2.0):
    """Random K/V-like values [T, H, D]: a per-(head, channel) offset plus noise."""
    x = rng.standard_normal(shape) + scale * rng.standard_normal((1, *shape[1:]))
    return x.astype(np.float32).astype(dtype)


def _shape(table, t):
    return (t, len(table), len(table[0]))


def _assert_same_bits(actual, expected, what):
    """uint8 streams [T, H, W] with the same bytes; on failure, name the first stream bit."""
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.dtype == e.dtype == np.uint8 and a.shape == e.shape, (what, a.shape, e.shape)
    ab = np.unpackbits(a, axis=-1, bitorder="little")
    eb = np.unpackbits(e, axis=-1, bitorder="little")
    if not np.array_equal(ab, eb):
        t, h, k = (int(i) for i in np.argwhere(ab != eb)[0])
        raise AssertionError(
            f"{what}: stream bit {k} of (token {t}, head {h}) differs: {ab[t, h, k]} != "
            f"{eb[t, h, k]} ({int(np.sum(ab != eb))} bits differ)"
        )


def _compare(pt, pj, what="torch vs jax"):
    """A Torch PackedKV equals a JAX PackedKV: metadata, stored bytes, decoded values."""
    meta = ("format", "kind", "axis", "group_size", "shape", "dtype")
    assert [getattr(pt, m) for m in meta] == [getattr(pj, m) for m in meta], what
    _assert_same_bits(to_numpy(pt.codes), np.asarray(pj.codes), f"{what} codes")
    for name in ("codes", "minimum", "scale"):
        assert_same_bytes(to_numpy(getattr(pt, name)), np.asarray(getattr(pj, name)), name)
    for dt in (None, F32):
        got = to_numpy(kt.unpack_kv(pt, dtype=dt))
        assert_same_values(got, np.asarray(kq.unpack_kv(pj, dtype=dt)), f"{what} decoded {dt}")


def _pack_both(x, table, g, kind="key"):
    jc, tc = _codecs(table)
    pj = kq.pack_kv(x, kind=kind, format=jc.name, group_size=g)
    pt = kt.pack_kv(numpy_to_torch(x), kind=kind, format=tc.name, group_size=g)
    assert pt.codes.dtype == torch.uint8 and pt.minimum.dtype == torch.float16
    expected = tc.array_shapes(x.shape, "tokens", g)
    assert {
        n: (tuple(getattr(pt, n).shape), np.dtype(to_numpy(getattr(pt, n)).dtype)) for n in expected
    } == expected
    return pj, pt


# ------------------------------------------------------------------------------------------
# an independent numpy re-derivation (finite, normal data only)


def _numpy_codes(x, table, g):
    """float32 affine codes [T, H, D] and f16 minimum / scale, one group at a time."""
    x = x.astype(np.float32)
    levels = (2 ** np.asarray(table) - 1).astype(np.float32)
    codes = np.zeros(x.shape, np.uint8)
    mins, scales = [], []
    for s in range(0, x.shape[0], g):
        block = x[s : s + g]
        mn, mx = block.min(axis=0), block.max(axis=0)
        span = mx - mn
        scale = np.where(span > 0, span / levels, np.float32(1)).astype(np.float32)
        q = np.round((block - mn) / scale)  # half to even
        codes[s : s + g] = np.clip(q, 0, levels).astype(np.uint8)
        mins.append(mn.astype(np.float16))
        scales.append(scale.astype(np.float16))
    return codes, np.asarray(mins), np.asarray(scales)


def _numpy_stream(codes, table):
    """uint8 codes [T, H, D] -> [T, H, W]: channel c's bit i at stream bit o[c] + i, stream bit
    k in bit k % 8 of byte k // 8 (FORMAT.md section 2b, written from the text)."""
    rows = []
    for h, row in enumerate(table):
        bits = [(codes[:, h, c, None] >> np.arange(b)) & 1 for c, b in enumerate(row)]
        rows.append(np.packbits(np.concatenate(bits, axis=-1).astype(np.uint8), -1, "little"))
    return np.stack(rows, axis=1)


def _read_stream(stream, table):
    """uint8 [T, H, W] -> codes [T, H, D] (the inverse of `_numpy_stream`)."""
    bits = np.unpackbits(stream, axis=-1, bitorder="little").astype(np.uint16)
    out = np.zeros((stream.shape[0], len(table), len(table[0])), np.uint8)
    for h, row in enumerate(table):
        o = 0
        for c, b in enumerate(row):
            out[:, h, c] = np.sum(bits[:, h, o : o + b] << np.arange(b), axis=-1)
            o += b
    return out


# ------------------------------------------------------------------------------------------
# Torch == JAX


@pytest.mark.thin(2)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", [1, 7, 64])
@pytest.mark.parametrize("table", sorted(TABLES))
def test_torch_equals_jax(table, g, dtype):
    bits = TABLES[table]
    # T = 71: G = 7 gives 10 groups and a partial one of 1 row, G = 64 one and a partial of 7
    x = _kv(np.random.default_rng(g + len(bits[0])), _shape(bits, 71), dtype)
    pj, pt = _pack_both(x, bits, g, kind="value" if g == 7 else "key")
    _compare(pt, pj)
    if dtype == F32:  # the stream, independently
        codes, mins, scales = _numpy_codes(x, bits, g)
        _assert_same_bits(to_numpy(pt.codes), _numpy_stream(codes, bits), "numpy stream")
        assert_same_bytes(to_numpy(pt.minimum), mins, "numpy minimum")
        assert_same_bytes(to_numpy(pt.scale), scales, "numpy scale")
        assert_same_bytes(_read_stream(to_numpy(pt.codes), bits), codes, "stream read back")
        top = (2 ** np.asarray(bits) - 1).astype(np.uint8)
        if g == 1:  # one row per group: zero span, codes 0
            assert not codes.any()
        else:  # the full code range is used
            assert (codes == top).any() and (codes == 0).any()


@pytest.mark.thin(2)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
@pytest.mark.parametrize("t", [0, 1])
@pytest.mark.parametrize("table", sorted(TABLES))
def test_no_tokens_and_one_token(table, t, dtype):
    bits = TABLES[table]
    x = _kv(np.random.default_rng(3), _shape(bits, t), dtype)
    for g in (1, 64):
        pj, pt = _pack_both(x, bits, g)
        _compare(pt, pj)
        assert tuple(pt.minimum.shape) == (t, *_shape(bits, t)[1:])  # ceil(t / g) == t
        if t == 1:  # one row per group: span 0, scale 1, codes 0, exact decode
            assert (to_numpy(pt.scale) == 1).all() and not to_numpy(pt.codes).any()


def test_non_contiguous_input():
    bits = TABLES["irregular"]
    x = _kv(np.random.default_rng(4), _shape(bits, 40), BF16)
    _, tc = _codecs(bits)
    view = numpy_to_torch(np.ascontiguousarray(x.transpose(0, 2, 1))).transpose(1, 2)
    assert not view.is_contiguous()
    pt = kt.pack_kv(view, kind="key", format=tc.name, group_size=16)
    _compare(pt, kq.pack_kv(x, kind="key", format=tc.name, group_size=16))


# ------------------------------------------------------------------------------------------
# edge values

#: Four-row patterns, one per (group, head, channel) slot (G = 4).
_PATTERNS = [
    [1.5, 1.5, 1.5, 1.5],  # zero span: scale 1, codes 0
    [0.0, 0.0, 0.0, 0.0],
    [-0.0, -0.0, -0.0, -0.0],  # a zero minimum is stored as +0.0
    [-0.0, 0.0, 1.0, -0.0],
    [0.0, 2.0, -0.0, 1.0],
    [np.inf, 1.0, 2.0, 3.0],  # non-finite groups: NaN metadata, codes 0
    [-np.inf, 1.0, 2.0, 3.0],
    [np.nan, 1.0, 2.0, 3.0],
    [np.inf, -np.inf, 0.0, 0.0],
    [70000.0, -70000.0, 0.0, 1.0],  # float16 overflow of minimum and scale (f16 input: inf)
    [65504.0, 65520.0, 0.0, 1.0],
    [3e38, -3e38, 0.0, 1.0],  # float32 span overflow
    [1e-40, -1e-40, 0.0, 0.0],  # subnormal inputs are flushed
    [65504.0, -65504.0, 0.0, 1.0],  # float16 max: a span of 131008
    [0.0, 1e-6, 2e-6, 3e-6],  # a scale that is float16-subnormal or zero
    [0.0, 1e-7, 0.0, 0.0],
    [1.0, 1.0000001, 1.0, 1.0],
    [-1.0, 0.5, 0.25, 1.0],
    [-3.0, -1.0, -2.0, -1.5],
]


def _edge_tensor(bits, dtype, groups=9, tail=2):
    """[4 * groups + tail, H, D]: the patterns spread over slots; a partial last group."""
    h, d = len(bits), len(bits[0])
    rng = np.random.default_rng(8)
    slots = np.resize(np.arange(len(_PATTERNS)), groups * h * d)
    rng.shuffle(slots)
    x = np.asarray(_PATTERNS, np.float32)[slots]  # [slots, 4]
    x = x.reshape(groups, h, d, 4).transpose(0, 3, 1, 2).reshape(4 * groups, h, d)
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.concatenate([x, x[:tail] * np.float32(-2)])  # the partial group: 2 rows
        return x.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("table", ["irregular", "mixed", "all8"])
def test_edge_values(table, dtype):
    bits = TABLES[table]
    x = _edge_tensor(bits, dtype)
    pj, pt = _pack_both(x, bits, 4)
    _compare(pt, pj, f"edge {table}")
    minimum = to_numpy(pt.minimum).astype(np.float32)
    scale = to_numpy(pt.scale).astype(np.float32)
    assert not np.signbit(minimum[minimum == 0]).any()  # +0.0, never -0.0
    assert np.isnan(scale).any() and (scale == 1).any() and (scale == 0).any()
    assert np.isnan(minimum).sum() == np.isnan(scale).sum()
    if dtype != F16:  # the f16 cast of the metadata overflows (f16 inputs are inf already)
        assert np.isinf(scale).any() and np.isinf(minimum).any()
    decoded = to_numpy(kt.unpack_kv(pt, dtype=F32))
    assert np.isnan(decoded).any() and (dtype == F16 or np.isinf(decoded).any())


# ------------------------------------------------------------------------------------------
# equal tables, equal formats


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", [1, 7, 64])
def test_all4_is_int4_and_all2_is_int2(g, dtype):
    for bits, fmt, d in ((TABLES["all4"], "int4", 6), ([[2] * 8] * 2, "int2", 8)):
        x = _kv(np.random.default_rng(g), (71, 2, d), dtype)
        x[5, 0, :] = np.nan
        _, tc = _codecs(bits)
        t = numpy_to_torch(x)
        pt = kt.pack_kv(t, kind="value", format=tc.name, group_size=g)
        ref = kt.pack_kv(t, kind="value", format=fmt, group_size=g, axis="tokens")
        for name in ("codes", "minimum", "scale"):
            assert_same_bytes(to_numpy(getattr(pt, name)), to_numpy(getattr(ref, name)), name)
        assert_same_values(to_numpy(kt.unpack_kv(pt)), to_numpy(kt.unpack_kv(ref)), fmt)


# ------------------------------------------------------------------------------------------
# errors, names, exports


@pytest.mark.parametrize(
    "shape, kwargs",
    [
        ((8, 2, 8), {}),  # D differs from the table's
        ((8, 3, 7), {}),  # H differs
        ((8, 2, 7), dict(axis="channels")),
        ((8, 2, 7), dict(group_size=0)),
        ((8, 2, 7), dict(group_size=-3)),
        ((8, 2, 7), dict(group_size=2.5)),
        ((8, 2, 7), dict(group_size=True)),
        ((8, 2, 7), dict(kind="query")),
    ],
    ids=str,
)
def test_bad_arguments_raise_the_same_in_both_stacks(shape, kwargs):
    _, tc = _codecs(TABLES["irregular"])
    x = np.ones(shape, np.float32)
    args = {"kind": "key", "format": tc.name, **kwargs}
    with pytest.raises((ValueError, TypeError)) as jax_error:
        kq.pack_kv(x, **args)
    with pytest.raises((ValueError, TypeError)) as torch_error:
        kt.pack_kv(numpy_to_torch(x), **args)
    assert type(jax_error.value) is type(torch_error.value)
    assert str(jax_error.value) == str(torch_error.value)


@pytest.mark.parametrize(
    "bits", [[[1, 2]], [[4, 4], [8]], [[9, 7]], [[0, 8]], [], [[4.0, 4.0]], "44"], ids=str
)
def test_bad_tables_raise_the_same_in_both_stacks(bits):
    with pytest.raises((ValueError, TypeError)) as jax_error:
        kq.IntBCodec(bits)
    with pytest.raises((ValueError, TypeError)) as torch_error:
        kt.IntBCodec(bits)
    assert type(jax_error.value) is type(torch_error.value)
    assert str(jax_error.value) == str(torch_error.value)


def test_exports_names_and_no_default_registration():
    assert "IntBCodec" in kt.__all__ and "IntBCodec" in kq.__all__
    assert kt.IntBCodec is tintb.IntBCodec and kq.IntBCodec is jintb.IntBCodec
    bits = [[2, 6, 3, 5]]
    name = intb_name(bits)
    assert kt.IntBCodec(bits).name == kq.IntBCodec(bits).name == name
    assert kt.IntBCodec(bits, name="mine").name == "mine"
    assert name not in kt.CODECS and name not in kq.CODECS  # never registered by default
    with pytest.raises(ValueError, match="format must be one of"):
        kt.pack_kv(torch.ones(2, 1, 4), kind="key", format=name)


# ------------------------------------------------------------------------------------------
# the DLPack bridge


def test_dlpack_bridge_moves_intb_both_ways():
    bits = TABLES["mixed"]
    x = _kv(np.random.default_rng(9), _shape(bits, 37), BF16)
    pj, pt = _pack_both(x, bits, 8)
    to_t = kt.to_torch(pj)
    assert type(to_t) is kt.PackedKV and to_t.format == pj.format
    for name in ("codes", "minimum", "scale"):  # JAX -> Torch always shares
        assert getattr(to_t, name).data_ptr() == getattr(pj, name).unsafe_buffer_pointer()
    _compare(to_t, pj, "to_torch")
    with warnings.catch_warnings():  # a CPU buffer off 64-byte alignment is copied, warned
        warnings.simplefilter("ignore", kt.CopyWarning)
        to_j = kt.from_torch(pt)
    assert type(to_j) is kq.PackedKV
    _compare(pt, to_j, "from_torch")


# ------------------------------------------------------------------------------------------
# planted defects: the comparisons above must catch them


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_planted_defect_one_flipped_bit_is_caught():
    bits = TABLES["irregular"]
    x = _kv(np.random.default_rng(10), _shape(bits, 20), F32)
    pj, pt = _pack_both(x, bits, 7)
    codes = pt.codes.clone()
    codes[13, 1, 2] ^= 0x10  # one stream bit of one row
    _compare(dataclasses.replace(pt, codes=codes), pj)


class _MsbFirstCodec(kt.IntBCodec):
    """A wrong variant: each code's bits written most significant first."""

    def stream_maps(self):
        channel, bit = super().stream_maps()
        widths = np.asarray(self.bits)[np.arange(len(self.bits))[:, None], channel]
        return channel, (widths - 1 - bit).astype(np.int32)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_planted_defect_msb_first_codes_are_caught():
    bits = TABLES["mixed"]
    x = _kv(np.random.default_rng(11), _shape(bits, 20), F32)
    pj, _ = _pack_both(x, bits, 7)
    wrong = _MsbFirstCodec(bits).pack(numpy_to_torch(x), kind="key", axis="tokens", group_size=7)
    _compare(wrong, pj)


# ------------------------------------------------------------------------------------------
# the scalar oracle (one small case; the oracle's own checks live with it)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_torch_equals_the_oracle(dtype):
    from kvq_jax import oracle

    bits = TABLES["mixed"]
    x = _kv(np.random.default_rng(12), _shape(bits, 11), np.float32)
    x[2, 0, 1], x[3, 1, :] = np.nan, 0.0  # a NaN group; zero-span rows in a group
    x[8, 2, 4] = -7e4  # float16 overflow of the minimum
    x = x.astype(dtype)
    expected = oracle.pack(x, format="intb", kind="key", bits=bits, group_size=4)
    _, tc = _codecs(bits)
    pt = kt.pack_kv(numpy_to_torch(x), kind="key", format=tc.name, group_size=4)
    assert set(expected.arrays) == {"codes", "minimum", "scale"}
    for name, array in expected.arrays.items():
        assert_same_bytes(to_numpy(getattr(pt, name)), array, f"oracle {name}")
    for dt in (dtype, F32):
        got = to_numpy(kt.unpack_kv(pt, dtype=dt))
        assert_same_values(got, oracle.unpack(expected, dt), f"oracle decoded as {dt}")


@pytest.mark.slow
def test_torch_compile_same_bytes():
    """pack + unpack under torch.compile (inductor) give the eager bytes (partial groups)."""
    bits = TABLES["irregular"]
    _, tc = _codecs(bits)
    x = _edge_tensor(bits, BF16)

    def run(x):
        p = kt.pack_kv(x, kind="key", format=tc.name, group_size=7)
        return p, kt.unpack_kv(p, torch.float32)

    torch._dynamo.reset()
    (p, u), (pc, uc) = run(numpy_to_torch(x)), torch.compile(run)(numpy_to_torch(x))
    for name in ("codes", "minimum", "scale"):
        assert_same_bytes(to_numpy(getattr(pc, name)), to_numpy(getattr(p, name)), name)
    assert_same_values(to_numpy(uc), to_numpy(u), "compiled decode")
