"""The Torch paged cache (`paged_cache`), paged pack (`paged`) and paged decode attention
(`paged_attention`), with kvq_jax.cache's pages byte for byte (imports no JAX)."""
