"""The engine's sampler: greedy, temperature and top-k, with an explicit PRNG key per request."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["sample"]


@jax.jit
def sample(logits, keys, positions, temperature, top_k):
    """Next tokens [B] int32 of logits [B, V]: greedy where temperature <= 0, else a sample of
    softmax(logits / temperature) restricted to the top_k largest (top_k <= 0: all), with key
    fold_in(keys[b], positions[b]) (keys: uint32 [B, 2] raw PRNG keys)."""
    v = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    k = jnp.where((top_k <= 0) | (top_k > v), v, top_k)
    ordered = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    masked = jnp.where(logits >= kth, logits, -jnp.inf)
    scaled = masked / jnp.maximum(temperature, 1e-6)[:, None]
    step_keys = jax.vmap(jax.random.fold_in)(keys, positions)
    sampled = jax.vmap(jax.random.categorical)(step_keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
