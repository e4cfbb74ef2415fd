"""Decode attention over a `PagedKVCache`.

`paged_decode_attention` (`kvq_jax.kernels.paged_attention.api`) runs the XLA reference (the
sequences' K and V read from the cache, then dense float32 attention) or the fused Pallas
kernel that dequantizes pages in registers (`backend=`; "auto": the kernel on a CUDA GPU for
configurations it supports). `dense_decode_attention` is the unquantized reference.
"""

from __future__ import annotations

from kvq_jax.codecs.attention import dense_decode_attention
from kvq_jax.kernels.paged_attention.api import paged_decode_attention

__all__ = ["dense_decode_attention", "paged_decode_attention"]
