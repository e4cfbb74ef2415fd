"""kvq: 4-bit KV-cache codecs for looped language models, in JAX.

    packed = kvq_jax.pack_kv(values, kind="key", format="int4")
    values_hat = kvq_jax.unpack_kv(packed)

Loop stacks: `encode_loops` / `decode_loops` / `decode_loop`; single residuals:
`encode_residual` / `decode_residual`; serving pages: `pack_paged` / `unpack_paged`, the
append-time cache `kvq_jax.paged_cache` (init_cache / append / gather) and
`paged_decode_attention`.
`kvq_jax.oracle` is the plain-Python scalar reference that every implementation is tested
against (it does not use JAX), and `kvq_jax.conformance` ships its vectors.
"""

from kvq_jax.api import pack_kv, unpack_kv
from kvq_jax.codec import Codec
from kvq_jax.loops import LoopCode, decode_loop, decode_loops, encode_loops
from kvq_jax.packed import PackedKV
from kvq_jax.paged import pack_paged, unpack_paged
from kvq_jax.paged_attention import dense_decode_attention, paged_decode_attention
from kvq_jax.paged_cache import PagedCacheConfig, PagedKVCache
from kvq_jax.registry import CODECS, get_codec, register_codec, unregister_codec
from kvq_jax.residual import KVResidual, decode_residual, encode_residual, validate_positions
from kvq_jax.spec import DEFAULT_AXIS, KINDS
from kvq_jax.window import Window, WindowedKV

__all__ = [
    "CODECS",
    "DEFAULT_AXIS",
    "KINDS",
    "Codec",
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
    "get_codec",
    "pack_kv",
    "pack_paged",
    "paged_decode_attention",
    "register_codec",
    "unpack_kv",
    "unpack_paged",
    "unregister_codec",
    "validate_positions",
]
__version__ = "0.1.0"
