"""Decode attention in float32: the dense reference every paged attention path is compared
with, the online softmax the blockwise paths run, and the merge of partial attentions by
log-sum-exp."""

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


#: Tokens one block of pages holds by default in the blockwise paths (a block is read,
#: attended and dropped).
DEFAULT_BLOCK_TOKENS = 256


def default_block_pages(page_size: int) -> int:
    """Pages per block: `DEFAULT_BLOCK_TOKENS` tokens, at least one page."""
    return max(1, DEFAULT_BLOCK_TOKENS // page_size)


class OnlineSoftmax:
    """Online softmax (flash-attention style) for q [B, H, G, D] float32 (GQA: G query heads
    per KV head): the state is the running max m and sum l [B, H, G] and the rescaled
    accumulator acc [B, H, G, D]; `update` folds in one block of rows, so peak memory is one
    block whatever the number of rows attended.

    keys_by_row: the scores as K q^T (each key row against the G queries, K read row-major)
    instead of q K^T (XLA:CPU then lays K out transposed, [B, H, D, T], and evaluates the
    producer of K inside that transposition). For keys whose decode is costly per element
    (INTB's word picks, `Codec.costly_decode`): 2.5x faster attention over them on XLA:CPU;
    slower for cheap decodes (a G-column product)."""

    def __init__(self, q, *, keys_by_row: bool = False):
        self.q = q
        self.scale = jnp.float32(1.0 / math.sqrt(q.shape[-1]))
        self.keys_by_row = keys_by_row

    def init(self):
        b, h, g, d = self.q.shape
        return (
            jnp.full((b, h, g), -jnp.inf, jnp.float32),
            jnp.zeros((b, h, g), jnp.float32),
            jnp.zeros((b, h, g, d), jnp.float32),
        )

    def update(self, state, k, v, valid, value_map=None):
        """Fold rows k, v [B, T, H, D] (any float dtype) where valid [B, T] (or per head,
        [B, T, H]) into the state. k may be a tuple of parts [B, T, H, D / n] splitting the
        channels evenly (RoPE's halves): the scores are the sum of the parts' scores.
        value_map: a linear map of the last axis applied to these rows' sum of p v
        ([B, H, G, D]) instead of to every value row (rows in another basis than the
        accumulator's, e.g. raw rows against Hadamard-rotated pages: `rotate`)."""
        m, l_sum, acc = state
        hi = jax.lax.Precision.HIGHEST
        if valid.ndim == 2:
            valid = jnp.broadcast_to(valid[:, :, None], (*valid.shape, v.shape[2]))
        valid4 = valid[..., None]
        # Invalid rows may hold anything (an unwritten page decodes to garbage): zero them.
        v = jnp.where(valid4, v.astype(jnp.float32), 0.0)
        parts = k if isinstance(k, tuple) else (k,)
        s = 0.0
        for part, q in zip(parts, jnp.split(self.q, len(parts), axis=-1), strict=True):
            part = jnp.where(valid4, part.astype(jnp.float32), 0.0)
            if self.keys_by_row:  # [B, H, T, G] = K q^T per (b, h), then to [B, H, G, T]
                dims = (((3,), (3,)), ((0, 2), (0, 1)))
                s = s + jnp.swapaxes(jax.lax.dot_general(part, q, dims, precision=hi), -1, -2)
            else:
                s = s + jnp.einsum("bhgd,bthd->bhgt", q, part, precision=hi)
        s = s * self.scale
        s = jnp.where(jnp.swapaxes(valid, 1, 2)[:, :, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing valid yet: no NaN
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l_sum = l_sum * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bhgt,bthd->bhgd", p, v, precision=hi)
        acc = acc * alpha[..., None] + (pv if value_map is None else value_map(pv))
        return m_new, l_sum, acc

    @staticmethod
    def finish(state):
        _, l_sum, acc = state
        return acc / l_sum[..., None]

    @staticmethod
    def lse(state):
        """log sum exp of the scores [B, H, G] (-inf where no row was valid)."""
        m, l_sum, _ = state
        return jnp.where(l_sum > 0, m + jnp.log(jnp.where(l_sum > 0, l_sum, 1.0)), -jnp.inf)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two key sets from each one's (out [..., D] float32,
    lse [...]); a set with no row has lse -inf (its out is ignored). The result is 0 where
    neither has a row."""
    m = jnp.maximum(lse_a, lse_b)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w_a, w_b = jnp.exp(lse_a - m_safe), jnp.exp(lse_b - m_safe)
    total = w_a + w_b
    out = out_a * w_a[..., None] + out_b * w_b[..., None]
    return jnp.where((total > 0)[..., None], out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
