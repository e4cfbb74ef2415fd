"""Quantized paged decode attention: one query token per sequence over an append-time
quantized `PagedKVCache`, K and V dequantized in registers (never written to memory).

    from kvq_jax.kernels.paged_attention import paged_decode_attention, config_support
    out = paged_decode_attention(q, cache, block_tables, seq_lens, loop=3, backend="auto")
"""

from kvq_jax.kernels.paged_attention.api import (
    config_support,
    default_num_splits,
    paged_decode_attention,
)

__all__ = ["config_support", "default_num_splits", "paged_decode_attention"]
