"""Page reconstruction: loop l of quantized paged KV in the cache dtype.

    from kvq_jax.kernels.page_reconstruct import decode_pages
    k = decode_pages(cache, "key", page_ids, loop=2)          # [N, page_size, H, D]

`api.decode_pages` is `kvq_jax.cache.paged_cache.decode_pages`; `backend="auto"` runs the Pallas
Triton kernel on a CUDA GPU when the configuration is supported (`config_support`), else the
XLA reference (`xla.py`); both give the same bytes (decoded NaNs compared as NaN).
"""

from kvq_jax.kernels.page_reconstruct.api import config_support, decode_pages

__all__ = ["config_support", "decode_pages"]
