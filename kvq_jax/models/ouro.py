"""Ouro (ByteDance's looped LM): a Llama-like layer stack run `num_loops` times per token.

Architecture (ported from the public `modeling_ouro.py`, OuroDecoderLayer / OuroModel /
OuroForCausalLM):
  * each decoder layer has four RMSNorms, a "sandwich" around both sublayers:
        h = h + input_layernorm_2(o_proj(attention(input_layernorm(h))))
        h = h + post_attention_layernorm_2(mlp(post_attention_layernorm(h)))
  * the layer stack runs num_loops (config `total_ut_steps`) times; after every loop the final
    norm is applied, and that normed state is both the next loop's input and this loop's output
    (its logits lm_head(.) and its exit gate);
  * each (loop, layer) has its own K/V: cache index loop * num_layers + layer;
  * the early-exit gate is Linear(H, 1) with bias on the loop's normed output; lambda_l =
    sigmoid(gate_l) is the probability of exiting at loop l given the token got there. The exit
    distribution is p_l = lambda_l * prod_{j<l}(1 - lambda_j) for l < N-1 and the last loop takes
    the remaining mass, p_{N-1} = prod_{j<N-1}(1 - lambda_j). A token exits at the first loop
    whose cumulative sum of p reaches the threshold (the last loop when none does), and its
    logits are that loop's logits. All loops still run for every token (HF computes all of
    them; so does `forward`): the exit only selects which loop's logits are returned. (Ouro's
    other modes: `exit_at_step=l` is `loop_logits[l]`, `use_weighted_exit` is
    `expected_logits`, no threshold at all is the last loop.)
  * threshold 1.0 means no early exit (Ouro's documented meaning). Ouro's own code compares the
    float cumulative sum with 1.0, which can round to 1.0 before the last loop (notably in
    bfloat16); here 1.0 always selects the last loop, and the exit probabilities are computed
    in float32 whatever the compute dtype.

Parameter pytree: Llama's (see `kvq_jax.models.llama`) plus per layer input_layernorm_2 and
post_attention_layernorm_2 [L, H], and early_exit_gate {"weight": [H], "bias": []}.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvq_jax.models._layers import (
    causal_attention,
    embed,
    final_norm,
    layer_params,
    linear,
    logits,
    rms_norm,
    swiglu,
)
from kvq_jax.models.config import ModelConfig
from kvq_jax.models.llama import LAYER_PARAMS as _LLAMA_LAYER_PARAMS
from kvq_jax.models.llama import attention_inputs, run_layers

__all__ = [
    "LAYER_PARAMS",
    "OuroOutput",
    "attention_inputs",
    "attention_output",
    "causal_attention",
    "embed",
    "exit_logit",
    "exit_loops",
    "exit_probabilities",
    "expected_logits",
    "final_norm",
    "forward",
    "layer_params",
    "logits",
    "loop_outputs",
]

#: Names of the per-layer parameters (each with a leading [num_layers] axis in the pytree).
LAYER_PARAMS = (*_LLAMA_LAYER_PARAMS, "input_layernorm_2", "post_attention_layernorm_2")


def attention_output(layer: dict, h: jax.Array, attn: jax.Array, config: ModelConfig) -> jax.Array:
    """The layer's output [B,T,H] from its input h [B,T,H] and attention result attn [B,T,Hq,D].

    h + input_layernorm_2(o_proj(attn)), then + post_attention_layernorm_2(MLP(
    post_attention_layernorm(.))).
    """
    eps = config.rms_norm_eps
    b, t = attn.shape[:2]
    o = linear(attn.reshape(b, t, -1).astype(h.dtype), layer["o_proj"])
    h = h + rms_norm(o, layer["input_layernorm_2"], eps)
    x = rms_norm(h, layer["post_attention_layernorm"], eps)
    m = swiglu(x, layer["gate_proj"], layer["up_proj"], layer["down_proj"])
    return h + rms_norm(m, layer["post_attention_layernorm_2"], eps)


def decoder_layer(layer: dict, h: jax.Array, positions: jax.Array | None, config: ModelConfig):
    """One decoder layer with full causal attention over the T positions of h (no cache)."""
    q, k, v = attention_inputs(layer, h, positions, config)
    return attention_output(layer, h, causal_attention(q, k, v), config)


def exit_logit(params: dict, h: jax.Array) -> jax.Array:
    """The early-exit gate's logit [B, T] float32 of a loop's *final-normed* output h [B,T,H]."""
    gate = params["early_exit_gate"]
    weight = gate["weight"].astype(jnp.float32)
    return h.astype(jnp.float32) @ weight + gate["bias"].astype(jnp.float32)


def exit_probabilities(gate_logits: jax.Array) -> jax.Array:
    """Exit distribution [..., N] float32 over the N loops from the gate logits [..., N].

    p_l = sigmoid(g_l) * prod_{j<l}(1 - sigmoid(g_j)) for l < N-1; p_{N-1} is the rest, so each
    row sums to 1 (up to rounding).
    """
    lam = jax.nn.sigmoid(gate_logits.astype(jnp.float32))
    stay = jnp.cumprod(1.0 - lam, axis=-1)
    remaining = jnp.concatenate([jnp.ones_like(stay[..., :1]), stay[..., :-1]], axis=-1)
    n = lam.shape[-1]
    lam_exit = jnp.where(jnp.arange(n) == n - 1, 1.0, lam)
    return lam_exit * remaining


def exit_loops(probs: jax.Array, threshold) -> jax.Array:
    """The loop [...] int32 each token exits at: the first whose cumulative exit probability
    (probs [..., N], from `exit_probabilities`) reaches `threshold`; the last loop when none
    does, or when threshold >= 1 (no early exit).
    """
    n = probs.shape[-1]
    reached = jnp.cumsum(probs, axis=-1) >= threshold
    first = jnp.where(reached.any(axis=-1), jnp.argmax(reached, axis=-1), n - 1)
    return jnp.where(jnp.asarray(threshold) >= 1.0, n - 1, first).astype(jnp.int32)


def expected_logits(loop_logits: jax.Array, probs: jax.Array) -> jax.Array:
    """Ouro's `use_weighted_exit` logits [B,T,V] f32: sum over loops of p_l * logits_l.

    loop_logits [N, B, T, V], probs [B, T, N] (`OuroOutput.loop_logits` / `.exit_probs`).
    """
    return jnp.einsum("nbtv,btn->btv", loop_logits, probs.astype(loop_logits.dtype))


class OuroOutput(NamedTuple):
    """`forward`'s result for tokens [B, T] (N = num_loops).

    loop_logits [N, B, T, V] f32: logits of each loop's normed output.
    exit_probs [B, T, N] f32: the exit distribution (`exit_probabilities`).
    exit_loop [B, T] int32: the loop each token exits at for the threshold used.
    logits [B, T, V] f32: loop_logits at each token's exit loop (Ouro's returned logits).
    """

    loop_logits: jax.Array
    exit_probs: jax.Array
    exit_loop: jax.Array
    logits: jax.Array


def loop_outputs(params: dict, config: ModelConfig, tokens: jax.Array):
    """Every loop's logits and exit-gate logit, full causal attention, no cache (not jitted:
    differentiable, for training and for `forward`).

    tokens [B, T] int -> (loop_logits [N, B, T, V] float32, gate_logits [B, T, N] float32),
    N = config.num_loops; `exit_probabilities(gate_logits)` is the exit distribution.
    """
    h = embed(params, tokens)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    loop_logits, gates = [], []
    for _ in range(config.num_loops):
        h = final_norm(params, run_layers(params, h, positions, config, decoder_layer), config)
        loop_logits.append(logits(params, h, config))
        gates.append(exit_logit(params, h))
    return jnp.stack(loop_logits), jnp.stack(gates, axis=-1)


@functools.partial(jax.jit, static_argnames="config")
def forward(params: dict, config: ModelConfig, tokens: jax.Array, threshold=None) -> OuroOutput:
    """Reference forward, full causal attention, no cache, all loops: tokens [B,T] -> OuroOutput.

    threshold: the early-exit threshold (None: config.early_exit_threshold; 1.0: no exit).
    """
    if threshold is None:
        threshold = config.early_exit_threshold
    loop_logits, gate_logits = loop_outputs(params, config, tokens)
    probs = exit_probabilities(gate_logits)
    exit_loop = exit_loops(probs, threshold)
    chosen = jnp.take_along_axis(loop_logits, exit_loop[None, :, :, None], axis=0)[0]
    return OuroOutput(loop_logits, probs, exit_loop, chosen)
