"""Tiny random float32 models for the engine tests (the `tiny_llama` / `tiny_ouro` fixtures of
conftest.py, and the tests that build their own variants)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvq_jax.models import Model, ModelConfig, llama, ouro

VOCAB = 97


def tiny_model(arch="llama", seed=0, *, layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64,
               loops=1, threshold=1.0, eos=None) -> Model:  # fmt: skip
    """A random float32 model built as a params pytree (untied head: varied greedy tokens)."""
    config = ModelConfig(
        arch=arch, vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=96, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, num_loops=loops,
        early_exit_threshold=threshold, eos_token_id=eos,
    )  # fmt: skip
    rng = np.random.default_rng(seed)

    def w(*shape, scale=None):
        scale = shape[-2] ** -0.5 if scale is None else scale
        return jnp.asarray(rng.normal(0, scale, shape), jnp.float32)

    n, inter = layers, 96
    layer = dict(
        q_proj=w(n, hidden, heads * head_dim), k_proj=w(n, hidden, kv_heads * head_dim),
        v_proj=w(n, hidden, kv_heads * head_dim), o_proj=w(n, heads * head_dim, hidden),
        gate_proj=w(n, hidden, inter), up_proj=w(n, hidden, inter), down_proj=w(n, inter, hidden),
    )  # fmt: skip
    names = ouro.LAYER_PARAMS if arch == "ouro" else llama.LAYER_PARAMS
    for name in names:
        if "norm" in name:
            layer[name] = jnp.asarray(1 + 0.1 * rng.normal(size=(n, hidden)), jnp.float32)
    params = dict(
        embed_tokens=w(VOCAB, hidden, scale=1.0),
        norm=jnp.asarray(1 + 0.1 * rng.normal(size=hidden), jnp.float32),
        lm_head=w(hidden, VOCAB, scale=2 * hidden**-0.5),
        layers=layer,
    )
    if arch == "ouro":
        params["early_exit_gate"] = {"weight": w(hidden, 1, scale=0.3)[:, 0],
                                     "bias": jnp.asarray(-0.5, jnp.float32)}  # fmt: skip
    return Model(config, params, None, {"model": "tiny"})


def prompt_of(length, seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()
