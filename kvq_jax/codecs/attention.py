"""Dense decode attention: the float32 reference every paged attention path is compared with."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvq_jax.core import checks


def attend(q, k, v, seq_lens) -> jnp.ndarray:
    """`dense_decode_attention` without the argument checks (traceable)."""
    b, t, h, d = k.shape
    hq = q.shape[1]
    g = hq // h
    hi = jax.lax.Precision.HIGHEST
    qf = jnp.asarray(q, jnp.float32).reshape(b, h, g, d)
    scores = jnp.einsum("bhgd,bthd->bhgt", qf, k.astype(jnp.float32), precision=hi)
    scores = scores * jnp.float32(1.0 / math.sqrt(d))
    mask = jnp.arange(t)[None, :] < jnp.asarray(seq_lens)[:, None]  # [B, T]
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgt,bthd->bhgd", probs, v.astype(jnp.float32), precision=hi)
    return out.reshape(b, hq, d)


@jax.jit
def dense_decode_attention(q, k, v, seq_lens) -> jnp.ndarray:
    """One query token per sequence over unquantized KV.

    Args:
      q: [B, Hq, D]; Hq a multiple of H (GQA: query head i reads KV head i // (Hq // H)).
      k, v: [B, T, H, D].
      seq_lens: int32 [B], 1 <= seq_lens <= T; tokens >= seq_len are masked out.

    Returns softmax(q k^T / sqrt(D)) v as float32 [B, Hq, D], computed in float32 at HIGHEST
    precision (a sequence with seq_len 0 gives NaN).
    """
    k, v = jnp.asarray(k), jnp.asarray(v)
    checks.check_dense_attention_args(q, k, v, seq_lens)
    return attend(q, k, v, seq_lens)
