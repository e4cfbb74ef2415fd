"""HINT4 and HINT2: INT4 / INT2 of Hadamard-rotated (token, head) rows.

docs/FORMAT.md section 2c. `rotate` / `unrotate` are the exact butterfly (one rounded, flushed
float32 add or subtract per pair and stage, in the normative order) times a power of two; the
payload is the base codec's on the rotated float32 rows, and decode rotates the base codec's
float32 decode back.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvq_jax.codecs._numerics import flush_subnormal, widen
from kvq_jax.codecs.codec import Codec
from kvq_jax.codecs.formats import int2, int4
from kvq_jax.core.layouts import HInt2Layout, HInt4Layout, rotation_shifts


def butterfly(y: jnp.ndarray) -> jnp.ndarray:
    """float32 [..., D] (D a power of two) -> the unnormalized Sylvester-Hadamard transform
    along the last axis: stage s pairs channel i (bit s clear) with i + 2^s."""
    d = y.shape[-1]
    h = 1
    while h < d:
        pairs = y.reshape(*y.shape[:-1], d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = jnp.stack([flush_subnormal(a + b), flush_subnormal(a - b)], axis=-2)
        y = y.reshape(*y.shape[:-3], d)
        h *= 2
    return y


def _scale(y: jnp.ndarray, shift: int) -> jnp.ndarray:
    return flush_subnormal(y * jnp.float32(2.0**-shift))


def rotate(x: jnp.ndarray) -> jnp.ndarray:
    """R: float32 [..., D] -> butterfly * 2^-floor(n/2), n = log2 D."""
    return _scale(butterfly(x), rotation_shifts(x.shape[-1])[0])


def unrotate(y: jnp.ndarray) -> jnp.ndarray:
    """Rinv: float32 [..., D] -> butterfly * 2^-ceil(n/2)."""
    return _scale(butterfly(y), rotation_shifts(y.shape[-1])[1])


class _Rotated(Codec):
    """A base codec's data paths on rotated rows (the layout comes from the subclass).

    `rotated_space`: attention may read `unpack_rotated` (the rows still rotated, float32) and
    un-rotate its output once instead of every row (`kernels.paged_attention.xla`): the
    rotation is linear, so the two agree up to rounding.
    """

    base_codec: Codec
    rotated_space = True

    def encode(self, values, *, axis, group_size) -> dict:
        return self.base_codec.encode(rotate(widen(values)), axis=axis, group_size=group_size)

    def unpack(self, packed, dtype) -> jnp.ndarray:
        return unrotate(self.unpack_rotated(packed)).astype(dtype)

    def unpack_rotated(self, packed) -> jnp.ndarray:
        """float32 [T, H, D]: the base codec's decode of the rotated rows (`rotate(x)`'s
        reconstruction; `unrotate` of it is `unpack` before the cast)."""
        return self.base_codec.unpack(packed, jnp.float32)


class HInt4Codec(HInt4Layout, _Rotated):
    base_codec = int4.CODEC


class HInt2Codec(HInt2Layout, _Rotated):
    base_codec = int2.CODEC


HINT4 = HInt4Codec()
HINT2 = HInt2Codec()
