"""INTB (docs/FORMAT.md section 2b): the scalar oracle, and the JAX codec judged against it.

The oracle (`kvq_jax.oracle.intb`) is checked against hand-worked bytes, against the INT4 and
INT2 oracles (a table of all 4s / all 2s is those formats byte for byte) and against an
integer re-derivation of the bit stream. The jitted JAX codec (`kvq_jax.codecs.formats.intb`) is
then compared with the oracle byte for byte (codes, minimum, scale as raw bits) and on decoded
values (NaN matches NaN), over input dtypes, several tables, group sizes and edge cases. A
planted defect (strict xfail) shows that the comparison can fail; bad tables raise errors
naming `bits`.
"""

from __future__ import annotations

import ast
import pathlib

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_bytes, assert_same_values

import kvq_jax
from kvq_jax import oracle
from kvq_jax.oracle import affine, intb, scalar

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = (F32, F16, BF16)

#: Tables used against the JAX codec (H = 2 unless noted; every row sums to 8 W).
#: Irregular widths 1..8, codes straddling bytes (row 0: channel 3 at stream bits 11..18).
IRREG = ((1, 7, 3, 8, 2, 3), (8, 8, 1, 1, 3, 3))  # W = 3
#: One head, every code but the last straddles or ends mid-byte (offsets 0, 5, 11, 18, 22).
IRREG_H1 = ((5, 6, 7, 4, 2),)  # W = 3
ALL8 = ((8, 8, 8), (8, 8, 8))  # W = 3
ALL1 = ((1,) * 8, (1,) * 8)  # W = 1
TABLES = {"irreg": IRREG, "irreg_h1": IRREG_H1, "all8": ALL8, "all1": ALL1}


def _kv(rng, shape, dtype, spread=3.0):
    """Random K/V-like values: a per-(head, channel) offset and scale plus noise."""
    _, n_heads, n_channels = shape
    offset = spread * rng.standard_normal((1, n_heads, n_channels))
    size = np.exp(rng.standard_normal((1, n_heads, n_channels)))
    x = offset + size * rng.standard_normal(shape)
    return x.astype(np.float32).astype(dtype)


# ------------------------------------------------------------------------------------------
# the oracle on its own


def test_hand_worked_example():
    # T = 3, H = 1, D = 3, bits (3, 8, 5): W = 16 / 8 = 2 bytes per token; one group per
    # channel (G = 64 > T). Stream offsets o = (0, 3, 11): channel 0 at bits 0-2, channel 1
    # at bits 3-10 (straddles bytes 0 and 1), channel 2 at bits 11-15.
    x = np.array(
        [
            [[7.0, 10.0, -0.75]],
            [[0.0, 137.5, -1.0]],
            [[3.5, 74.25, 0.0]],
        ],
        np.float32,
    )
    enc = oracle.pack(x, format="intb", kind="key", bits=((3, 8, 5),))
    # channel 0: L = 2**3 - 1 = 7; mn = 0, mx = 7, span 7, scale = 7 / 7 = 1;
    #   q = 7, 0, 3.5 -> codes 7, 0, 4 (3.5 ties to even 4).
    #   minimum f16(+0) = 0x0000, scale f16(1) = 0x3C00.
    # channel 1: L = 255; mn = 10, mx = 137.5, span 127.5, scale = 127.5 / 255 = 0.5 (exact);
    #   q = 0, 255, (74.25 - 10) / 0.5 = 128.5 -> codes 0, 255, 128 (ties to even).
    #   minimum f16(10) = 1.25 * 2**3: exponent 3 + 15 = 0b10010, mantissa 0.25 * 1024 = 256
    #   -> 0 10010 0100000000 = 0x4900; scale f16(0.5) = 0x3800.
    # channel 2: L = 31; mn = -1, mx = 0, span 1, scale = f32(1 / 31) = 0.0322580...;
    #   q(-0.75) = 0.25 / scale = 7.75 (to ~1e-7) -> 8; q(-1) = 0; q(0) = 1 / scale = 31
    #   (to ~1e-7; clamped to 31 either way) -> codes 8, 0, 31.
    #   minimum f16(-1) = 0xBC00; scale: 1/31 = 2**-5 * 1.0322580..., mantissa
    #   0.0322580 * 1024 = 33.03 -> 33 (no tie near): 0 01010 0000100001 = 0x2821.
    # stream per token, as an integer c0 | c1 << 3 | c2 << 11, bytes little-endian:
    #   t0: 7 | 0 | 8 << 11 = 7 + 16384 = 0x4007 -> [0x07, 0x40]
    #   t1: 0 | 255 << 3 | 0 = 2040 = 0x07F8 -> [0xF8, 0x07]   (channel 1 straddles)
    #   t2: 4 | 128 << 3 | 31 << 11 = 4 + 1024 + 63488 = 0xFC04 -> [0x04, 0xFC]
    assert enc.arrays["codes"].dtype == np.uint8
    assert enc.arrays["codes"].tolist() == [[[0x07, 0x40]], [[0xF8, 0x07]], [[0x04, 0xFC]]]
    assert enc.arrays["minimum"].view(np.uint16).tolist() == [[[0x0000, 0x4900, 0xBC00]]]
    assert enc.arrays["scale"].view(np.uint16).tolist() == [[[0x3C00, 0x3800, 0x2821]]]
    assert enc.bits == ((3, 8, 5),) and enc.axis == "tokens" and enc.group_size == 64
    # decode code * scale16 + minimum16 (all exact here): channel 1 t2: 128 * 0.5 + 10 = 74;
    # channel 2 (scale16 = 1057 / 32768): t0: 8 * 1057 / 32768 - 1 = -3039 / 4096;
    # t2: 31 * 1057 / 32768 - 1 = 32767 / 32768 - 1 = -1 / 32768 (the f16 scale is low).
    want = [[[7.0, 10.0, -3039 / 4096]], [[0.0, 137.5, -1.0]], [[4.0, 74.0, -1 / 32768]]]
    assert oracle.unpack(enc).tolist() == want


def test_hand_worked_partial_group_and_two_heads():
    # T = 3, G = 2: groups tokens {0, 1} and {2} (partial). H = 2, D = 2, bits (1, 7), (4, 4).
    x = np.array([[[1.0, 0.0], [2.0, 5.0]], [[3.0, 127.0], [6.0, 5.0]], [[9.0, 9.0], [9.0, 9.0]]])
    table = ((1, 7), (4, 4))
    enc = oracle.pack(x.astype(np.float32), format="intb", kind="value", bits=table, group_size=2)
    # head 0, channel 0 (L = 1): {1, 3}: scale 2 / 1 = 2, codes 0, 1; channel 1 (L = 127):
    #   {0, 127}: scale 1, codes 0, 127. Head 1 (L = 15 each): channel 0 {2, 6}: scale 4 / 15,
    #   codes 0, 15; channel 1 {5, 5}: span 0 -> scale 1.0, codes 0, 0.
    # Partial group (token 2): every group is {9}: span 0, scale 1, code 0, minimum 9.
    # bytes: h0 t0: 0 | 0 << 1 = 0x00; h0 t1: 1 | 127 << 1 = 0xFF;
    #        h1 t0: 0 | 0 << 4 = 0x00; h1 t1: 15 | 0 << 4 = 0x0F; token 2: 0x00, 0x00.
    assert enc.arrays["codes"].tolist() == [[[0x00], [0x00]], [[0xFF], [0x0F]], [[0], [0]]]
    assert enc.arrays["minimum"].tolist() == [[[1.0, 0.0], [2.0, 5.0]], [[9.0, 9.0], [9.0, 9.0]]]
    # f16(4 / 15) = f16(0.26666...) = 2**-2 * 1.0666...: mantissa 68.27 -> 68: 0x3444
    assert enc.arrays["scale"].view(np.uint16).tolist() == [
        [[0x4000, 0x3C00], [0x3444, 0x3C00]],
        [[0x3C00, 0x3C00], [0x3C00, 0x3C00]],
    ]


def test_bit_stream_against_integer_arithmetic():
    # Independent derivation: the row's stream is the little-endian integer sum(code << o).
    rng = np.random.default_rng(1)
    for table in (*TABLES.values(), ((2, 3, 1, 8, 8, 1, 4, 5),)):
        n_heads, n_channels = len(table), len(table[0])
        shape = (4, n_heads, n_channels)
        codes = [
            int(rng.integers(0, 2 ** table[h][c]))
            for _ in range(4)
            for h in range(n_heads)
            for c in range(n_channels)
        ]
        n_bytes = sum(table[0]) // 8
        want = []
        for t in range(4):
            for h in range(n_heads):
                value, position = 0, 0
                for c in range(n_channels):
                    value += codes[(t * n_heads + h) * n_channels + c] << position
                    position += table[h][c]
                want.extend(value.to_bytes(n_bytes, "little"))
        assert intb.pack_stream(codes, shape, table) == want
        assert intb.unpack_stream(want, shape, table) == codes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [1, 5, 64])
def test_all_4s_is_int4_and_all_2s_is_int2(dtype, group_size):
    rng = np.random.default_rng(group_size)
    for kind in ("key", "value"):
        x = _kv(rng, (11, 2, 6), dtype)
        x[3, 1, 2] = -0.0
        enc = oracle.pack(x, format="intb", kind=kind, bits=((4,) * 6,) * 2, group_size=group_size)
        ref = oracle.pack(x, format="int4", kind=kind, axis="tokens", group_size=group_size)
        assert not oracle.mismatches(ref.arrays, enc.arrays)
        assert not oracle.mismatches(oracle.unpack(ref), oracle.unpack(enc), nan_equal=True)
        x = _kv(rng, (9, 3, 8), dtype)
        enc = oracle.pack(x, format="intb", kind=kind, bits=((2,) * 8,) * 3, group_size=group_size)
        ref = oracle.pack(x, format="int2", kind=kind, axis="tokens", group_size=group_size)
        assert not oracle.mismatches(ref.arrays, enc.arrays)
        assert not oracle.mismatches(oracle.unpack(ref), oracle.unpack(enc), nan_equal=True)


def test_all_4s_is_int4_on_edge_values():
    x = np.array(
        [[[0.0, -0.0, np.inf, 1e9]], [[-0.0, 0.0, 1.0, -1e5]], [[1e-40, 2.5, 3.0, 0.0]]],
        np.float32,
    )
    x = np.concatenate([x, np.full((1, 1, 4), np.nan, np.float32), x[:, :, ::-1]])
    for g in (1, 2, 4):
        enc = oracle.pack(x, format="intb", kind="key", bits=((4, 4, 4, 4),), group_size=g)
        ref = oracle.pack(x, format="int4", kind="key", axis="tokens", group_size=g)
        assert not oracle.mismatches(ref.arrays, enc.arrays)


def test_oracle_api_shapes_defaults_and_empty():
    x = np.zeros((0, 2, 6), BF16)
    enc = oracle.pack(x, format="intb", kind="value", bits=IRREG)
    assert enc.axis == "tokens" and enc.group_size == 64 and enc.bits == IRREG
    spec = oracle.array_spec("intb", x.shape, "tokens", 64, bits=IRREG)
    assert spec == {
        "codes": (np.dtype(np.uint8), (0, 2, 3)),
        "minimum": (F16, (0, 2, 6)),
        "scale": (F16, (0, 2, 6)),
    }
    for name, (dt, shp) in spec.items():
        assert enc.arrays[name].dtype == dt and enc.arrays[name].shape == shp
    out = oracle.unpack(enc)
    assert out.shape == x.shape and out.dtype == BF16
    # list-of-lists and numpy tables are read as the same tuple of tuples
    enc2 = oracle.pack(np.ones((3, 2, 6), F32), format="intb", kind="key", bits=np.array(IRREG))
    assert enc2.bits == IRREG and isinstance(enc2.bits[0][0], int)
    assert oracle.pack(np.ones((3, 2, 6), F32), format="int4", kind="key").bits is None
    assert "intb" not in oracle.FORMATS and oracle.TABLE_FORMATS == ("intb",)


def test_unpack_decodes_foreign_arrays_and_checks_the_table():
    x = _kv(np.random.default_rng(2), (5, 2, 6), F32)
    enc = oracle.pack(x, format="intb", kind="key", bits=IRREG, group_size=2)
    forged = oracle.OraclePacked(**{**vars(enc), "bits": (*ALL8, (8,) * 3)})
    with pytest.raises(ValueError, match="bits"):
        oracle.unpack(forged)
    no_table = oracle.OraclePacked(**{**vars(enc), "bits": None})
    with pytest.raises(TypeError, match="bits"):
        oracle.unpack(no_table)
    # the same bytes under another table of the same W decode to other values
    other = ((7, 1, 3, 8, 2, 3), (8, 8, 1, 1, 3, 3))
    assert not np.array_equal(
        oracle.unpack(oracle.OraclePacked(**{**vars(enc), "bits": other})), oracle.unpack(enc)
    )


def test_oracle_intb_source_is_plain_python():
    # the oracle rules (kvq_jax/oracle/__init__.py): no JAX, no numpy, only oracle imports
    tree = ast.parse(pathlib.Path(intb.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] in {"math", "numbers"} for a in node.names)
        if isinstance(node, ast.ImportFrom):
            assert node.module in {"__future__", "kvq_jax.oracle", "kvq_jax.oracle.scalar"}
        if isinstance(node, ast.Attribute):
            assert node.attr not in {"astype", "round", "rint", "clip", "view"}, node.attr


# ------------------------------------------------------------------------------------------
# bad input


BAD_TABLES = [
    pytest.param(((0, 8, 8),), ValueError, id="width-0"),
    pytest.param(((9, 7, 8),), ValueError, id="width-9"),
    pytest.param(((4, 4, 8), (8, 8, 8)), ValueError, id="unequal-row-sums"),
    pytest.param(((4, 4, 4),), ValueError, id="sum-not-multiple-of-8"),
    pytest.param(((8, 8), (8, 8, 8)), ValueError, id="ragged"),
    pytest.param((), ValueError, id="empty"),
    pytest.param(((4.0, 4, 8),), TypeError, id="float-width"),
    pytest.param(((True, 7, 8),), TypeError, id="bool-width"),
    pytest.param(("488",), TypeError, id="string-row"),
    pytest.param(8, TypeError, id="not-a-table"),
    pytest.param(((8, 8, 8),), ValueError, id="wrong-H"),  # values have H = 2
    pytest.param(((8, 8), (8, 8)), ValueError, id="wrong-D"),  # values have D = 3
]


@pytest.mark.parametrize(("table", "error"), BAD_TABLES)
def test_bad_tables_raise_naming_bits(table, error):
    x = np.ones((4, 2, 3), F32)
    with pytest.raises(error, match="bits"):
        oracle.pack(x, format="intb", kind="key", bits=table)
    with pytest.raises(error, match="bits"):
        oracle.array_spec("intb", x.shape, "tokens", 64, bits=table)


def test_bad_arguments_raise_naming_them():
    x = np.ones((4, 2, 3), F32)
    with pytest.raises(TypeError, match="bits"):
        oracle.pack(x, format="intb", kind="key")
    with pytest.raises(ValueError, match="bits"):
        oracle.pack(x, format="int4", kind="key", bits=ALL8)
    with pytest.raises(ValueError, match="axis"):
        oracle.pack(x, format="intb", kind="key", axis="channels", bits=ALL8)
    with pytest.raises(ValueError, match="group_size"):
        oracle.pack(x, format="intb", kind="key", group_size=0, bits=ALL8)
    with pytest.raises(TypeError, match="group_size"):
        oracle.pack(x, format="intb", kind="key", group_size=2.0, bits=ALL8)
    with pytest.raises(ValueError, match="kind"):
        oracle.pack(x, format="intb", kind="query", bits=ALL8)
    assert oracle.pack(x, format="intb", kind="value", axis="tokens", bits=ALL8).axis == "tokens"
    with pytest.raises(ValueError, match="axis"):
        oracle.array_spec("intb", x.shape, "channels", 64, bits=ALL8)


# ------------------------------------------------------------------------------------------
# the JAX codec against the oracle


@pytest.fixture(scope="module")
def codecs():
    """One registered `IntBCodec` per table (name by table); unregistered afterwards."""
    from kvq_jax.codecs.formats.intb import IntBCodec

    names, added = {}, []
    for key, table in TABLES.items():
        codec = IntBCodec(table)
        try:
            kvq_jax.get_codec(codec.name)
        except ValueError:
            kvq_jax.register_codec(codec)
            added.append(codec.name)
        names[key] = codec.name
    yield names
    for name in added:
        kvq_jax.unregister_codec(name)


def check(x, table, name, group_size, out_dtypes=None, what=""):
    """Pack `x` with the oracle and with the registered codec `name`; every stored array and
    the decoded values (input dtype and float32) must agree. Returns the oracle's encoding."""
    what = what or f"{name} {np.dtype(x.dtype)} {x.shape} G={group_size}"
    expected = oracle.pack(x, format="intb", kind="key", bits=table, group_size=group_size)
    packed = kvq_jax.pack_kv(x, kind="key", format=name, group_size=group_size)
    assert packed.format == name, what
    assert (packed.kind, packed.axis, packed.group_size) == ("key", "tokens", group_size), what
    assert tuple(packed.shape) == x.shape and np.dtype(packed.dtype) == x.dtype, what
    assert set(packed.arrays) == set(expected.arrays), what
    for field, array in expected.arrays.items():
        assert_same_bytes(np.asarray(packed.arrays[field]), array, f"{what}: {field}")
    for dt in out_dtypes or (np.dtype(x.dtype), F32):
        got = np.asarray(kvq_jax.unpack_kv(packed, dtype=dt))
        assert_same_values(got, oracle.unpack(expected, dt), f"{what}: decoded as {dt}")
    return expected


GRID = [
    pytest.param(key, dt, g, id=f"{key}-{dt}-G{g}")
    for key in TABLES
    for dt in DTYPES
    for g in (1, 7, 64)
]


@pytest.mark.thin(2)
@pytest.mark.parametrize(("key", "dtype", "group_size"), GRID)
def test_codec_matches_oracle_random(codecs, key, dtype, group_size):
    table = TABLES[key]
    rng = np.random.default_rng([len(key), DTYPES.index(dtype), group_size])
    # T = 15: G = 7 leaves a partial group of 1 token, G = 64 one partial group of 15
    x = _kv(rng, (15, len(table), len(table[0])), dtype)
    check(x, table, codecs[key], group_size)


def _edge_tensor(dtype):
    """T = 8, H = 2, D = 6 (table IRREG), G = 4: groups (token block i, head h, channel c)
    each holding one case; the second token block is random."""
    x = _kv(np.random.default_rng(3), (8, 2, 6), F32).astype(np.float64)
    cases = {
        (0, 0): [1.5, 1.5, 1.5, 1.5],  # zero span: scale 1, codes 0 (1 bit)
        (0, 1): [-0.0, 0.0, -0.0, 0.0],  # all zeros of both signs: minimum +0
        (0, 2): [-0.0, 0.0, 1.0, 0.5],  # -0.0 and +0.0 with others (3 bits, 0.5 * 7 = 3.5)
        (0, 3): [1.0, np.inf, 2.0, 3.0],  # inf: minimum = scale = NaN, codes 0
        (0, 4): [np.nan, 1.0, 2.0, 3.0],  # NaN
        (0, 5): [-np.inf, 1.0, 2.0, 3.0],  # -inf
        (1, 0): [-1e5, 1e9, 0.0, 5.0],  # minimum and scale overflow f16 (inf in f16 input)
        (1, 1): [7e4, 7.2e4, 7.1e4, 7.3e4],  # minimum overflows f16, scale finite
        (1, 2): [0.0, 1e8, 5e7, 2.5e7],  # scale overflows f16 (1 bit: span / 1)
        (1, 3): [1e-40, -1e-40, 2e-38, 0.0],  # subnormals flush on entry (f32, bf16)
        (1, 4): [0.0, 7.0, 2.5, 3.5],  # ties: L = 7, q = 2.5 -> 2, 3.5 -> 4
        (1, 5): [65504.0, -65504.0, 0.0, 1.0],  # span 131008: scale 131008 / 7 < 65504
    }
    for (h, c), values in cases.items():
        x[:4, h, c] = values
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_codec_matches_oracle_edge_cases(codecs, dtype):
    x = _edge_tensor(dtype)
    enc = check(x, IRREG, codecs["irreg"], 4, out_dtypes=DTYPES)
    minimum = enc.arrays["minimum"].view(np.uint16)
    scale = enc.arrays["scale"].view(np.uint16)
    # the cases still hit what they were written for (the oracle's own reading of 2b)
    assert minimum[0, 0, 1] == 0x0000 and minimum[0, 0, 2] == 0x0000  # +0.0 minimum
    assert scale[0, 0, 0] == 0x3C00 and scale[0, 0, 1] == 0x3C00  # zero span: 1.0
    for c in (3, 4, 5):
        assert minimum[0, 0, c] == 0x7E00 and scale[0, 0, c] == 0x7E00
    if dtype != F16:  # (float16 input holds inf there instead: those groups are NaN)
        assert minimum[0, 1, 1] == 0x7C00  # 7e4 > 65504
        assert scale[0, 1, 0] == 0x7C00 and scale[0, 1, 2] == 0x7C00
    decoded = oracle.unpack(enc, F32)
    assert np.isnan(decoded[:4, 0, 3:]).all() and not np.isnan(decoded[:4, 0, :3]).any()


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("key", ["irreg", "all1"])
def test_codec_matches_oracle_small_t(codecs, key, dtype):
    table = TABLES[key]
    n_heads, n_channels = len(table), len(table[0])
    check(np.zeros((0, n_heads, n_channels), dtype), table, codecs[key], 64)  # T = 0
    x = _kv(np.random.default_rng(4), (1, n_heads, n_channels), dtype)
    check(x, table, codecs[key], 64)  # T = 1: every group spans zero
    check(x, table, codecs[key], 1)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_planted_defect_one_flipped_code_bit_is_caught(codecs):
    x = _kv(np.random.default_rng(5), (6, 2, 6), F32)
    expected = oracle.pack(x, format="intb", kind="key", bits=IRREG, group_size=3)
    packed = kvq_jax.pack_kv(x, kind="key", format=codecs["irreg"], group_size=3)
    codes = np.array(packed.arrays["codes"])
    codes[2, 1, 1] ^= 0x10  # one stream bit of head 1 (channel 1's bit 4)
    assert_same_bytes(codes, expected.arrays["codes"], "codes")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_planted_defect_msb_first_stream_is_caught(codecs, monkeypatch):
    # an oracle that writes each code most significant bit first must disagree with the codec
    def msb_first(codes, shape, bits):
        reversed_codes = []
        _, n_heads, n_channels = shape
        for e, code in enumerate(codes):
            width = bits[(e // n_channels) % n_heads][e % n_channels]
            reversed_codes.append(int(format(code, f"0{width}b")[::-1], 2))
        return original(reversed_codes, shape, bits)

    original = intb.pack_stream
    monkeypatch.setattr(intb, "pack_stream", msb_first)
    check(_kv(np.random.default_rng(6), (6, 1, 5), F32), IRREG_H1, codecs["irreg_h1"], 3)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_planted_defect_2_to_the_b_levels_is_caught(codecs, monkeypatch):
    # an oracle that divides the span by 2**b instead of 2**b - 1 must disagree with the codec
    def wrong_levels(xs, levels):  # levels = 2**b - 1
        codes, min_bits, _ = original(xs, levels)
        mn, mx = min(xs), max(xs)
        span = scalar.sub(mx, 0.0 if mn == 0.0 else mn)
        scale = scalar.div(span, float(levels + 1)) if span > 0.0 else 1.0
        return codes, min_bits, scalar.f16_bits(scale)

    original = affine.encode_group
    monkeypatch.setattr(affine, "encode_group", wrong_levels)
    check(_kv(np.random.default_rng(7), (6, 2, 6), F32), IRREG, codecs["irreg"], 3)


def test_stream_reader_every_start_offset_against_the_oracle():
    """`unpack_stream` (32-bit words, picked by selects) reads the oracle's codes for codes of
    1..8 bits starting at every bit offset modulo 32, 8-bit codes straddling word boundaries,
    the last code ending on the row's last bit, and rows of W = 9 and 18 bytes (not whole
    words): random bytes, tables static and traced. Reading each code from its low word
    alone (a reader that drops the straddling bits) is caught."""
    import jax
    import jax.numpy as jnp

    from kvq_jax.codecs.formats.intb import _pick, _words, unpack_stream
    from kvq_jax.core.layouts import IntBLayout

    rng = np.random.default_rng(11)
    offsets = set()
    for widths in ([8, 7, 6, 5, 4, 3, 2, 1, 8, 7, 6, 5, 4, 3, 1, 2], list(range(1, 9)) * 4):
        for _ in range(6):
            table = tuple(tuple(int(w) for w in rng.permutation(widths)) for _ in range(3))
            starts, bits = IntBLayout(table).code_starts()
            offsets.update((starts % 32).ravel().tolist())
            shape = (5, 3, len(widths))
            w = intb.row_bytes(table)
            payload = rng.integers(0, 256, (5, 3, w), dtype=np.uint8)
            want = np.array(intb.unpack_stream(payload.ravel().tolist(), shape, table))
            got = unpack_stream(jnp.asarray(payload), starts, bits)
            traced = jax.jit(unpack_stream)(jnp.asarray(payload), starts, bits)
            for out in (got, traced):
                np.testing.assert_array_equal(np.asarray(out).ravel(), want)
            low = _pick(_words(jnp.asarray(payload)), jnp.asarray(starts // 32))
            low_only = (low >> (starts % 32).astype(np.uint32)) & ((1 << bits) - 1)
            assert (np.asarray(low_only).ravel() != want).any(), table
    assert offsets == set(range(32))  # every start offset within a word was read
