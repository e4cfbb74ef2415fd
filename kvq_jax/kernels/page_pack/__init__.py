"""Page pack: quantize full KV pages [P, page_size, H, D] (the serving append path).

    packed = pack_pages(pages, kind="key", format="int4", backend="auto")

Same arguments, defaults, checks and result as `kvq_jax.pack_paged`; `backend` picks the XLA
reference or the Pallas Triton kernel (`kvq_jax.kernels.backend`).
"""

from kvq_jax.kernels.page_pack.api import config_support, pack_pages

__all__ = ["config_support", "pack_pages"]
