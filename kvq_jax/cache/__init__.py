"""The public cache ops: paged pack (`paged`), the append-time paged cache (`paged_cache`:
init_cache / append / gather) and quantized paged decode attention (`paged_attention`).

Each dispatches to the kernel `api` modules below it (`kvq_jax.kernels.<op>.api`).
"""
