"""Rotary position embedding tables (rotate-half convention, as Llama, SmolLM2 and Gemma use),
framework-neutral: a policy that stores keys before RoPE inverts it on the way in and
re-applies it after decoding (`kvq_jax.codecs.rope`, `kvq_torch_bridge.codecs.rope`).

cos/sin are computed in float64 and rounded once to float32, so both stacks rotate with the
same numbers.
"""

from __future__ import annotations

import numpy as np


def inverse_frequencies(dim: int, theta: float) -> np.ndarray:
    """float64 [D / 2]: theta^(-2c/D), the angle per position of channels c and c + D/2 (every
    stack's RoPE tables start here)."""
    if dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got D={dim}")
    if not theta > 0:
        raise ValueError(f"theta must be positive, got {theta!r}")
    return float(theta) ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


def rope_tables(num_tokens: int, dim: int, theta: float, offset: int = 0):
    """(cos, sin) float32 [T, 1, D] of positions offset .. offset + T - 1: channel c and
    c + D/2 share the angle position * theta^(-2c/D)."""
    return tables_at(np.arange(offset, offset + num_tokens), dim, theta)


def tables_at(positions, dim: int, theta: float, *, half: bool = False):
    """(cos, sin) float32 [..., 1, D] of int positions [...] (half: [..., 1, D / 2], the
    first half only, which the second repeats): the binary64 angle position * theta^(-2c/D),
    its binary64 cos / sin rounded once to float32."""
    inv = inverse_frequencies(dim, theta)
    angle = np.asarray(positions, dtype=np.float64)[..., None] * inv
    if not half:
        angle = np.concatenate([angle, angle], axis=-1)
    return tuple(f(angle)[..., None, :].astype(np.float32) for f in (np.cos, np.sin))


def rope_aware_weights(dim: int, theta: float, num_tokens: int, recent: int = 16) -> np.ndarray:
    """float64 [D]: a_c = mean over query-key distances d in [recent, T) of cos^2(d * w_c), the
    share of channel c's own query energy that reaches a pre-RoPE key channel c (the rest
    comes from its rotation partner c +- D/2)."""
    inv = inverse_frequencies(dim, theta)
    d = np.arange(min(recent, num_tokens - 1), num_tokens, dtype=np.float64)
    a = (np.cos(inv[:, None] * d[None]) ** 2).mean(axis=1)
    return np.concatenate([a, a])
