"""Building blocks shared by the architectures: RMSNorm, RoPE, linear layers, SwiGLU, attention.

Dtype policy (matches Hugging Face's modeling code): activations live in the parameters' dtype
(the compute dtype, float32 or bfloat16); matmuls accumulate in float32 and round to the
compute dtype; RMSNorm's statistics, RoPE's angles, the attention softmax, the logits and the
exit gate are computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvq_jax.models.config import ModelConfig

#: Attention score of masked (future) positions before the softmax.
_MASKED = -1e30


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in x's dtype (float32 accumulation)."""
    return jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, in x's dtype (f32 statistics)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [..., D] float32 for integer `positions` [...] (HF layout: halves repeat)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, D] by (cos, sin) [B or 1, T, D] ("rotate_half" convention)."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def swiglu(x: jax.Array, gate_w: jax.Array, up_w: jax.Array, down_w: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)): [..., H] -> [..., H] in x's dtype."""
    return linear(jax.nn.silu(linear(x, gate_w)) * linear(x, up_w), down_w)


def _positions(positions: jax.Array | None, batch: int, length: int) -> jax.Array:
    if positions is None:
        positions = jnp.arange(length, dtype=jnp.int32)
    positions = jnp.asarray(positions)
    if positions.ndim == 1:
        positions = positions[None]
    return jnp.broadcast_to(positions, (batch, length))


def qkv(
    layer: dict, x: jax.Array, positions: jax.Array | None, config: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Projections of the *normed* input x [B, T, H]: q [B,T,Hq,D], k, v [B,T,Hkv,D], RoPE'd."""
    b, t, _ = x.shape
    d = config.head_dim
    q = linear(x, layer["q_proj"]).reshape(b, t, config.num_heads, d)
    k = linear(x, layer["k_proj"]).reshape(b, t, config.num_kv_heads, d)
    v = linear(x, layer["v_proj"]).reshape(b, t, config.num_kv_heads, d)
    cos, sin = rope_angles(_positions(positions, b, t), d, config.rope_theta)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Full causal softmax attention, no cache: q [B,T,Hq,D], k, v [B,T,Hkv,D] -> [B,T,Hq,D].

    Query head h reads KV head h // (Hq // Hkv) (HF `repeat_kv`); scale 1/sqrt(D); scores and
    softmax in float32, the probabilities rounded to q's dtype before the value product.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    """Token ids [B, T] int -> embeddings [B, T, H] in the parameters' dtype."""
    return jnp.take(params["embed_tokens"], tokens, axis=0)


def final_norm(params: dict, h: jax.Array, config: ModelConfig) -> jax.Array:
    """The model's final RMSNorm of h [B, T, H] (same dtype)."""
    return rms_norm(h, params["norm"], config.rms_norm_eps)


def logits(params: dict, h: jax.Array, config: ModelConfig) -> jax.Array:
    """LM head of the *final-normed* h [B, T, H] -> logits [B, T, V] float32.

    The product is taken in h's dtype with float32 accumulation (tied: embed_tokens.T).
    """
    if config.tie_word_embeddings:
        w = params["embed_tokens"].astype(h.dtype)
        return jnp.einsum("bth,vh->btv", h, w, preferred_element_type=jnp.float32)
    w = params["lm_head"].astype(h.dtype)
    return jnp.matmul(h, w, preferred_element_type=jnp.float32)


def layer_params(params: dict, index: int) -> dict:
    """The parameters of decoder layer `index` (the stack keeps a leading [num_layers] axis)."""
    return jax.tree.map(lambda x: x[index], params["layers"])
