"""Page reconstruction: loop l of quantized paged KV in the cache dtype (issue 6, kernel 2).

    from kvq_jax.kernels.page_reconstruct import reconstruct_pages
    k = reconstruct_pages(cache, "key", page_ids, loop=2)          # [N, page_size, H, D]

`backend="auto"` runs the Pallas Triton kernel on a CUDA GPU when the configuration is
supported (`config_support`), else the XLA reference (`kvq_jax.paged_cache.decode_pages`);
both give the same bytes (decoded NaNs compared as NaN).
"""

from kvq_jax.kernels.page_reconstruct.api import config_support, reconstruct_pages

__all__ = ["config_support", "reconstruct_pages"]
