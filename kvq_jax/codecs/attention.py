"""Dense decode attention: the float32 reference every paged attention path is compared with."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvq_jax.core import checks


def attend(q, k, v, seq_lens, *, return_lse: bool = False):
    """`dense_decode_attention` without the argument checks (traceable); with return_lse
    also the scores' log-sum-exp float32 [B, Hq] (-inf, output 0, for seq_lens 0)."""
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
    if not return_lse:
        return out.reshape(b, hq, d)
    lse = jax.nn.logsumexp(scores, axis=-1).reshape(b, hq)
    out = jnp.where(jnp.isfinite(lse)[..., None], out.reshape(b, hq, d), 0.0)
    return out, lse


def merge_attention(out, lse, q, k, v):
    """Attention over two key sets from the first's (out [B, Hq, D], lse [B, Hq], e.g.
    `attend(..., return_lse=True)`) and one more key row per sequence k, v [B, H, D]:
    float32 [B, Hq, D], the softmax over both (GQA: query head i reads KV head i // G)."""
    b, hq, d = q.shape
    h = k.shape[1]
    g = hq // h
    hi = jax.lax.Precision.HIGHEST
    qf = jnp.asarray(q, jnp.float32).reshape(b, h, g, d)
    own = jnp.einsum("bhgd,bhd->bhg", qf, k.astype(jnp.float32), precision=hi)
    own = (own * jnp.float32(1.0 / math.sqrt(d))).reshape(b, hq)
    m = jnp.maximum(lse, own)  # own is finite: m is
    w_ctx, w_own = jnp.exp(lse - m), jnp.exp(own - m)
    vf = jnp.repeat(v.astype(jnp.float32), g, axis=1)  # [B, Hq, D]
    return (out * w_ctx[..., None] + vf * w_own[..., None]) / (w_ctx + w_own)[..., None]


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
