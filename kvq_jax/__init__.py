"""kvq: 4-bit KV-cache codecs for looped language models, in JAX.

    packed = kvq_jax.pack_kv(values, kind="key", format="int4")
    values_hat = kvq_jax.unpack_kv(packed)

Loop stacks: `encode_loops` / `decode_loops` / `decode_loop`; single residuals:
`encode_residual` / `decode_residual`; serving pages: `pack_paged` / `unpack_paged`, the
append-time cache `kvq_jax.paged_cache` (init_cache / append / gather) and
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
    "CODECS": "kvq_jax.registry",
    "get_codec": "kvq_jax.registry",
    "register_codec": "kvq_jax.registry",
    "unregister_codec": "kvq_jax.registry",
    "Codec": "kvq_jax.codec",
    "IntBCodec": "kvq_jax.formats.intb",
    "PackedKV": "kvq_jax.packed",
    "WindowedKV": "kvq_jax.packed",
    "pack_kv": "kvq_jax.api",
    "unpack_kv": "kvq_jax.api",
    "HeavyKV": "kvq_jax.heavy",
    "pack_heavy": "kvq_jax.heavy",
    "select_heavy": "kvq_jax.heavy",
    "unpack_heavy": "kvq_jax.heavy",
    "KVResidual": "kvq_jax.residual",
    "decode_residual": "kvq_jax.residual",
    "encode_residual": "kvq_jax.residual",
    "validate_positions": "kvq_jax.residual",
    "LoopCode": "kvq_jax.loops",
    "decode_loop": "kvq_jax.loops",
    "decode_loops": "kvq_jax.loops",
    "encode_loops": "kvq_jax.loops",
    "pack_paged": "kvq_jax.paged",
    "unpack_paged": "kvq_jax.paged",
    "PagedCacheConfig": "kvq_jax.core.cache_config",
    "PagedKVCache": "kvq_jax.cache_state",
    "dense_decode_attention": "kvq_jax.attention",
    "paged_decode_attention": "kvq_jax.paged_attention",
    "Window": "kvq_jax.core.window",
    "DEFAULT_AXIS": "kvq_jax.core.constants",
    "KINDS": "kvq_jax.core.constants",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvq_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
