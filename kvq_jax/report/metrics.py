"""Error metrics of `kvq report`, as partial sums that are pooled on the host.

Every metric is a relative L2 error ||x_hat - x|| / ||x||, pooled as the seed evaluation does:
squared errors and squared reference norms are summed separately over everything pooled and
divided once at the end. The jitted side returns float32 partial sums over (tokens, dim) for
each head of each slice; `pool` adds them in float64 on the host.

Attention is causal softmax attention with the captured (post-RoPE) queries, GQA (query head
j reads KV head j // (q_heads // kv_heads), as `repeat_kv` in Hugging Face models), scale
1 / sqrt(dim), computed in float32 at the highest matmul precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def square_sums(reference, approx) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(sum (approx - reference)^2, sum reference^2) over the token and dim axes.

    reference, approx: [..., T, H, D] of any float dtype (widened to float32).
    Returns two float32 [..., H] arrays.
    """
    ref = jnp.asarray(reference, jnp.float32)
    err = jnp.asarray(approx, jnp.float32) - ref
    return jnp.sum(err * err, axis=(-3, -1)), jnp.sum(ref * ref, axis=(-3, -1))


def causal_attention(q, k, v) -> jnp.ndarray:
    """Causal GQA attention of one sequence in float32.

    q: [T, Hq, D]; k, v: [T, H, D] with Hq a multiple of H. Returns float32 [T, Hq, D].
    """
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    t, hq, d = q.shape
    h = k.shape[1]
    qg = q.reshape(t, h, hq // h, d)
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("thgd,shd->hgts", qg, k, precision=hi) / np.float32(np.sqrt(d))
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("hgts,shd->thgd", probs, v, precision=hi)
    return out.reshape(t, hq, d)


def batched_attention(q, k, v) -> jnp.ndarray:
    """`causal_attention` over leading axes, one sequence at a time (memory ~ Hq * T^2).

    q: [B..., T, Hq, D]; k, v: [B..., T, H, D]. Returns float32 [B..., T, Hq, D].
    """
    lead = q.shape[:-3]
    flat = [x.reshape((-1, *x.shape[-3:])) for x in (q, k, v)]
    out = jax.lax.map(lambda args: causal_attention(*args), tuple(flat))
    return out.reshape((*lead, *out.shape[-3:]))


def pool(err_sq, ref_sq, axis=None) -> np.ndarray | float:
    """Relative L2 from partial sums: sqrt(sum err^2 / sum ref^2), summed in float64 over
    `axis` (None: everything). 0 where both sums are 0; inf where only the reference is 0."""
    e = np.sum(np.asarray(err_sq, np.float64), axis=axis)
    r = np.sum(np.asarray(ref_sq, np.float64), axis=axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(e == 0, 0.0, np.sqrt(e / r))
    return float(out) if np.ndim(out) == 0 else out


def decode_attention(q, k, v, k_hat, v_hat, *, sink: int, recent: int, num_queries: int):
    """Decode-like attention of the last `num_queries` queries of one sequence, float32
    [num_queries, Hq, D]: query t attends keys s <= t, reading the raw K/V rows of its own
    window (s < sink, the attention sink, or t - s < recent, the newest rows, as the
    append-time cache's sink and staging rows hold them) and the decoded rows k_hat, v_hat
    everywhere else. With sink = recent = 0 every row is decoded.

    q: [T, Hq, D]; k, v, k_hat, v_hat: [T, H, D] (any float dtype; computed in float32).
    """
    q, k, v, k_hat, v_hat = (jnp.asarray(x, jnp.float32) for x in (q, k, v, k_hat, v_hat))
    t, hq, d = q.shape
    h = k.shape[1]
    rows = jnp.arange(t - num_queries, t)[:, None]  # query positions [Q, 1]
    cols = jnp.arange(t)[None, :]  # key positions [1, T]
    raw = (cols < sink) | (rows - cols < recent)  # [Q, T]
    qg = q[t - num_queries :].reshape(num_queries, h, hq // h, d)
    hi = jax.lax.Precision.HIGHEST
    scale = np.float32(np.sqrt(d))
    s_raw = jnp.einsum("thgd,shd->hgts", qg, k, precision=hi) / scale
    s_hat = jnp.einsum("thgd,shd->hgts", qg, k_hat, precision=hi) / scale
    scores = jnp.where(cols <= rows, jnp.where(raw, s_raw, s_hat), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("hgts,shd->thgd", jnp.where(raw, probs, 0.0), v, precision=hi)
    out += jnp.einsum("hgts,shd->thgd", jnp.where(raw, 0.0, probs), v_hat, precision=hi)
    return out.reshape(num_queries, hq, d)


def batched_decode_attention(q, k, v, k_hat, v_hat, **kwargs) -> jnp.ndarray:
    """`decode_attention` over leading axes, one sequence at a time. q: [B..., T, Hq, D]; the
    K/V arrays [B..., T, H, D]. Returns float32 [B..., num_queries, Hq, D]."""
    lead = q.shape[:-3]
    flat = [x.reshape((-1, *x.shape[-3:])) for x in (q, k, v, k_hat, v_hat)]
    out = jax.lax.map(lambda args: decode_attention(*args, **kwargs), tuple(flat))
    return out.reshape((*lead, *out.shape[-3:]))
