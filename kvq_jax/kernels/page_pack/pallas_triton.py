"""Page pack as Pallas kernels (Triton backend): INT4, INT2, HINT4, HINT2, INTB, NVFP4, FP8 E4M3
and heavy-row pages in one call.

Input: pages [P, page_size, H, D] (bf16 / fp16 / fp32). Output: the arrays `pack_paged`
returns (docs/FORMAT.md sections 2-5), byte for byte. One `pallas_call` per call:

- INT4 / INT2 and FP8 E4M3: grid (P, H). A program loads one (page, head) tile
  [page_size, D] once, computes the group statistics in registers and writes the codes (two
  or four per byte) and the metadata of that tile (one pass: every input byte is read once,
  every output byte written once). INT2 is INT4's arithmetic with 3 levels (FORMAT.md 2a).
  HINT4 / HINT2 are INT4 / INT2 of the tile's rows rotated in registers first (FORMAT.md 2c,
  `_tile_decode.rotate_tile`: the butterfly's IEEE adds, each flushed).
- INTB (FORMAT.md 2b): grid (P, H). The metadata from the head tile's token groups under the
  layer's per-channel levels; the W-byte bit stream of each row from a [T, 8W] tile (8W padded
  to a power of two): stream bit j's channel column gathered from the tile, quantized with
  that channel's levels (the same groups, the same arithmetic: the same codes), its code bit
  taken, eight bits per byte, the bytes past W masked off the store.
- Heavy rows (FORMAT.md 5a): grid (P, H), whole-array refs, the rows handed in (the keys
  chose them). The tile's rows are gathered around each heavy row (its lane reads a
  neighbour), quantized (values: each row on its channel groups, rotated first for HINT;
  keys: token groups of a heavy group, INT4 / INT2 / INTB, whose statistics the neighbour's
  copy leaves unchanged) and scattered to their payload rows; the heavy rows are gathered
  and stored INT8 (plain).
- NVFP4: grid (P,). Every page has its own global scale, which needs the amax over the whole
  page (all heads) before any block scale can be rounded. A program owns one page and loops
  over its heads twice (`lax.fori_loop`): pass 1 reads each [page_size, D] head tile for the
  amax and the finiteness flag, pass 2 reads it again and writes codes and block scales. So
  "one pass" for NVFP4 means one kernel launch that writes every output byte once and reads
  each page twice, the second time from L2 (a page is 2 * page_size * H * D bytes in bf16,
  64 KiB for 16 x 16 x 128).

Arithmetic: every division goes through `_exact.divide` (PTX `div.rn.f32`; Triton's plain
`/` is `div.full.f32`), rounding to an integer through `_exact.round_half_even`, flushing
through `_exact.flush_subnormal`. No multiply here feeds an add, so no FMA can form. Casts
the hardware might round or saturate differently are done with integer arithmetic instead:

- f32 -> E4M3 (NVFP4 block scales, FP8 codes): `_e4m3_encode` rounds the float32 bits
  (normal range) or `x * 2**9` (subnormal range) to nearest even and builds the code; the
  kernels write uint8 and the wrapper bitcasts to float8_e4m3fn (no fp8 type in the kernel,
  so it also builds for SM80, which has no fp8 conversion instructions).
- f32 -> f16 (INT4 metadata): the cast rounds to nearest even on every backend, but PTX turns
  NaN into 0x7FFF; the kernel writes the canonical 0x7E00 bit pattern for NaN explicitly.

`interpret=True` runs the same kernel body through Pallas' interpreter (XLA), on any device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvq_jax.codecs import _numerics
from kvq_jax.codecs.packed import PackedKV
from kvq_jax.core import registry
from kvq_jax.core.constants import (
    E2M1_MAX,
    E4M3_MAX,
    F32_MAX,
    INT2_LEVELS,
    INT4_LEVELS,
    NVFP4_GLOBAL_NUMERATOR,
    NVFP4_GROUP_SIZE,
    NVFP4_ONE_SIXTH,
)
from kvq_jax.core.heavy import HEAVY_LEVELS
from kvq_jax.kernels import _exact, _tile_decode
from kvq_jax.kernels import launch as _launch
from kvq_jax.kernels.launch import Launch

_EXPONENT = np.uint32(0x7F800000)
_F16_NAN_BITS = np.uint16(0x7E00)  # canonical float16 NaN (docs/FORMAT.md section 3)
_E4M3_NAN = np.int32(0x7F)
_E4M3_MIN_NORMAL = np.float32(2.0**-6)
_E4M3_SUBNORMAL_STEPS = np.float32(2.0**9)  # subnormal E4M3 values are k * 2**-9, k = 0..7


# -- element-wise pieces ------------------------------------------------------------------


def _bits(x):
    return lax.bitcast_convert_type(x, jnp.uint32)


def _is_nonfinite(x):
    """inf or NaN, from the exponent bits (lowers everywhere)."""
    return (_bits(x) & _EXPONENT) == _EXPONENT


def _e4m3_encode(a, *, interpret: bool):
    """float32 magnitudes a in [0, 448] (or NaN), flushed -> (int32 E4M3 code, float32 value).

    Round to nearest even onto the E4M3 grid: normal values (a >= 2**-6) keep 3 mantissa
    bits (an integer round-half-even on the float32 bits; a carry moves into the exponent
    exactly as it should), subnormal ones become k * 2**-9 with k = round_half_even(a * 2**9)
    (exact scaling by a power of two); k = 8 is the smallest normal value, whose code is 8
    too. NaN gives code 0x7F and a NaN value. Values above 448 do not occur (callers clamp).
    """
    bits = _bits(a)
    rounded = (bits + np.uint32(0x7FFFF) + ((bits >> 20) & np.uint32(1))) & np.uint32(0xFFF00000)
    exponent = (rounded >> 23).astype(jnp.int32) - np.int32(127 - 7)
    mantissa = ((rounded >> 20) & np.uint32(7)).astype(jnp.int32)
    normal_code = (exponent << 3) | mantissa
    normal_value = lax.bitcast_convert_type(rounded, jnp.float32)
    k = _exact.round_half_even(a * _E4M3_SUBNORMAL_STEPS, interpret=interpret)
    small = a < _E4M3_MIN_NORMAL
    code = jnp.where(small, k.astype(jnp.int32), normal_code)
    value = jnp.where(small, k * np.float32(2.0**-9), normal_value)
    nan = jnp.isnan(a)
    return jnp.where(nan, _E4M3_NAN, code), jnp.where(nan, a, value)


def _pairs(codes, bits: int):
    """int32 codes [R, D] (D even) -> [R, D / 2]: channel 2j in the low `bits` bits, channel
    2j + 1 above them (a split in two along the last axis, which lowers in Triton)."""
    r, d = codes.shape
    low, high = jnp.unstack(codes.reshape(r, d // 2, 2), axis=-1)
    return low | (high << bits)


def _pack_nibbles(codes):
    """int32 codes [R, D] (0..15, D even) -> uint8 [R, D / 2]; channel 2j in bits 0-3."""
    return _pairs(codes, 4).astype(jnp.uint8)


def _pack_2bit(codes):
    """int32 codes [R, D] (0..3, D a multiple of 4) -> uint8 [R, D / 4]; channel 4j + i in
    bits 2i .. 2i + 1 (FORMAT.md section 1): pairs of channels, then pairs of pairs."""
    return _pairs(_pairs(codes, 2), 4).astype(jnp.uint8)


def _f16_bits(x, nan):
    """float32 -> float16 (round to nearest even), canonical NaN where `nan`."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16)
    return lax.bitcast_convert_type(jnp.where(nan, _F16_NAN_BITS, bits), jnp.float16)


def _grouped(x, axis: str, group_size: int):
    """[T, D] -> grouped view and its member axis ([nG, G, D] / 1 or [T, nG, G] / 2)."""
    t, d = x.shape
    if axis == "tokens":
        return x.reshape(t // group_size, group_size, d), 1
    return x.reshape(t, d // group_size, group_size), 2


# -- INT4 / INT2 ------------------------------------------------------------------------------

#: (levels, bits per code, rows rotated) of the affine formats.
_AFFINE = {
    "int4": (INT4_LEVELS, 4, False),
    "hint4": (INT4_LEVELS, 4, True),
    "int2": (INT2_LEVELS, 2, False),
    "hint2": (INT2_LEVELS, 2, True),
}


def _affine(x, axis: str, group_size: int, levels, *, interpret):
    """INT4's arithmetic (FORMAT.md 2) with `levels` (15, 3, 255 for heavy rows; or float32 per
    column, broadcastable to the group statistics, for INTB) on a float32 [R, D] tile:
    (int32 codes [R, D], float16 minimum and scale per group: [R / G, D] on axis tokens, [R,
    D / G] on channels; NaN and codes 0 for a group holding inf or NaN)."""
    xg, member = _grouped(x, axis, group_size)
    nonfinite = jnp.max(_is_nonfinite(xg).astype(jnp.int32), axis=member, keepdims=True)
    finite = nonfinite == 0
    mn = jnp.min(xg, axis=member, keepdims=True)
    mx = jnp.max(xg, axis=member, keepdims=True)
    mn = jnp.where(mn == 0, np.float32(0.0), mn)  # a zero minimum is stored as +0.0
    span = _exact.flush_subnormal(mx - mn)
    divisor = jnp.broadcast_to(jnp.asarray(levels, jnp.float32), span.shape)
    scale = jnp.where(
        span > 0,
        _exact.flush_subnormal(_exact.divide(span, divisor, interpret=interpret)),
        np.float32(1.0),
    )
    diff = _exact.flush_subnormal(xg - mn)
    q = _exact.round_half_even(
        _exact.divide(diff, jnp.broadcast_to(scale, diff.shape), interpret=interpret),
        interpret=interpret,
    )
    codes = jnp.where(q >= 0, jnp.minimum(q, levels), np.float32(0.0))  # NaN -> 0
    codes = jnp.where(finite, codes, np.float32(0.0)).astype(jnp.int32).reshape(x.shape)
    nan = jnp.squeeze(nonfinite, member) != 0
    minimum, scale = (_f16_bits(jnp.squeeze(a, member), nan) for a in (mn, scale))
    return codes, minimum, scale


def _codes_bytes(codes, bits: int):
    """int32 codes [R, D] -> uint8 [R, D * bits / 8] (two or four codes per byte)."""
    return _pack_nibbles(codes) if bits == 4 else _pack_2bit(codes)


def _affine_kernel(x_ref, codes_ref, minimum_ref, scale_ref, *, axis, group_size, format,
                   interpret):  # fmt: skip
    """INT4 / INT2 of a [T, D] head tile (FORMAT.md 2, 2a); HINT4 / HINT2 (2c): of the rows
    rotated in registers first (`_tile_decode.rotate_tile`)."""
    levels, bits, rotate = _AFFINE[format]
    x = _numerics.widen(x_ref[...])  # [T, D]
    if rotate:
        x = _tile_decode.rotate_tile(x, interpret=interpret)
    codes, minimum, scale = _affine(x, axis, group_size, levels, interpret=interpret)
    codes_ref[...] = _codes_bytes(codes, bits)
    minimum_ref[...] = minimum
    scale_ref[...] = scale


# -- INTB ---------------------------------------------------------------------------------------


def intb_maps(fmt: str, stream_bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """INTB format `fmt`'s packing maps, per layer table (N = 1 for one table): levels float32
    [N, H, D] (2^b - 1), and the channel and code bit int32 [N, H, stream_bits] of each stream
    bit (`IntBLayout.stacked_maps`), the bits past the row's 8W pointing at code bit 31 (zero)."""
    levels, channel, bit = registry.layout(fmt).stacked_maps()[:3]
    pad = stream_bits - channel.shape[-1]
    channel = np.pad(channel, ((0, 0), (0, 0), (0, pad)))
    bit = np.pad(bit, ((0, 0), (0, 0), (0, pad)), constant_values=31)
    return levels, channel, bit


def _intb_stream(columns, maps, layer, h, group_size: int, *, interpret):
    """int32 stream bytes [T, S / 8] of INTB rows on token groups of `group_size`: stream bit
    j's channel column (`columns(channel [S]) -> [T, S]`, loaded from the tile) quantized with
    that channel's levels (the same groups and arithmetic as the metadata: the same codes), its
    code bit taken; stream bit j is bit j mod 8 of byte j / 8. maps: the levels, channel and
    bit refs (`intb_maps`), read at `layer`, head h."""
    levels_ref, channel_ref, bit_ref = maps
    channel = channel_ref[layer, h, :]  # [S]
    xs = _numerics.widen(columns(channel))
    codes, _, _ = _affine(xs, "tokens", group_size, levels_ref[layer, h, channel][None, None, :],
                          interpret=interpret)  # fmt: skip
    t_len, s = codes.shape
    bits = (codes >> bit_ref[layer, h, :][None, :]) & 1
    weights = lax.broadcasted_iota(jnp.int32, (t_len, s // 8, 8), 2)
    return jnp.sum(bits.reshape(t_len, s // 8, 8) << weights, axis=2)


def _intb_kernel(x_ref, layer_ref, levels_ref, channel_ref, bit_ref, codes_ref, minimum_ref,
                 scale_ref, *, group_size, row_bytes, interpret):  # fmt: skip
    """INTB (FORMAT.md 2b) of a [T, D] head tile: the metadata from the tile's token groups
    under the layer's per-channel levels; the codes as each stream bit's channel column
    gathered from the tile ([T, S], S = 8W padded to a power of two), quantized the same way
    (the same groups, the same arithmetic: the same codes) and its bit taken, eight per byte."""
    h = pl.program_id(1)
    layer = layer_ref[0]
    t_len = x_ref.shape[0]
    x = _numerics.widen(x_ref[...])  # [T, D]
    levels = levels_ref[layer, h, :][None, None, :]  # [1, 1, D]
    _, minimum, scale = _affine(x, "tokens", group_size, levels, interpret=interpret)
    minimum_ref[...] = minimum
    scale_ref[...] = scale

    def columns(channel):  # the tile's columns `channel` [S]: [T, S]
        rows = lax.broadcasted_iota(jnp.int32, (t_len, channel.shape[0]), 0)
        return x_ref[(rows, jnp.broadcast_to(channel[None, :], rows.shape))]

    stream = _intb_stream(columns, (levels_ref, channel_ref, bit_ref), layer, h, group_size,
                          interpret=interpret)  # fmt: skip
    col = lax.broadcasted_iota(jnp.int32, stream.shape, 1)
    pltriton.store(codes_ref, stream.astype(jnp.uint8), mask=col < row_bytes)


# -- heavy rows -------------------------------------------------------------------------------


def _heavy_kernel(*refs, base, axis, group_size, heavy_group, row_bytes, interpret):
    """Heavy rows (FORMAT.md 5a) of one (page, head): refs are whole arrays ([P, T, H, D]
    pages, [P, T / G, H] rows, for an INTB base the layer and its maps (`intb_maps`), then the
    PackedKV's arrays), read and written by index.

    The payload is the tile's rows gathered around each heavy row and scattered to their
    payload rows: row i of heavy group k goes to payload row k*(G-1) + i - (i > r_k); the heavy
    row's own lane reads and writes its neighbour's row (r_k + 1, or r_k - 1 for the last row),
    the same bytes to the same place, so every lane stores. On channel groups each payload row
    is quantized on its own; on token groups of G - 1 rows (keys) a payload group is a heavy
    group without its heavy row, and the gathered group (the heavy lane a copy of a payload
    row) has the same minimum, maximum and finiteness, so the same codes. The heavy rows:
    INT8 of the plain row (not rotated)."""
    it = iter(refs)
    x_ref, rows_ref = next(it), next(it)
    intb = _tile_decode.is_intb(base)
    if intb:
        layer_ref, levels_ref, channel_ref, bit_ref = (next(it) for _ in range(4))
    codes_ref, minimum_ref, scale_ref = next(it), next(it), next(it)
    heavy_rows_ref, heavy_codes_ref, heavy_minimum_ref, heavy_scale_ref = it
    p, h = pl.program_id(0), pl.program_id(1)
    _, t_len, _, d = x_ref.shape
    g = heavy_group
    n = t_len // g

    def grid(index, cols):
        """(rows [R, cols], columns [R, cols]) indices of a gather / scatter of `cols` columns."""
        r = jnp.broadcast_to(index, (index.shape[0], cols))
        return r, lax.broadcasted_iota(jnp.int32, (index.shape[0], cols), 1)

    t = lax.broadcasted_iota(jnp.int32, (t_len, 1), 0)
    group, i = t // g, t % g
    r = jnp.minimum(rows_ref[(p, group, h)].astype(jnp.int32), g - 1)  # [T, 1], as split_heavy
    last = r == g - 1
    src = jnp.where(i == r, jnp.where(last, t - 1, t + 1), t)
    skip = jnp.where(i == r, last.astype(jnp.int32), (i > r).astype(jnp.int32))
    dest = group * (g - 1) + i - skip
    rows_, cols = grid(src, d)
    x = _numerics.widen(x_ref[(p, rows_, h, cols)])  # [T, D]
    k = lax.broadcasted_iota(jnp.int32, (n, 1), 0)

    def scatter(ref, tile, index):
        rows_, cols = grid(index, tile.shape[1])
        ref[(p, rows_, h, cols)] = tile

    if axis == "channels":
        levels, bits, rotate = _AFFINE[base]
        if rotate:
            x = _tile_decode.rotate_tile(x, interpret=interpret)
        codes, minimum, scale = _affine(x, axis, group_size, levels, interpret=interpret)
        for ref, tile in ((codes_ref, _codes_bytes(codes, bits)), (minimum_ref, minimum),
                          (scale_ref, scale)):  # fmt: skip
            scatter(ref, tile, dest)
    else:  # token groups of G - 1 payload rows: one per heavy group, metadata [n, D]
        if intb:
            layer = layer_ref[0]
            levels = levels_ref[layer, h, :][None, None, :]
        else:
            levels, bits, _ = _AFFINE[base]
        codes, minimum, scale = _affine(x, axis, g, levels, interpret=interpret)
        scatter(minimum_ref, minimum, k)
        scatter(scale_ref, scale, k)
        if intb:

            def columns(channel):  # the gathered rows' columns `channel` [S]: [T, S]
                rows_ = jnp.broadcast_to(src, (t_len, channel.shape[0]))
                return x_ref[(p, rows_, h, jnp.broadcast_to(channel[None, :], rows_.shape))]

            stream = _intb_stream(columns, (levels_ref, channel_ref, bit_ref), layer, h, g,
                                  interpret=interpret)  # fmt: skip
            # bytes past W repeat byte W - 1 (the scatter writes it there again: same bytes)
            col = lax.broadcasted_iota(jnp.int32, stream.shape, 1)
            edge = jnp.sum(jnp.where(col == row_bytes - 1, stream, 0), axis=1, keepdims=True)
            stream = jnp.where(col >= row_bytes, edge, stream)
            rows_ = jnp.broadcast_to(dest, stream.shape)
            codes_ref[(p, rows_, h, jnp.minimum(col, row_bytes - 1))] = stream.astype(jnp.uint8)
        else:
            scatter(codes_ref, _codes_bytes(codes, bits), dest)

    heavy = jnp.minimum(rows_ref[(p, k, h)].astype(jnp.int32), g - 1)  # [n, 1]
    rows_, cols = grid(k * g + heavy, d)
    hx = _numerics.widen(x_ref[(p, rows_, h, cols)])  # [n, D], plain
    hcodes, hmin, hscale = _affine(hx, "channels", d, HEAVY_LEVELS, interpret=interpret)
    scatter(heavy_codes_ref, hcodes.astype(jnp.uint8), k)
    heavy_minimum_ref[(p, k, h)] = hmin
    heavy_scale_ref[(p, k, h)] = hscale
    heavy_rows_ref[(p, k, h)] = heavy.astype(jnp.uint8)


# -- FP8 E4M3 ---------------------------------------------------------------------------------


def _fp8_kernel(x_ref, codes_ref, scale_ref, *, interpret):
    x = _numerics.widen(x_ref[...])  # [T, D]
    nonfinite = jnp.max(_is_nonfinite(x).astype(jnp.int32), axis=1, keepdims=True)
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    s = _exact.flush_subnormal(
        _exact.divide(amax, jnp.full(amax.shape, E4M3_MAX, jnp.float32), interpret=interpret)
    )
    ok = (nonfinite == 0) & (s > 0)
    divisor = jnp.broadcast_to(jnp.where(ok, s, np.float32(1.0)), x.shape)
    q = _exact.divide(x, divisor, interpret=interpret)
    q = jnp.minimum(jnp.maximum(q, -E4M3_MAX), E4M3_MAX)
    q = jnp.where(ok, q, np.float32(0.0))
    code, _ = _e4m3_encode(jnp.abs(q), interpret=interpret)
    code = code | (_exact.sign_bit(q).astype(jnp.int32) << 7)
    codes_ref[...] = code.astype(jnp.uint8)
    scale_ref[...] = jnp.squeeze(jnp.where(nonfinite == 0, s, np.float32(np.nan)), 1)


# -- NVFP4 ------------------------------------------------------------------------------------


def _nvfp4_kernel(x_ref, codes_ref, block_ref, global_ref, *, axis, num_heads, interpret):
    """One page: pass 1 over the heads for amax / finiteness, pass 2 packs each head."""

    def head(h):
        return _numerics.widen(x_ref[:, h, :])  # [T, D]

    def stats(h, carry):
        amax, nonfinite = carry
        x = head(h)
        amax = jnp.maximum(amax, jnp.max(jnp.abs(x)))
        nonfinite = jnp.maximum(nonfinite, jnp.max(_is_nonfinite(x).astype(jnp.int32)))
        return amax, nonfinite

    amax, nonfinite = lax.fori_loop(0, num_heads, stats, (np.float32(0.0), np.int32(0)))
    finite = nonfinite == 0
    # Scalars as [1] vectors: the exact helpers take arrays.
    amax = jnp.full((1,), amax, jnp.float32)
    g = _exact.divide(
        jnp.full((1,), NVFP4_GLOBAL_NUMERATOR, jnp.float32), amax, interpret=interpret
    )
    g = jnp.where(amax == 0, np.float32(1.0), g)
    g = jnp.where(jnp.isinf(g), F32_MAX, g)  # tiny-tensor rule
    inv_g = _exact.flush_subnormal(
        _exact.divide(jnp.full((1,), 1.0, jnp.float32), g, interpret=interpret)
    )
    global_ref[...] = jnp.where(finite, g, np.float32(np.nan))

    def pack(h, carry):
        x = head(h)
        xg, member = _grouped(x, axis, NVFP4_GROUP_SIZE)
        vmax = jnp.max(jnp.abs(xg), axis=member, keepdims=True)
        gb = jnp.broadcast_to(g.reshape((1,) * vmax.ndim), vmax.shape)
        s = _exact.flush_subnormal(gb * _exact.flush_subnormal(vmax * NVFP4_ONE_SIXTH))
        s8, sf = _e4m3_encode(jnp.minimum(s, E4M3_MAX), interpret=interpret)
        v = _exact.flush_subnormal(sf * inv_g.reshape((1,) * vmax.ndim))
        one = jnp.full(v.shape, 1.0, jnp.float32)
        r = jnp.where(
            v == 0,
            np.float32(0.0),
            _exact.flush_subnormal(
                _exact.divide(one, jnp.where(v == 0, one, v), interpret=interpret)
            ),
        )
        y = _exact.flush_subnormal(xg * r)
        # Tiny-scale fallback: the reciprocal path underflowed although the block scale did not.
        fallback = (v == 0) & (sf > 0)
        y_direct = _exact.flush_subnormal(
            _exact.divide(
                _exact.flush_subnormal(xg * jnp.broadcast_to(g.reshape((1,) * xg.ndim), xg.shape)),
                jnp.broadcast_to(jnp.where(fallback, sf, one), xg.shape),
                interpret=interpret,
            )
        )
        y = jnp.where(fallback, y_direct, y)
        y = jnp.minimum(jnp.maximum(y, -E2M1_MAX), E2M1_MAX)
        codes = _numerics.e2m1_encode(y, _exact.sign_bit(xg)).astype(jnp.int32)
        codes = jnp.where(finite, codes, np.int32(0))
        codes_ref[:, h, :] = _pack_nibbles(codes.reshape(x.shape))
        s8 = jnp.where(finite, s8, _E4M3_NAN)
        block_ref[:, h, :] = jnp.squeeze(s8, member).astype(jnp.uint8)
        return carry

    lax.fori_loop(0, num_heads, pack, np.int32(0))


# -- the pallas_call wrappers ---------------------------------------------------------------


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret: bool, launch):
    params = {}
    if not interpret:
        # A bare pallas_call on GPU goes to Mosaic GPU, which does not target SM120.
        params["compiler_params"] = pltriton.CompilerParams(
            num_warps=launch.num_warps, num_stages=launch.num_stages
        )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="kvq_page_pack",
        **params,
    )


def _meta_block(axis: str, page_size: int, head_dim: int, group_size: int):
    """Per-head metadata tile: [T / G, D] (tokens) or [T, D / G] (channels)."""
    if axis == "tokens":
        return page_size // group_size, head_dim
    return page_size, head_dim // group_size


def _pack_affine(pages, format, axis, group_size, interpret, launch):
    p, t, h, d = pages.shape
    mt, md = _meta_block(axis, t, d, group_size)
    width = d * _AFFINE[format][1] // 8  # code bytes per (token, head)
    tile = lambda rows, cols: pl.BlockSpec((None, rows, None, cols), lambda i, j: (i, 0, j, 0))  # noqa: E731
    kernel = functools.partial(
        _affine_kernel, axis=axis, group_size=group_size, format=format, interpret=interpret
    )
    codes, minimum, scale = _call(
        kernel,
        grid=(p, h),
        in_specs=[tile(t, d)],
        out_specs=[tile(t, width), tile(mt, md), tile(mt, md)],
        out_shape=[
            jax.ShapeDtypeStruct((p, t, h, width), jnp.uint8),
            jax.ShapeDtypeStruct((p, mt, h, md), jnp.float16),
            jax.ShapeDtypeStruct((p, mt, h, md), jnp.float16),
        ],
        interpret=interpret,
        launch=launch,
    )(pages)
    return {"codes": codes, "minimum": minimum, "scale": scale}


def _pack_heavy(pages, rows, format, axis, group_size, layer, interpret, launch):
    p, t, h, d = pages.shape
    heavy = _tile_decode.heavy_layout(format)
    g, base = heavy.heavy_group, heavy.base.name
    n = t // g
    extra, row_bytes = [], 0
    if _tile_decode.is_intb(base):
        row_bytes = registry.layout(base).row_bytes
        maps = intb_maps(base, 8 * pl.next_power_of_2(row_bytes))
        extra = [_tile_decode.layer_operand(layer), *maps]
        width = row_bytes
    else:
        width = d * _AFFINE[base][1] // 8
    meta = (p, t - n, h, d // group_size) if axis == "channels" else (p, n, h, d)
    sds = jax.ShapeDtypeStruct
    kernel = functools.partial(_heavy_kernel, base=base, axis=axis, group_size=group_size,
                               heavy_group=g, row_bytes=row_bytes, interpret=interpret)  # fmt: skip
    out_shape = [
        sds((p, t - n, h, width), jnp.uint8),
        sds(meta, jnp.float16),
        sds(meta, jnp.float16),
        sds((p, n, h), jnp.uint8),
        sds((p, n, h, d), jnp.uint8),
        sds((p, n, h), jnp.float16),
        sds((p, n, h), jnp.float16),
    ]
    arrays = _call(
        kernel,
        grid=(p, h),
        in_specs=[pl.no_block_spec] * (2 + len(extra)),
        out_specs=[pl.no_block_spec] * len(out_shape),
        out_shape=out_shape,
        interpret=interpret,
        launch=launch,
    )(pages, jnp.asarray(rows, jnp.uint8), *extra)
    names = ("codes", "minimum", "scale", "heavy_rows", "heavy_codes", "heavy_minimum",
             "heavy_scale")  # fmt: skip
    return dict(zip(names, arrays, strict=True))


def _pack_intb(pages, format, group_size, layer, interpret, launch):
    p, t, h, d = pages.shape
    w = registry.layout(format).row_bytes
    s = 8 * pl.next_power_of_2(w)
    levels, channel, bit = intb_maps(format, s)
    kernel = functools.partial(_intb_kernel, group_size=group_size, row_bytes=w,
                               interpret=interpret)  # fmt: skip
    tile = lambda rows, cols: pl.BlockSpec((None, rows, None, cols), lambda i, j: (i, 0, j, 0))  # noqa: E731
    codes, minimum, scale = _call(
        kernel,
        grid=(p, h),
        in_specs=[tile(t, d)] + [pl.no_block_spec] * 4,
        out_specs=[tile(t, s // 8), tile(t // group_size, d), tile(t // group_size, d)],
        out_shape=[
            jax.ShapeDtypeStruct((p, t, h, w), jnp.uint8),
            jax.ShapeDtypeStruct((p, t // group_size, h, d), jnp.float16),
            jax.ShapeDtypeStruct((p, t // group_size, h, d), jnp.float16),
        ],
        interpret=interpret,
        launch=launch,
    )(pages, _tile_decode.layer_operand(layer), levels, channel, bit)
    return {"codes": codes, "minimum": minimum, "scale": scale}


def _pack_nvfp4(pages, axis, interpret, launch):
    p, t, h, d = pages.shape
    mt, md = _meta_block(axis, t, d, NVFP4_GROUP_SIZE)
    page = lambda rows, cols: pl.BlockSpec((None, rows, h, cols), lambda i: (i, 0, 0, 0))  # noqa: E731
    codes, block_scale, global_scale = _call(
        functools.partial(_nvfp4_kernel, axis=axis, num_heads=h, interpret=interpret),
        grid=(p,),
        in_specs=[page(t, d)],
        out_specs=[page(t, d // 2), page(mt, md), pl.BlockSpec((None, 1), lambda i: (i, 0))],
        out_shape=[
            jax.ShapeDtypeStruct((p, t, h, d // 2), jnp.uint8),
            jax.ShapeDtypeStruct((p, mt, h, md), jnp.uint8),
            jax.ShapeDtypeStruct((p, 1), jnp.float32),
        ],
        interpret=interpret,
        launch=launch,
    )(pages)
    return {
        "codes": codes,
        "block_scale": lax.bitcast_convert_type(block_scale, jnp.float8_e4m3fn),
        "global_scale": global_scale.reshape(p),
    }


def _pack_fp8(pages, interpret, launch):
    p, t, h, d = pages.shape
    codes, scale = _call(
        functools.partial(_fp8_kernel, interpret=interpret),
        grid=(p, h),
        in_specs=[pl.BlockSpec((None, t, None, d), lambda i, j: (i, 0, j, 0))],
        out_specs=[
            pl.BlockSpec((None, t, None, d), lambda i, j: (i, 0, j, 0)),
            pl.BlockSpec((None, t, None), lambda i, j: (i, 0, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((p, t, h, d), jnp.uint8),
            jax.ShapeDtypeStruct((p, t, h), jnp.float32),
        ],
        interpret=interpret,
        launch=launch,
    )(pages)
    return {"codes": lax.bitcast_convert_type(codes, jnp.float8_e4m3fn), "scale": scale}


def pack_paged(
    pages, *, kind: str, format: str, axis: str, group_size: int, interpret: bool,
    launch: Launch | None = None, rows=None, layer=None,
) -> PackedKV:  # fmt: skip
    """Validated pages [P, page_size, H, D] (a configuration `api.config_support` accepts,
    axis and group_size resolved) -> the `PackedKV` that `pack_paged` returns; `launch`: the
    Triton launch parameters (None: the rule of `kvq_jax.kernels.launch.page_pack`); rows:
    uint8 [P, page_size / G, H], the heavy rows of each page (heavy-row formats); layer: the
    model layer (int32 scalar) whose table a per-layer INTB format packs with (None: 0)."""
    if launch is None:
        launch = _launch.page_pack(pages.shape[1], pages.shape[3], format)
    if _tile_decode.heavy_layout(format) is not None:
        arrays = _pack_heavy(pages, rows, format, axis, group_size, layer, interpret, launch)
    elif _tile_decode.is_intb(format):
        arrays = _pack_intb(pages, format, group_size, layer, interpret, launch)
    elif format in _AFFINE:
        arrays = _pack_affine(pages, format, axis, group_size, interpret, launch)
    elif format == "nvfp4":
        arrays = _pack_nvfp4(pages, axis, interpret, launch)
    elif format == "fp8_e4m3":
        arrays = _pack_fp8(pages, interpret, launch)
    else:
        raise ValueError(f"format {format!r} has no page-pack kernel")
    return PackedKV(
        **arrays,
        format=format,
        kind=kind,
        axis=axis,
        group_size=group_size,
        shape=tuple(pages.shape[1:]),
        dtype=np.dtype(pages.dtype),
    )
