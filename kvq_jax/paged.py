"""Paged KV: the codecs applied page by page to a serving engine's [P, page_size, H, D] pages.

Every page owns everything needed to decode it (codes, group metadata and, for NVFP4, its own
global scale), so a page can be freed, reordered, offloaded, transferred or prefix-shared
without touching another. A token-axis group therefore never spans two pages: the group size
must divide the page size. The packed pages are a `PackedKV` whose arrays carry a leading page
axis (`batch_shape == (P,)`); page i is `jax.tree.map(lambda a: a[i], packed)`.

Real cost of page-local groups (bits per element, complete pages, D = 128, even D):
  INT4 K with G = page_size = 16: 4 + 32/16 = 6 bits; G = 32 (page 32 or 64): 5; G = 64: 4.5.
  INT4 V (channel groups, independent of the page): 4.5 at G = 64.
  NVFP4: 4.5 bits + 32 bits per page for the global scale: 4.5 + 32/(page_size * H * D),
  4.50098 at page 16, H 16, D 128 (4.5156 at page 16, H 1, D 128).
  FP8 E4M3: 8 + 32/D = 8.25 bits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kvq_jax.api import pack_kv, unpack_kv
from kvq_jax.layouts import check_float_dtype
from kvq_jax.packed import PackedKV
from kvq_jax.registry import get_codec


def check_pages(pages) -> tuple[int, int, int, int]:
    """Validate [P, page_size, H, D] pages; return the shape."""
    if pages.ndim != 4:
        raise ValueError(f"pages must have rank 4 [P, page_size, H, D], got shape {pages.shape}")
    check_float_dtype(pages.dtype, "pages.dtype")
    num_pages, page_size, h, d = pages.shape
    if page_size < 1 or h < 1 or d < 1:
        raise ValueError(f"pages must have page_size, H, D >= 1, got shape {pages.shape}")
    return num_pages, page_size, h, d


def resolve_paged(format: str, kind: str, page_shape, axis, group_size):
    """(axis, group_size) for pages of `page_shape` = (page_size, H, D).

    Token-axis groups must divide page_size. With group_size None, a codec whose group size is
    free (INT4) takes gcd(default, page_size), e.g. 16 for 16-token pages, 64 for 128.
    """
    codec = get_codec(format)
    page_size = page_shape[0]
    axis, resolved = codec.resolve(page_shape, kind, axis, group_size)
    if (
        axis == "tokens"
        and page_size % resolved
        and group_size is None
        and not codec.fixed_group_size
    ):
        resolved = math.gcd(resolved, page_size)
    if axis == "tokens" and page_size % resolved:
        raise ValueError(
            f"group_size {resolved} must divide page_size {page_size} for token-axis "
            f"groups: a group may not span two pages (pick a divisor of {page_size})"
        )
    return axis, resolved


@functools.partial(jax.jit, static_argnames=("kind", "format", "group_size", "axis", "backend"))
def pack_paged(
    pages,
    *,
    kind: str,
    format: str = "int4",
    group_size: int | None = None,
    axis: str | None = None,
    backend: str = "auto",
) -> PackedKV:
    """Pack every page of `pages` [P, page_size, H, D] on its own (see the module doc).

    `group_size` defaults as in `resolve_paged`; token-axis groups must divide page_size.
    `backend`: "xla" (this module's reference path), "pallas" / "pallas_interpret" (the page
    pack kernel, `kvq_jax.kernels.page_pack`) or "auto" (the kernel where the device and the
    configuration allow, else XLA). Every backend returns the same bytes.
    """
    pages = jnp.asarray(pages)
    _, page_size, h, d = check_pages(pages)
    axis, group_size = resolve_paged(format, kind, (page_size, h, d), axis, group_size)
    if backend != "xla":
        # Imported here: the kernel package builds on this module (its XLA path is this one).
        from kvq_jax.kernels.page_pack import api

        return api.pack_pages(
            pages, kind=kind, format=format, group_size=group_size, axis=axis, backend=backend
        )
    return jax.vmap(
        lambda page: pack_kv(page, kind=kind, format=format, group_size=group_size, axis=axis)
    )(pages)


@functools.partial(jax.jit, static_argnames=("dtype",))
def unpack_paged(packed: PackedKV, dtype=None) -> jax.Array:
    """Packed pages (leading page axis) -> [P, page_size, H, D] in `dtype` (reference path)."""
    if not isinstance(packed, PackedKV) or len(packed.batch_shape) != 1:
        raise TypeError("packed must be a PackedKV with one leading page axis (from pack_paged)")
    return jax.vmap(lambda page: unpack_kv(page, dtype))(packed)


def page_storage_bytes(packed: PackedKV) -> int:
    """Bytes one page occupies (every page of a packed cache costs the same)."""
    return packed.storage_bytes // packed.batch_shape[0]
