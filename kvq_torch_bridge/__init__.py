"""kvq's Torch stack: a Torch codec with kvq_jax's API and bytes, and a zero-copy DLPack bridge.

    packed = kvq_torch_bridge.pack_kv(values, kind="key", format="nvfp4")   # torch tensors
    values_hat = kvq_torch_bridge.unpack_kv(packed)
    jax_packed = kvq_torch_bridge.from_torch(packed)      # shares every buffer with JAX
    torch_packed = kvq_torch_bridge.to_torch(jax_packed)

The Torch codec is the PyTorch fallback for GPUs without a Pallas path (CPU and CUDA tensors,
vectorized). It produces the same bytes as kvq_jax and the scalar oracle for every format,
checked on the shared conformance vectors (`kvq conformance kvq_torch_bridge:pack_kv
--input torch`).

Importing the Torch stack does not import JAX: it shares only `kvq_jax.core` (the
framework-neutral modules) with kvq_jax. The DLPack bridge (`from_torch`, `to_torch`,
`jax_to_torch`, `torch_to_jax`, `CopyWarning`) needs both and imports JAX on first use;
`KVQCache` (a transformers `Cache` backed by kvq's serving cache) imports transformers on
first use.
"""

import importlib

from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.constants import DEFAULT_AXIS, KINDS
from kvq_jax.core.window import Window
from kvq_torch_bridge import serving
from kvq_torch_bridge.cache import paged, paged_attention, paged_cache
from kvq_torch_bridge.cache.paged import pack_paged, unpack_paged
from kvq_torch_bridge.cache.paged_attention import dense_decode_attention, paged_decode_attention
from kvq_torch_bridge.cache.paged_cache import PagedKVCache
from kvq_torch_bridge.codecs.api import pack_kv, unpack_kv
from kvq_torch_bridge.codecs.codec import Codec
from kvq_torch_bridge.codecs.formats.intb import IntBCodec
from kvq_torch_bridge.codecs.heavy import HeavyKV, pack_heavy, select_heavy, unpack_heavy
from kvq_torch_bridge.codecs.loops import LoopCode, decode_loop, decode_loops, encode_loops
from kvq_torch_bridge.codecs.packed import KVResidual, PackedKV, WindowedKV
from kvq_torch_bridge.codecs.registry import CODECS, get_codec, register_codec, unregister_codec
from kvq_torch_bridge.codecs.residual import decode_residual, encode_residual, validate_positions
from kvq_torch_bridge.serving import KV_CACHE_DTYPES


def format_for_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """The kvq format a `kv_cache_dtype` stores K in (`kvq_torch_bridge.serving`'s names:
    "int4", "nvfp4", "kvq:fp8", ...); ValueError for raw, unknown and refused names."""
    policy = serving.policy_for_kv_cache_dtype(kv_cache_dtype)
    if policy is None:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} stores raw rows, no kvq format")
    return policy.formats("key")[0]


#: Names of the DLPack bridge, imported (with JAX) on first use.
_BRIDGE = ("CopyWarning", "from_torch", "jax_to_torch", "to_torch", "torch_to_jax")


def __getattr__(name: str):
    if name in _BRIDGE:
        value = getattr(importlib.import_module("kvq_torch_bridge.bridge"), name)
        globals()[name] = value
        return value
    if name == "KVQCache":  # a transformers Cache: imports transformers on first use
        from kvq_torch_bridge.serving import hf_cache

        globals()[name] = hf_cache.KVQCache
        return hf_cache.KVQCache
    raise AttributeError(f"module 'kvq_torch_bridge' has no attribute {name!r}")


__all__ = [
    "CODECS",
    "DEFAULT_AXIS",
    "KINDS",
    "KV_CACHE_DTYPES",
    "Codec",
    "CopyWarning",
    "HeavyKV",
    "IntBCodec",
    "KVQCache",
    "KVResidual",
    "LoopCode",
    "PackedKV",
    "PagedCacheConfig",
    "PagedKVCache",
    "Window",
    "WindowedKV",
    "decode_loop",
    "decode_loops",
    "decode_residual",
    "dense_decode_attention",
    "encode_loops",
    "encode_residual",
    "format_for_kv_cache_dtype",
    "from_torch",
    "get_codec",
    "jax_to_torch",
    "pack_heavy",
    "pack_kv",
    "pack_paged",
    "paged",
    "paged_attention",
    "paged_cache",
    "paged_decode_attention",
    "register_codec",
    "select_heavy",
    "to_torch",
    "torch_to_jax",
    "unpack_heavy",
    "unpack_kv",
    "unpack_paged",
    "unregister_codec",
    "validate_positions",
]
