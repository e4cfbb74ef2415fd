"""kvq's KV cache driven the way a Torch serving system drives one (vLLM's v1 attention
backends): `allocate_kv_cache` per layer, `reshape_and_cache` by slot mapping, attention by
block tables (`paged_attention_decode`, `paged_attention_prefill`). Torch only: no JAX.
`KVQCache` (a transformers `Cache` on this cache, `hf_cache.py`) imports transformers on first
use."""

from kvq_torch_bridge.serving.attention import paged_attention_decode, paged_attention_prefill
from kvq_torch_bridge.serving.kv_cache import (
    KV_CACHE_DTYPES,
    REFUSED_DTYPES,
    ServingKVCache,
    allocate_kv_cache,
    policy_for_kv_cache_dtype,
    read_blocks,
    reshape_and_cache,
)

#: Names of the transformers Cache (`hf_cache`), imported (with transformers) on first use.
_HF_CACHE = ("KVQCache", "KVQLayer")


def __getattr__(name: str):
    if name in _HF_CACHE:
        from kvq_torch_bridge.serving import hf_cache

        value = getattr(hf_cache, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvq_torch_bridge.serving' has no attribute {name!r}")


__all__ = [
    "KV_CACHE_DTYPES",
    "REFUSED_DTYPES",
    "KVQCache",
    "KVQLayer",
    "ServingKVCache",
    "allocate_kv_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "policy_for_kv_cache_dtype",
    "read_blocks",
    "reshape_and_cache",
]
