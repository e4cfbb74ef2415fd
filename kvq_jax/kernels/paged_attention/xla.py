"""The XLA reference of quantized paged decode attention (what the kernel is held to).

Every sequence's K and V are read from the cache (`cache_state.read_batch` with the XLA page
decoder: quantized pages through the residual chain up to `loop`, staging rows for the partial
page, raw sink rows, rows >= seq_len zeroed), then dense float32 attention at HIGHEST precision
(`kvq_jax.attention.attend`).
"""

from __future__ import annotations

from kvq_jax import cache_state
from kvq_jax.attention import attend
from kvq_jax.kernels.page_reconstruct import xla as page_xla


def paged_decode_attention(q, cache, block_tables, seq_lens, seq_ids, *, loop: int):
    """Validated arguments (seq_ids an int32 [B] array) -> float32 [B, Hq, D] (traceable)."""

    def decode(kind, pages):
        base, delta = cache_state.planes(cache, kind)
        return page_xla.decode_pages(base, delta, pages, loop=loop, depth=cache.depth)

    rows = cache_state.table_rows(block_tables, seq_ids)
    k, v = cache_state.read_batch(cache, rows, seq_lens, seq_ids, loop=loop, decode=decode)
    return attend(q, k, v, seq_lens)


__all__ = ["paged_decode_attention"]
