"""Generation engine: a model (`kvq_jax.models`) over quantized paged KV caches.

`Engine(model, policy, num_pages=, page_size=, max_seqs=, max_pages_per_seq=, loop_kv=,
skip_exited=)` owns the layers' stores (`stores`: layer groups folded into one cache each) and
a `PageAllocator`; the jitted steps (`runner`: `prefill_step`, `decode_step`, `lax.scan` over
layers, loop-KV sharing, exits that skip loops) run with the stores donated; the `scheduler`
(priorities, pages on demand, preemption by swap to host memory); greedy /
temperature / top-k sampling with explicit PRNG keys (`sampler`); continuous batching. See
`kvq_jax.engine.engine` for what attention reads, and `kvq_jax.engine.generate` for
`kvq generate`.

Lazy: importing the package (as `kvq --help` does for `generate`'s options) loads no JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "engine",
    "Request": "engine",
    "cache_config_for": "engine",
    "resolve_policy": "engine",
    "StepSpec": "runner",
    "decode_step": "runner",
    "prefill_attention": "runner",
    "prefill_step": "runner",
    "sample": "sampler",
    "Plan": "scheduler",
    "Scheduler": "scheduler",
    "QuantizedStore": "stores",
    "RawStore": "stores",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"kvq_jax.engine.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kvq_jax.engine' has no attribute {name!r}")
