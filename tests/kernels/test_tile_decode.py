"""In-kernel tile decoder (kvq_jax.kernels._tile_decode): one (page, head) tile decoded inside a
Pallas kernel equals the XLA codec's float32 `unpack` of that page, sliced to the head, bit for
bit (NaNs as NaN); `add_in_dtype_tile` equals `_numerics.add_in_dtype`.

- `TileDecodeBase` runs per mode (subclasses: plain XLA ops outside a kernel, Pallas
  interpret mode): every format, INT4 groups along tokens (G 1, 4, 16) and channels (G 16,
  64), INT2 along both axes, HINT4 / HINT2 (the rotated rows), NVFP4 along both axes, FP8;
  E4M3 arrays passed as uint8 bits and as float8; data with
  signed zeros, tiny and subnormal values, large values, and NaN.
- `unrotate_tile` (HINT rows un-rotated in a kernel) against the plain-Python oracle.
- `e4m3_to_f32` over all 256 codes.
- The non-interpret single-tile kernels lower for CUDA (Triton IR), on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_bytes, assert_same_values
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvq_jax import pack_kv, unpack_kv
from kvq_jax.codecs._numerics import add_in_dtype
from kvq_jax.codecs.registry import get_codec
from kvq_jax.kernels import _tile_decode
from kvq_jax.kernels._tile_decode import FIELDS
from kvq_jax.kernels.jax_compat import lower_for_gpu

HEADS, HEAD = 2, 1  # tiles are cut from head 1 of a 2-head page

# (format, axis, group size, page_size, head_dim, E4M3 arrays as float8 instead of bits)
CASES = [
    ("int4", "tokens", 16, 16, 64, False),
    ("int4", "tokens", 4, 32, 128, False),
    ("int4", "tokens", 1, 16, 64, False),
    ("int4", "channels", 64, 16, 64, False),
    ("int4", "channels", 16, 64, 128, False),
    ("int2", "tokens", 16, 16, 64, False),
    ("int2", "tokens", 1, 32, 128, False),
    ("int2", "channels", 32, 16, 64, False),
    ("hint4", "channels", 64, 16, 64, False),
    ("hint2", "channels", 32, 32, 128, False),
    ("nvfp4", "tokens", 16, 32, 64, False),
    ("nvfp4", "channels", 16, 16, 128, True),
    ("nvfp4", "channels", 16, 64, 64, False),
    ("fp8_e4m3", "channels", 64, 16, 64, False),
    ("fp8_e4m3", "channels", 128, 32, 128, True),
]
CASE_IDS = ["-".join(str(c) for c in case[:5]) + ("-f8" if case[5] else "") for case in CASES]
DATA = ("normal", "edge", "nan")


def make_page(ps: int, d: int, data: str, dtype=np.float32, seed: int = 0) -> np.ndarray:
    """[ps, HEADS, D]: normal values; "edge": signed-zero rows, tiny (1e-30, 1e-37) rows,
    subnormals, x1e4 rows; "nan": one NaN in head 1."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ps, HEADS, d)).astype(np.float32)
    if data == "edge":
        x[: ps // 4] = np.where(rng.random((ps // 4, HEADS, d)) < 0.5, -0.0, 0.0)
        x[ps // 4 : ps // 2] *= np.float32(1e-30)
        x[ps // 2, :, ::3] = np.float32(1e-37)
        x[ps // 2 + 1, :, ::4] = np.float32(2e-39)  # subnormal
        x[-2:] *= np.float32(1e4)
    elif data == "nan":
        x[ps // 3, HEAD, d // 2 + 1] = np.nan
    return x.astype(dtype)


def tile_arrays(packed, fmt: str, as_float8: bool) -> list:
    """The packed page's arrays in FIELDS order, E4M3 ones as uint8 bits unless as_float8."""
    out = []
    for field in FIELDS[fmt]:
        a = getattr(packed, field)
        if a.dtype == jnp.float8_e4m3fn and not as_float8:
            a = jax.lax.bitcast_convert_type(a, jnp.uint8)
        out.append(a)
    return out


def slice_head(fmt: str, field: str, a):
    if field == "global_scale":
        return a
    if fmt == "fp8_e4m3" and field == "scale":
        return a[:, HEAD]
    return a[:, HEAD, :]


def triton_params(interpret: bool):
    """Non-interpret calls must name the Triton backend (the default is Mosaic GPU)."""
    return None if interpret else pltriton.CompilerParams(num_warps=2, num_stages=1)


def tile_kernel(fmt, axis, group, ps, d, *, interpret: bool):
    """A single-program pallas_call: whole-page refs in, head HEAD's decoded tile out."""

    def kernel(*refs):
        *in_refs, out_ref = refs
        arrays = {
            field: slice_head(fmt, field, ref if field != "global_scale" else ref[...])
            for field, ref in zip(FIELDS[fmt], in_refs, strict=True)
        }
        out_ref[...] = _tile_decode.decode_tile(fmt, axis, group, arrays, interpret=interpret)

    def call(*arrays):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((ps, d), jnp.float32),
            interpret=interpret,
            compiler_params=triton_params(interpret),
        )(*arrays)

    return jax.jit(call)


def outside_kernel(fmt, axis, group):
    """The same decoder on plain arrays (XLA ops, no kernel)."""

    def call(*arrays):
        tile = {f: slice_head(fmt, f, a) for f, a in zip(FIELDS[fmt], arrays, strict=True)}
        return _tile_decode.decode_tile(fmt, axis, group, tile, interpret=True)

    return jax.jit(call)


@functools.cache
def packed_page(fmt, axis, group, ps, d, data):
    kind = "key" if axis == "tokens" else "value"
    x = make_page(ps, d, data)
    packed = pack_kv(x, kind=kind, format=fmt, axis=axis, group_size=group)
    if fmt in _tile_decode.ROTATED:  # tiles of rotated formats stay rotated
        expected = np.asarray(get_codec(fmt).unpack_rotated(packed))[:, HEAD]
    else:
        expected = np.asarray(unpack_kv(packed, np.float32))[:, HEAD]
    return packed, expected


class TileDecodeBase:
    mode: str

    def decoder(self, fmt, axis, group, ps, d):
        if self.mode == "xla":
            return outside_kernel(fmt, axis, group)
        return tile_kernel(fmt, axis, group, ps, d, interpret=True)

    @pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
    def test_decode_tile_matches_unpack(self, case):
        fmt, axis, group, ps, d, as_float8 = case
        fn = self.decoder(fmt, axis, group, ps, d)
        for data in DATA:
            packed, expected = packed_page(fmt, axis, group, ps, d, data)
            got = fn(*tile_arrays(packed, fmt, as_float8))
            assert got.dtype == jnp.float32 and got.shape == (ps, d)
            assert_same_values(got, expected, f"{fmt} {axis} G{group} {data}")
            if data == "nan":
                assert np.isnan(expected).any()

    @pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
    def test_add_in_dtype_tile(self, dtype):
        rng = np.random.default_rng(1)
        ps, d = 16, 64
        prev = (rng.standard_normal((ps, d)) * 10.0 ** rng.integers(-40, 6, (ps, d))).astype(
            np.float32
        )
        delta = (rng.standard_normal((ps, d)) * 10.0 ** rng.integers(-40, 6, (ps, d))).astype(
            np.float32
        )
        prev[0] = -0.0
        delta[0, ::2] = -0.0
        delta[1] = -prev[1]  # exact cancellation: +0
        prev[2, 3], delta[2, 4] = np.nan, np.inf
        prev[3] = np.float32(60000.0)
        delta[3] = np.float32(6000.0)  # fp16 overflow
        with np.errstate(over="ignore"):  # fp16: the large rows overflow to inf, as they should
            prev = prev.astype(dtype)
            expected = add_in_dtype(prev, delta.astype(dtype))

        def body(p, q):
            return _tile_decode.add_in_dtype_tile(p, q, dtype, interpret=True)

        if self.mode == "xla":
            got = jax.jit(body)(prev, delta)
        else:

            def kernel(p_ref, q_ref, o_ref):
                o_ref[...] = body(p_ref[...], q_ref[...])

            got = pl.pallas_call(
                kernel, out_shape=jax.ShapeDtypeStruct((ps, d), dtype), interpret=True
            )(prev, delta)
        assert_same_values(got, expected, f"add_in_dtype_tile {np.dtype(dtype)}")

    @pytest.mark.parametrize("d", [1, 2, 8, 64, 128])
    def test_unrotate_tile_is_the_oracles(self, d):
        """`unrotate_tile` of every row equals the plain-Python oracle's Rinv (FORMAT.md 2c),
        bit for bit: rows whose sums cancel to signed zeros or fall subnormal (flushed), that
        overflow to inf, that hold NaN, across magnitudes 1e-38 .. 1e38."""
        rng = np.random.default_rng(d)
        rows = 8
        y = rng.standard_normal((rows, d)) * 10.0 ** rng.integers(-38, 3, (rows, d))
        y = y.astype(np.float32)
        y[0] = np.float32(3e-38) * np.where(np.arange(d) % 2, 1.0, -1.0)  # subnormal sums
        y[1] = np.float32(-0.0)
        y[2] = np.float32(3e38)  # overflows to inf from D = 2
        y[3, d // 2] = np.nan
        y[4, :] = np.float32(1.5)  # cancels to signed zeros
        from kvq_jax.oracle import hadamard as oracle

        expected = np.asarray(oracle.unrotate(y.reshape(-1).tolist(), (rows, 1, d)), np.float32)

        def body(x):
            return _tile_decode.unrotate_tile(x, interpret=True)

        if self.mode == "xla":
            got = jax.jit(body)(y)
        else:

            def kernel(x_ref, o_ref):
                o_ref[...] = body(x_ref[...])

            got = pl.pallas_call(
                kernel, out_shape=jax.ShapeDtypeStruct(y.shape, jnp.float32), interpret=True
            )(y)
        assert_same_values(got, expected.reshape(y.shape), f"unrotate_tile D {d}")


class TestOutsideKernel(TileDecodeBase):
    mode = "xla"


class TestPallasInterpret(TileDecodeBase):
    mode = "pallas_interpret"


def test_e4m3_to_f32_every_code():
    bits = np.arange(256, dtype=np.uint8)
    expected = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    from_bits = jax.jit(_tile_decode.e4m3_to_f32)(bits)
    from_f8 = jax.jit(_tile_decode.e4m3_to_f32)(bits.view(ml_dtypes.float8_e4m3fn))
    assert_same_values(from_bits, expected, "e4m3 from bits")
    assert_same_bytes(from_f8, from_bits, "e4m3 from float8")
    assert np.isnan(np.asarray(from_bits)[[0x7F, 0xFF]]).all()


def test_unknown_format():
    with pytest.raises(ValueError, match="format must be one of"):
        _tile_decode.decode_tile("int3", "tokens", 16, {}, interpret=True)
    with pytest.raises(ValueError, match="group_size must be 16"):
        _tile_decode.decode_tile("nvfp4", "tokens", 32, {}, interpret=True)
    with pytest.raises(ValueError, match="axis must be"):
        _tile_decode.expand_groups(jnp.zeros((2, 2)), "rows", 2)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_tile_kernel_lowers_for_cuda(case):
    fmt, axis, group, ps, d, as_float8 = case
    packed, _ = packed_page(fmt, axis, group, ps, d, "normal")
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in tile_arrays(packed, fmt, as_float8)]
    fn = tile_kernel(fmt, axis, group, ps, d, interpret=False)
    text = lower_for_gpu(fn, *args).as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("d", [2, 64, 128])
def test_unrotate_tile_lowers_for_cuda(d):
    def kernel(x_ref, o_ref):
        o_ref[...] = _tile_decode.unrotate_tile(x_ref[...], interpret=False)

    shape = jax.ShapeDtypeStruct((16, d), jnp.float32)
    fn = jax.jit(pl.pallas_call(kernel, out_shape=shape, compiler_params=triton_params(False)))
    text = lower_for_gpu(fn, shape).as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_add_in_dtype_tile_lowers_for_cuda(dtype):
    def kernel(p_ref, q_ref, o_ref):
        o_ref[...] = _tile_decode.add_in_dtype_tile(p_ref[...], q_ref[...], dtype, interpret=False)

    fn = jax.jit(
        pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((16, 64), dtype),
            compiler_params=triton_params(False),
        )
    )
    args = (jax.ShapeDtypeStruct((16, 64), dtype), jax.ShapeDtypeStruct((16, 64), jnp.float32))
    assert "__gpu$xla.gpu.triton" in lower_for_gpu(fn, *args).as_text()


def test_a_one_table_intb_plane_reads_its_one_map_row_at_any_layer():
    """A cache with a per-layer INTB plane carries layers >= 1; a one-table INTB plane beside
    it has code maps [1, H, D] and must read row 0 at every layer (a Triton ref index is not
    bounds-checked, so an out-of-range row reads other memory). The maps here are numpy
    arrays, which raise on an out-of-range row; the decoded tile equals `unpack_kv`."""
    from kvq_jax.codecs.formats.intb import register_table
    from kvq_jax.codecs.registry import unregister_codec

    rng = np.random.default_rng(0)
    row = [2, 6, 3, 5, 4, 4, 7, 1] * 8  # 256 bits per row
    fmt = register_table([row, row[::-1]])
    try:
        x = rng.standard_normal((16, 2, 64)).astype(np.float32)
        packed = pack_kv(x, kind="key", format=fmt, group_size=16)
        starts, bits = _tile_decode.intb_maps(fmt)
        assert starts.shape == (1, 2, 64)
        codes = jnp.asarray(packed.codes)[None]  # [P = 1, rows, H, W]
        meta = {"minimum": packed.minimum[None], "scale": packed.scale[None]}
        refs = (codes, meta["minimum"], meta["scale"], starts, bits)
        expected = np.asarray(unpack_kv(packed, np.float32))[:, HEAD]
        for layer in (0, 2, 7):
            tile = _tile_decode.load_intb_tile(refs, (), 0, HEAD, layer, lambda r: r[0, :, HEAD, :])
            got = _tile_decode.decode_tile(fmt, "tokens", 16, tile, interpret=True)
            assert_same_values(got, expected, f"layer {layer}")
        # a per-layer format's rows clamp to [0, N - 1], as the XLA path's gather does
        assert _tile_decode.intb_row(7, 3) == 2 and _tile_decode.intb_row(-1, 3) == 0
    finally:
        unregister_codec(fmt)
