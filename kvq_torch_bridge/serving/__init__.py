"""kvq's KV cache driven the way a Torch serving system drives one (vLLM's v1 attention
backends): `allocate_kv_cache` per layer, `reshape_and_cache` by slot mapping, attention by
block tables (`paged_attention_decode`, `paged_attention_prefill`). Torch only: no JAX."""

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

__all__ = [
    "KV_CACHE_DTYPES",
    "REFUSED_DTYPES",
    "ServingKVCache",
    "allocate_kv_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "policy_for_kv_cache_dtype",
    "read_blocks",
    "reshape_and_cache",
]
