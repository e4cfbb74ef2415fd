"""Paged KV: the codecs applied page by page to a serving engine's [P, page_size, H, D] pages.

Every page owns everything needed to decode it (codes, group metadata and, for NVFP4, its own
global scale), so a page can be freed, reordered, offloaded, transferred or prefix-shared
without touching another. A token-axis group therefore never spans two pages: the group size
must divide the page size. The packed pages are a `PackedKV` whose arrays carry a leading page
axis (`batch_shape == (P,)`); page i is `jax.tree.map(lambda a: a[i], packed)`. `pack_paged`
(`kvq_jax.kernels.page_pack.api`) runs the XLA reference or the Pallas kernel (`backend=`).

Real cost of page-local groups (bits per element, complete pages, D = 128, even D):
  INT4 K with G = page_size = 16: 4 + 32/16 = 6 bits; G = 32 (page 32 or 64): 5; G = 64: 4.5.
  INT4 V (channel groups, independent of the page): 4.5 at G = 64.
  NVFP4: 4.5 bits + 32 bits per page for the global scale: 4.5 + 32/(page_size * H * D),
  4.50098 at page 16, H 16, D 128 (4.5156 at page 16, H 1, D 128).
  FP8 E4M3: 8 + 32/D = 8.25 bits.
"""

from __future__ import annotations

import functools

import jax

from kvq_jax.codecs.api import unpack_kv
from kvq_jax.codecs.packed import PackedKV
from kvq_jax.core.cache_config import resolve_paged
from kvq_jax.core.checks import check_packed_pages
from kvq_jax.kernels.page_pack.api import pack_paged

__all__ = ["pack_paged", "page_storage_bytes", "resolve_paged", "unpack_paged"]


@functools.partial(jax.jit, static_argnames=("dtype",))
def unpack_paged(packed: PackedKV, dtype=None) -> jax.Array:
    """Packed pages (leading page axis) -> [P, page_size, H, D] in `dtype` (reference path)."""
    check_packed_pages(packed, PackedKV)
    return jax.vmap(lambda page: unpack_kv(page, dtype))(packed)


def page_storage_bytes(packed: PackedKV) -> int:
    """Bytes one page occupies (every page of a packed cache costs the same)."""
    return packed.storage_bytes // check_packed_pages(packed, PackedKV)
