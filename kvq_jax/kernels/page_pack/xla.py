"""The XLA reference of page pack: `kvq_jax.paged.pack_paged` (vmap of `pack_kv` over pages).

The kernel in `pallas_triton.py` is held to this function byte for byte.
"""

from __future__ import annotations

from kvq_jax import paged
from kvq_jax.packed import PackedKV


def pack_pages(pages, *, kind: str, format: str, group_size: int, axis: str) -> PackedKV:
    """Pack validated pages [P, page_size, H, D] (axis and group_size resolved) with XLA."""
    return paged.pack_paged(
        pages, kind=kind, format=format, group_size=group_size, axis=axis, backend="xla"
    )
