"""Llama (SmolLM2): pre-norm decoder layers with RMSNorm, RoPE, GQA attention and a SwiGLU MLP.

One decoder layer, split where a KV cache goes (between the projections and attention):

    q, k, v = attention_inputs(layer, h, positions, config)   # input_layernorm, q/k/v, RoPE
    attn    = <attention of q over the cached k, v>            # the engine's part
    h       = attention_output(layer, h, attn, config)        # o_proj, residual, norm, MLP

Parameter pytree (see `kvq_jax.models.loading`; weights stored [in, out], so y = x @ w):
    embed_tokens [V, H]; norm [H]; lm_head [H, V] (absent when tied);
    layers: q_proj [L, H, Hq*D], k_proj / v_proj [L, H, Hkv*D], o_proj [L, Hq*D, H],
            gate_proj / up_proj [L, H, I], down_proj [L, I, H],
            input_layernorm / post_attention_layernorm [L, H].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvq_jax.models._layers import (
    causal_attention,
    embed,
    final_norm,
    layer_params,
    linear,
    logits,
    qkv,
    rms_norm,
    swiglu,
)
from kvq_jax.models.config import ModelConfig

__all__ = [
    "LAYER_PARAMS",
    "attention_inputs",
    "attention_output",
    "causal_attention",
    "embed",
    "final_norm",
    "forward",
    "layer_params",
    "logits",
]

#: Names of the per-layer parameters (each with a leading [num_layers] axis in the pytree).
LAYER_PARAMS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


def attention_inputs(
    layer: dict, h: jax.Array, positions: jax.Array | None, config: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D] (post-RoPE, compute dtype) of h [B,T,H].

    positions: [B, T] or [T] int token positions (the RoPE angles); None means 0..T-1.
    """
    return qkv(layer, rms_norm(h, layer["input_layernorm"], config.rms_norm_eps), positions, config)


def attention_output(layer: dict, h: jax.Array, attn: jax.Array, config: ModelConfig) -> jax.Array:
    """The layer's output [B,T,H]: h + o_proj(attn), then + MLP(post_attention_layernorm(.)).

    h: the layer's input [B,T,H]; attn: the attention result [B,T,Hq,D] (compute dtype).
    """
    b, t = attn.shape[:2]
    h = h + linear(attn.reshape(b, t, -1).astype(h.dtype), layer["o_proj"])
    x = rms_norm(h, layer["post_attention_layernorm"], config.rms_norm_eps)
    return h + swiglu(x, layer["gate_proj"], layer["up_proj"], layer["down_proj"])


def decoder_layer(layer: dict, h: jax.Array, positions: jax.Array | None, config: ModelConfig):
    """One decoder layer with full causal attention over the T positions of h (no cache)."""
    q, k, v = attention_inputs(layer, h, positions, config)
    return attention_output(layer, h, causal_attention(q, k, v), config)


def run_layers(params: dict, h: jax.Array, positions, config: ModelConfig, layer_fn) -> jax.Array:
    """Run the stacked layers over h [B,T,H] with `layer_fn(layer, h, positions, config)`."""

    def step(carry, layer):
        return layer_fn(layer, carry, positions, config), None

    h, _ = jax.lax.scan(step, h, params["layers"])
    return h


@functools.partial(jax.jit, static_argnames="config")
def forward(params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Reference forward, full causal attention, no cache: tokens [B,T] -> logits [B,T,V] f32.

    With config.num_loops > 1 (an emulation: Llama was not trained to loop) the layer stack
    runs that many times, the final norm after each, its output the next loop's input."""
    h = embed(params, tokens)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    for _ in range(config.num_loops):
        h = final_norm(params, run_layers(params, h, positions, config, decoder_layer), config)
    return logits(params, h, config)
