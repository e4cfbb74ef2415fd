"""Every layer's attention inputs in every loop of a cache-free forward: what a K/V capture
(`kvq report --kv`) and key-table calibration (`kvq calibrate`) read from a model.

    q, k, v = attention_inputs_per_layer(m.params, m.config, tokens)
    # q [loops, layers, B, T, Hq, D], k / v [loops, layers, B, T, H, D]: post-RoPE, the
    # compute dtype; the layers under one lax.scan per loop (compile O(1) in layers)

The arithmetic is the architecture's own (`attention_inputs`, `causal_attention`,
`attention_output`, the final norm after every loop), so the rows are the ones `forward`
attends with; for a plain Llama with loops > 1 it is the emulation `llama.forward` runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvq_jax.models._layers import causal_attention
from kvq_jax.models.config import ModelConfig
from kvq_jax.models.loading import architecture

__all__ = ["attention_inputs_per_layer"]


@functools.partial(jax.jit, static_argnames=("config", "loops"))
def attention_inputs_per_layer(params: dict, config: ModelConfig, tokens: jax.Array,
                               loops: int | None = None):  # fmt: skip
    """tokens int [B, T] -> (q [N, L, B, T, Hq, D], k [N, L, B, T, H, D], v [...]) of each
    loop and layer, N = loops (default config.num_loops), L = config.num_layers."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, tokens], got shape {tokens.shape}")
    n = config.num_loops if loops is None else loops
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"loops must be an int >= 1, got {loops!r}")
    arch = architecture(config)
    h = arch.embed(params, tokens)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)

    def layer_step(h, layer):
        q, k, v = arch.attention_inputs(layer, h, positions, config)
        return arch.attention_output(layer, h, causal_attention(q, k, v), config), (q, k, v)

    per_loop = []
    for _ in range(n):
        h, qkv = jax.lax.scan(layer_step, h, params["layers"])
        h = arch.final_norm(params, h, config)
        per_loop.append(qkv)
    return tuple(jnp.stack(x) for x in zip(*per_loop, strict=True))
