"""RoPE in JAX (rotate-half convention; tables from `kvq_jax.core.rope.rope_tables`): keys
stored before RoPE are inverted on the way in and re-rotated after decoding.

Computed in float64 and rounded once to float32: the float32 products are exact there, so a
fused multiply-add (which XLA:CPU forms) gives the same bits as separate operations, and the
Torch mirror (`kvq_torch_bridge.codecs.rope`) matches bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvq_jax.core.rope import inverse_frequencies


def _rotate(x, cos, sin, sign: float):
    """x * cos + sign * rotate_half(x) * sin in binary64, rounded once to float32, computed on
    the halves (rotate_half(x) = [-x_hi, x_lo]; channel c and c + D/2 share an angle): the
    same operations on the same operands as on the whole row, without its shuffled copy."""
    h = x.shape[-1] // 2
    with jax.enable_x64(True):
        lo, hi = (a.astype(np.float64) for a in (x[..., :h], x[..., h:]))
        cos, sin = (jnp.asarray(a)[..., :h].astype(np.float64) for a in (cos, sin))
        out = (lo * cos - sign * (hi * sin), hi * cos + sign * (lo * sin))
        return jnp.concatenate([a.astype(np.float32) for a in out], axis=-1)


def apply_rope_halves(x, cos, sin):
    """`apply_rope` in float32 arithmetic, as its two halves (x_lo cos - x_hi sin,
    x_hi cos + x_lo sin; each product rounded, the sum rounded, XLA may fuse them): within
    2 float32 ulps of `apply_rope`, at a fraction of its cost on the XLA path, and not
    concatenated (scores are taken on the halves, `OnlineSoftmax.update` with a tuple). For
    rows that only enter dot products (decode attention's keys, as the attention kernel
    turns them); never for bytes a format specifies."""
    h = x.shape[-1] // 2
    x = x.astype(jnp.float32)
    lo, hi = x[..., :h], x[..., h:]
    cos, sin = (jnp.asarray(a, jnp.float32)[..., :h] for a in (cos, sin))
    return lo * cos - hi * sin, hi * cos + lo * sin


def apply_rope(x, cos, sin):
    """[T, H, D] -> x * cos + rotate_half(x) * sin as float32 (cos, sin: float32 [T, 1, D], or
    their first halves [T, 1, D / 2]: the second half repeats the first)."""
    return _rotate(x.astype(jnp.float32), cos, sin, 1.0)


def invert_rope(x, cos, sin):
    """The inverse rotation: x * cos - rotate_half(x) * sin, float32."""
    return _rotate(x.astype(jnp.float32), cos, sin, -1.0)


def rope_at(positions, dim: int, theta: float):
    """(cos, sin) float32 [..., 1, D] of int positions [...] (traced): the numbers of
    `kvq_jax.core.rope.rope_tables` (the binary64 angle position * theta^(-2c/D), its binary64
    cos / sin rounded once to float32), computed on the device for positions known only
    there (a paged cache's rows)."""
    inv = inverse_frequencies(dim, theta)
    with jax.enable_x64(True):
        angle = jnp.asarray(positions).astype(np.float64)[..., None] * jnp.asarray(inv)
        cos, sin = (f(angle).astype(np.float32) for f in (jnp.cos, jnp.sin))
    return tuple(jnp.concatenate([a, a], axis=-1)[..., None, :] for a in (cos, sin))
