"""INTB: grouped affine INT with a static bit width per (head, channel), token groups.

docs/FORMAT.md section 2b. INT4's arithmetic (`kvq_jax.codecs.formats.int4`'s group range,
quantization and decode) with 2^b - 1 levels per channel, b from the codec's bit table; each
(token, head) row's codes are one least-significant-first bit stream of W bytes. One codec
instance per table: `IntBCodec(bits)` registers under `intb_name(bits)` unless named.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from kvq_jax.codecs import _grouping
from kvq_jax.codecs._numerics import widen
from kvq_jax.codecs.codec import Codec
from kvq_jax.codecs.formats.int4 import dequantize_groups, group_range, quantize_groups
from kvq_jax.core.layouts import IntBLayersLayout, IntBLayout


def _take_per_head(a: jnp.ndarray, index) -> jnp.ndarray:
    """a [..., H, n] -> [..., H, m]: out[..., h, j] = a[..., h, index[h, j]] (index int32 [H, m],
    static or traced), one 1-D take per head: XLA:CPU runs a gather with one index vector per
    head ~15x faster than `take_along_axis` with a broadcast [..., H, m] index."""
    index = jnp.asarray(index, jnp.int32)
    heads = [jnp.take(a[..., h, :], index[h], axis=-1) for h in range(a.shape[-2])]
    return jnp.stack(heads, axis=-2)


def pack_stream(codes: jnp.ndarray, channel, bit) -> jnp.ndarray:
    """uint8 codes [..., H, D] -> uint8 [..., H, W]: stream bit j of head h is bit `bit[h, j]`
    of channel `channel[h, j]`'s code (`IntBLayout.stream_maps`, static or traced)."""
    n = channel.shape[-1]
    bits = (_take_per_head(codes, channel) >> jnp.asarray(bit, jnp.uint8)) & 1
    bits = bits.reshape(*bits.shape[:-1], n // 8, 8)
    return jnp.sum(bits << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def _words(packed: jnp.ndarray) -> jnp.ndarray:
    """uint8 [..., W] -> uint32 [..., ceil(W / 4)]: the stream as little-endian 32-bit words
    (bytes past W zero)."""
    w = packed.shape[-1]
    n = -(-w // 4)
    p = jnp.pad(packed, [(0, 0)] * (packed.ndim - 1) + [(0, 4 * n - w)])
    p = p.astype(jnp.uint32).reshape(*p.shape[:-1], n, 4)
    return p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16) | (p[..., 3] << 24)


def _pick(words: jnp.ndarray, index: jnp.ndarray) -> jnp.ndarray:
    """words [..., H, n], index int32 [H, D] in [0, n) -> [..., H, D]: words[..., h, index[h,
    c]], by a tree of selects on the index's bits (log2 n levels of elementwise selects, which
    XLA fuses into the decode: a gather per code is ~1.6x slower on XLA:CPU)."""
    level = [words[..., i : i + 1] for i in range(words.shape[-1])]
    bit = 0
    while len(level) > 1:
        take_odd = ((index >> bit) & 1) == 1
        level = [jnp.where(take_odd, *level[i : i + 2][::-1]) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]  # fmt: skip
        bit += 1
    return jnp.broadcast_to(level[0], (*words.shape[:-1], index.shape[-1]))


def unpack_stream(packed: jnp.ndarray, start, bits) -> jnp.ndarray:
    """uint8 [..., H, W] -> uint8 codes [..., H, D]: channel c's code is the bits[h, c] stream
    bits from stream bit start[h, c] (`IntBLayout.code_starts`, static or traced int32
    [H, D]), read from the two 32-bit words it lies in (a code of <= 8 bits straddles at most
    one word boundary), each picked by selects (`_pick`), not gathered."""
    start = jnp.asarray(start, jnp.int32)
    words = _words(packed)
    shift = (start % 32).astype(jnp.uint32)
    # a code in the last word never straddles (the stream ends there): its high word, any
    # word, is masked off
    q = start // 32
    lo, hi = _pick(words, q), _pick(words, jnp.minimum(q + 1, words.shape[-1] - 1))
    high = jnp.where(shift == 0, jnp.uint32(0), hi << ((32 - shift) % 32))  # no shift by 32
    mask = (jnp.left_shift(1, jnp.asarray(bits, jnp.int32)) - 1).astype(jnp.uint32)
    return (((lo >> shift) | high) & mask).astype(jnp.uint8)


def encode_with(values, axis, group_size, levels, stream) -> dict:
    """INTB's arrays of validated [T, H, D] values under a table's levels [H, D] and stream
    maps (static or traced)."""
    layout = _grouping.GroupLayout(values.shape, axis, group_size)
    mn, mx, finite = group_range(layout, values)
    xg = layout.split(widen(values), 0.0)
    codes_g, minimum, scale = quantize_groups(xg, mn, mx, finite, levels)
    codes = pack_stream(layout.merge(codes_g), *stream)
    m = layout.member_axis
    return {"codes": codes, "minimum": minimum.squeeze(m), "scale": scale.squeeze(m)}


def unpack_with(packed, dtype, code) -> jnp.ndarray:
    """INTB's decode of `packed` under a table's code maps (static or traced)."""
    layout = _grouping.GroupLayout(packed.shape, packed.axis, packed.group_size)
    codes = unpack_stream(packed.codes, *code)
    out = dequantize_groups(
        layout.split(codes, 0), packed.minimum, packed.scale, layout.member_axis
    )
    return layout.merge(out).astype(dtype)


class IntBCodec(IntBLayout, Codec):
    costly_decode = True

    def encode(self, values, *, axis, group_size) -> dict:
        return encode_with(values, axis, group_size, self.levels(), self.stream_maps())

    def unpack(self, packed, dtype) -> jnp.ndarray:
        return unpack_with(packed, dtype, self.code_starts())


class IntBLayersCodec(IntBLayersLayout, Codec):
    """INTB with one bit table per model layer (`IntBLayersLayout`): encode / unpack take the
    layer (int or traced int32 scalar) and read its table from the stacked tables
    [N, H, D], so one compiled function serves every layer."""

    costly_decode = True

    @functools.cached_property
    def _stacked_maps(self) -> tuple[np.ndarray, ...]:
        """Every layer's static maps stacked on a leading layer axis [N, ...]: levels, stream
        (channel, bit) and code (start, bits), as `IntBLayout` of that layer's table."""
        return self.stacked_maps()

    def maps(self, layer):
        """Layer `layer`'s (levels, (channel, bit), (start, bits)) (`IntBLayout`'s static maps
        of its table), read from the stacked maps at a traced or static layer: one row slice
        per call, no map arithmetic on the hot path."""
        if layer is None:
            raise ValueError(
                f"layer: format {self.name!r} holds one INTB bit table per model layer "
                f"({self.num_layers}); pass the layer (an int or an int32 scalar)"
            )
        index = jnp.asarray(layer, jnp.int32)
        levels, channel, bit, start, bits = (jnp.asarray(a)[index] for a in self._stacked_maps)
        return levels, (channel, bit), (start, bits)

    def encode(self, values, *, axis, group_size, layer=None) -> dict:
        levels, stream, _ = self.maps(layer)
        return encode_with(values, axis, group_size, levels, stream)

    def unpack(self, packed, dtype, layer=None) -> jnp.ndarray:
        return unpack_with(packed, dtype, self.maps(layer)[2])


def register_layer_tables(tables) -> str:
    """Register the per-layer INTB format of `tables` ([N][H][D] bit tables of one row width)
    in the JAX registry unless a codec of that name is there already; returns its name."""
    from kvq_jax.codecs.registry import CODECS, register_codec

    codec = IntBLayersCodec(tables)
    if codec.name not in CODECS:
        register_codec(codec)
    return codec.name


def register_table(bits) -> str:
    """Register the INTB format of bit table `bits` in the JAX registry unless a codec of
    that name is there already; returns the name (`intb_name(bits)`). The conformance
    runner's `register_table` for this stack."""
    from kvq_jax.codecs.registry import CODECS, register_codec

    codec = IntBCodec(bits)
    if codec.name not in CODECS:
        register_codec(codec)
    return codec.name
