"""XLA reference of page reconstruction: `kvq_jax.paged_cache.decode_pages` itself."""

from __future__ import annotations

from kvq_jax.paged_cache import decode_pages


def reconstruct_pages_xla(cache, kind: str, pages, *, loop: int):
    """Loop `loop` of physical pages `pages` through the residual chain, with XLA:
    [N, page_size, H, D] in the cache dtype (every intermediate loop is materialized)."""
    return decode_pages(cache, kind, pages, loop=loop, backend="xla")
