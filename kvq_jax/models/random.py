"""Seeded random models of real shapes, so anyone can run a shape without its weights.

`random_model("ouro-1.4b")` is Ouro-1.4B's architecture (24 layers x 4 loops, hidden 2048,
16 heads = 16 KV heads, head dim 128, FFN 5632, vocab 49152, RoPE base 1e6, untied head)
with random weights made directly in the requested dtype on the device, one tensor at a time
(no float32 copy of the model: ~2.8 GB in bfloat16). `"ouro-tiny"` is the same architecture at
4 layers x 4 loops, hidden 256, for tests and quick runs. `load_model("random:NAME")` loads
them. The weights are N(0, 1/fan_in) (norm weights 1, exit gate N(0, 1/hidden) with bias 0),
so activations keep their scale through the stack; the tokens mean nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvq_jax.models.config import ModelConfig

__all__ = ["RANDOM_MODELS", "random_model"]

_OURO = dict(arch="ouro", rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
             num_loops=4, early_exit_threshold=1.0, bos_token_id=0, eos_token_id=0)  # fmt: skip

#: name -> ModelConfig of the random models `load_model("random:<name>")` builds.
RANDOM_MODELS = {
    "ouro-1.4b": ModelConfig(
        vocab_size=49152,
        hidden_size=2048,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        intermediate_size=5632,
        max_position_embeddings=65536,
        **_OURO,
    ),
    "ouro-tiny": ModelConfig(
        vocab_size=1024,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=512,
        max_position_embeddings=4096,
        **_OURO,
    ),
}


def random_model(name: str, dtype="bfloat16", *, seed: int = 0):
    """The `Model` of RANDOM_MODELS[name] with seeded random weights in `dtype`
    (ValueError for an unknown name)."""
    from kvq_jax.models.loading import Model

    if name not in RANDOM_MODELS:
        raise ValueError(f"unknown random model {name!r}; known: {', '.join(RANDOM_MODELS)}")
    c = RANDOM_MODELS[name]
    dtype = jnp.dtype(dtype)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))

    def normal(*shape, fan_in):
        # one jitted draw per tensor, produced in `dtype` (no float32 model copy)
        return _normal(next(keys), shape, dtype, fan_in**-0.5)

    n, h, q, kv, f = (c.num_layers, c.hidden_size, c.num_heads * c.head_dim,
                      c.num_kv_heads * c.head_dim, c.intermediate_size)  # fmt: skip
    ones = jnp.ones((n, h), dtype)
    layers = dict(
        q_proj=normal(n, h, q, fan_in=h), k_proj=normal(n, h, kv, fan_in=h),
        v_proj=normal(n, h, kv, fan_in=h), o_proj=normal(n, q, h, fan_in=q),
        gate_proj=normal(n, h, f, fan_in=h), up_proj=normal(n, h, f, fan_in=h),
        down_proj=normal(n, f, h, fan_in=f), input_layernorm=ones,
        post_attention_layernorm=ones, input_layernorm_2=ones, post_attention_layernorm_2=ones,
    )  # fmt: skip
    params = dict(
        embed_tokens=normal(c.vocab_size, h, fan_in=1),
        norm=jnp.ones((h,), dtype),
        lm_head=normal(h, c.vocab_size, fan_in=h),
        layers=layers,
        early_exit_gate={"weight": normal(h, fan_in=h), "bias": jnp.zeros((), dtype)},
    )
    source = {"model": f"random:{name}", "seed": seed, "arch": c.arch, "dtype": dtype.name,
              "format": "random weights"}  # fmt: skip
    return Model(c, params, None, source)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key, shape, dtype, scale):
    return (jax.random.normal(key, shape, dtype) * jnp.asarray(scale, dtype)).astype(dtype)
