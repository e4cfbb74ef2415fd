"""Two 4-bit codes per byte: channel 2j in bits 0-3, channel 2j+1 in bits 4-7."""

from __future__ import annotations

import jax.numpy as jnp


def pack_nibbles(codes: jnp.ndarray) -> jnp.ndarray:
    """uint8 codes [..., D] (values 0..15) -> uint8 [..., ceil(D/2)]; odd D pads a 0 nibble."""
    d = codes.shape[-1]
    if d % 2:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    low, high = pairs[..., 0], pairs[..., 1]
    return low | (high << 4)


def unpack_nibbles(packed: jnp.ndarray, channels: int) -> jnp.ndarray:
    """uint8 [..., ceil(D/2)] -> uint8 codes [..., D] with D = `channels`."""
    low = packed & 0x0F
    high = packed >> 4
    codes = jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return codes[..., :channels]
