"""The JAX codec stack: formats, the registry, pack/unpack, residuals, loops, heavy rows, RoPE,
the packed containers (`PackedKV`, `PagedKVCache`) and the dense attention reference.

Sits on the framework-neutral layer (`kvq_jax.core`); the kernels and the cache sit on it.
Public names are re-exported lazily by `kvq_jax` (`kvq_jax.pack_kv`, ...).
"""
