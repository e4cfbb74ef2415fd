"""Generation engine: a model (`kvq_jax.models`) over per-layer quantized paged KV caches.

`Engine(model, policy, num_pages=, page_size=, max_seqs=, max_pages_per_seq=)` owns one
`PagedKVCache` per layer (all loops of that layer) and a `PageAllocator`; jitted prefill and
decode steps with the caches donated; greedy / temperature / top-k sampling with explicit PRNG
keys; continuous batching. See `kvq_jax.engine.engine` for what attention reads.
"""

from kvq_jax.engine.engine import (
    Engine,
    RawPagedStore,
    Request,
    cache_config_for,
    prefill_attention,
    resolve_policy,
    sample,
)

__all__ = [
    "Engine",
    "RawPagedStore",
    "Request",
    "cache_config_for",
    "prefill_attention",
    "resolve_policy",
    "sample",
]
