"""kvq: 4-bit KV-cache codecs for looped language models, in JAX.

    packed = kvq_jax.pack_kv(values, kind="key", format="int4")
    values_hat = kvq_jax.unpack_kv(packed)

Loop stacks: `encode_loops` / `decode_loops` / `decode_loop`; single residuals:
`encode_residual` / `decode_residual`; serving pages: `pack_paged` / `unpack_paged`, the
append-time cache `kvq_jax.cache.paged_cache` (init_cache / append / gather) and
`paged_decode_attention`.
`kvq_jax.oracle` is the plain-Python scalar reference that every implementation is tested
against (it does not use JAX), and `kvq_jax.conformance` ships its vectors.

The package imports lazily: `import kvq_jax.core` (the framework-neutral modules shared with
the Torch stack) does not import JAX; the first use of a public name below imports its module.
docs/LAYERS.md shows which module may import which.
"""

from __future__ import annotations

import importlib

#: Public name -> the module that defines it.
_EXPORTS = {
    "CODECS": "kvq_jax.codecs.registry",
    "get_codec": "kvq_jax.codecs.registry",
    "register_codec": "kvq_jax.codecs.registry",
    "unregister_codec": "kvq_jax.codecs.registry",
    "Codec": "kvq_jax.codecs.codec",
    "IntBCodec": "kvq_jax.codecs.formats.intb",
    "PackedKV": "kvq_jax.codecs.packed",
    "WindowedKV": "kvq_jax.codecs.packed",
    "pack_kv": "kvq_jax.codecs.api",
    "unpack_kv": "kvq_jax.codecs.api",
    "HeavyKV": "kvq_jax.codecs.heavy",
    "pack_heavy": "kvq_jax.codecs.heavy",
    "select_heavy": "kvq_jax.codecs.heavy",
    "unpack_heavy": "kvq_jax.codecs.heavy",
    "KVResidual": "kvq_jax.codecs.residual",
    "decode_residual": "kvq_jax.codecs.residual",
    "encode_residual": "kvq_jax.codecs.residual",
    "validate_positions": "kvq_jax.codecs.residual",
    "LoopCode": "kvq_jax.codecs.loops",
    "decode_loop": "kvq_jax.codecs.loops",
    "decode_loops": "kvq_jax.codecs.loops",
    "encode_loops": "kvq_jax.codecs.loops",
    "pack_paged": "kvq_jax.cache.paged",
    "unpack_paged": "kvq_jax.cache.paged",
    "PagedCacheConfig": "kvq_jax.core.cache_config",
    "PagedKVCache": "kvq_jax.codecs.cache_state",
    "dense_decode_attention": "kvq_jax.codecs.attention",
    "paged_decode_attention": "kvq_jax.cache.paged_attention",
    "Window": "kvq_jax.core.window",
    "DEFAULT_AXIS": "kvq_jax.core.constants",
    "KINDS": "kvq_jax.core.constants",
}

#: Modules users reach as attributes (`from kvq_jax import paged_cache`) -> where they live.
_MODULES = {
    "paged": "kvq_jax.cache.paged",
    "paged_cache": "kvq_jax.cache.paged_cache",
    "paged_attention": "kvq_jax.cache.paged_attention",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'kvq_jax' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS, *_MODULES])
