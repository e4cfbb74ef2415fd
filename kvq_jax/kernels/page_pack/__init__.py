"""Page pack: quantize full KV pages [P, page_size, H, D] (the serving append path).

    packed = pack_paged(pages, kind="key", format="int4", backend="auto")

`api.pack_paged` is `kvq_jax.pack_paged`; `backend` picks the XLA reference (`xla.py`) or the
Pallas Triton kernel (`pallas_triton.py`).
"""

from kvq_jax.kernels.page_pack.api import config_support, pack_paged

__all__ = ["config_support", "pack_paged"]
