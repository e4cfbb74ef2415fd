"""INTB: grouped affine INT with a static bit width per (head, channel), token groups.

docs/FORMAT.md section 2b. INT4's arithmetic (`kvq_jax.codecs.formats.int4`'s group range,
quantization and decode) with 2^b - 1 levels per channel, b from the codec's bit table; each
(token, head) row's codes are one least-significant-first bit stream of W bytes. One codec
instance per table: `IntBCodec(bits)` registers under `intb_name(bits)` unless named.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvq_jax.codecs import _grouping
from kvq_jax.codecs._numerics import widen
from kvq_jax.codecs.codec import Codec
from kvq_jax.codecs.formats.int4 import dequantize_groups, group_range, quantize_groups
from kvq_jax.core.layouts import IntBLayout


def pack_stream(codes: jnp.ndarray, channel: np.ndarray, bit: np.ndarray) -> jnp.ndarray:
    """uint8 codes [..., H, D] -> uint8 [..., H, W]: stream bit j of head h is bit `bit[h, j]`
    of channel `channel[h, j]`'s code (`IntBLayout.stream_maps`, static)."""
    h, n = channel.shape
    index = jnp.broadcast_to(jnp.asarray(channel), (*codes.shape[:-2], h, n))
    bits = (jnp.take_along_axis(codes, index, axis=-1) >> jnp.asarray(bit, jnp.uint8)) & 1
    bits = bits.reshape(*bits.shape[:-1], n // 8, 8)
    return jnp.sum(bits << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def unpack_stream(packed: jnp.ndarray, index: np.ndarray, valid: np.ndarray) -> jnp.ndarray:
    """uint8 [..., H, W] -> uint8 codes [..., H, D]: bit i of channel c's code is stream bit
    `index[h, c, i]` where `valid[h, c, i]` (`IntBLayout.code_maps`, static)."""
    bits = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    bits = bits.reshape(*packed.shape[:-1], 8 * packed.shape[-1])  # [..., H, 8W]
    h, d, _ = index.shape
    flat = jnp.asarray(index.reshape(h, d * 8))
    gathered = jnp.take_along_axis(bits, jnp.broadcast_to(flat, (*bits.shape[:-2], h, d * 8)), -1)
    gathered = gathered.reshape(*bits.shape[:-2], h, d, 8)
    weights = jnp.asarray(np.where(valid, 1 << np.arange(8), 0).astype(np.uint8))
    return jnp.sum(gathered * weights, axis=-1, dtype=jnp.uint8)


class IntBCodec(IntBLayout, Codec):
    def encode(self, values, *, axis, group_size) -> dict:
        layout = _grouping.GroupLayout(values.shape, axis, group_size)
        mn, mx, finite = group_range(layout, values)
        xg = layout.split(widen(values), 0.0)
        codes_g, minimum, scale = quantize_groups(xg, mn, mx, finite, self.levels())
        codes = pack_stream(layout.merge(codes_g), *self.stream_maps())
        m = layout.member_axis
        return {"codes": codes, "minimum": minimum.squeeze(m), "scale": scale.squeeze(m)}

    def unpack(self, packed, dtype) -> jnp.ndarray:
        layout = _grouping.GroupLayout(packed.shape, packed.axis, packed.group_size)
        codes = unpack_stream(packed.codes, *self.code_maps())
        out = dequantize_groups(
            layout.split(codes, 0), packed.minimum, packed.scale, layout.member_axis
        )
        return layout.merge(out).astype(dtype)


def register_table(bits) -> str:
    """Register the INTB format of bit table `bits` in the JAX registry unless a codec of
    that name is there already; returns the name (`intb_name(bits)`). The conformance
    runner's `register_table` for this stack."""
    from kvq_jax.codecs.registry import CODECS, register_codec

    codec = IntBCodec(bits)
    if codec.name not in CODECS:
        register_codec(codec)
    return codec.name
