"""Pure-JAX language models for kvq: Llama (SmolLM2) and Ouro (looped), one module each.

No flax (or any other module framework): the parameters are a plain pytree of jax arrays
(nested dicts, layers stacked on a leading axis), so they jit, shard with `NamedSharding`
(`jax.device_put(params, shardings_pytree)`) and donate (`donate_argnums`) as they are, with
no framework state to convert or unwrap. The model is a `ModelConfig` (frozen, hashable: a
static argument under jit) plus functions of (params, config, arrays).

The per-layer pieces leave room for a KV cache between the projections and attention:

    m = kvq_jax.models.load_model("smollm2", "float32")
    arch, cfg = m.module, m.config                      # kvq_jax.models.llama / .ouro
    h = arch.embed(m.params, tokens)                    # [B, T, H]
    for loop in range(cfg.num_loops):                   # 1 for Llama
        for i in range(cfg.num_layers):
            layer = arch.layer_params(m.params, i)
            q, k, v = arch.attention_inputs(layer, h, positions, cfg)   # post-RoPE
            attn = ...  # attention over the (loop, i) cache holding k, v: [B, T, Hq, D]
            h = arch.attention_output(layer, h, attn, cfg)
        h = arch.final_norm(m.params, h, cfg)           # Ouro: after every loop
        # Ouro: arch.logits(m.params, h, cfg), arch.exit_logit(m.params, h) per loop
    logits = arch.logits(m.params, h, cfg)              # (Llama: after the final norm)

`llama.forward` / `ouro.forward` are the cache-free references (full causal attention).
"""

from kvq_jax.models import llama, ouro
from kvq_jax.models.config import ModelConfig
from kvq_jax.models.loading import (
    MissingPackages,
    Model,
    architecture,
    check_requirements,
    load_gguf,
    load_hf_directory,
    load_model,
)
from kvq_jax.models.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "MissingPackages",
    "Model",
    "ModelConfig",
    "Tokenizer",
    "architecture",
    "check_requirements",
    "llama",
    "load_gguf",
    "load_hf_directory",
    "load_model",
    "load_tokenizer",
    "ouro",
]
