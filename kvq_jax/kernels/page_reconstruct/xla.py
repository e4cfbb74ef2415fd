"""The XLA reference of page reconstruction: loop l of physical pages through the residual
chain, every intermediate loop materialized (the kernel keeps them in registers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvq_jax.api import unpack_kv
from kvq_jax.cache_state import codec_view
from kvq_jax.residual import KVResidual, decode_residual


def _take(packed, *index):
    """Pages `index` of a stored plane, with its format's dtypes (`codec_view`)."""
    return codec_view(jax.tree.map(lambda a: a[index], packed))


def decode_pages(base, delta, pages, *, loop: int, depth=None) -> jnp.ndarray:
    """Loop `loop` of physical pages `pages` (int32 [N]): [N, page_size, H, D] in the cache dtype.

    base: PackedKV, batch shape (P,) (loop 0 of every page); delta: PackedKV, batch shape
    (L - 1, P) (None when loop == 0); both as the cache stores them or with
    their format's dtypes. Each page is `unpack_kv` of its base, then loop by loop
    `decode_residual` of its delta against the previous loop (XLA index semantics for ids).
    depth: uint8 [P, page_size] or None (adaptive exits): a row keeps loop depth[row] once
    loop > depth[row] (the deltas of later loops are skipped).
    """
    recon = jax.vmap(unpack_kv)(_take(base, pages))
    rows = None if depth is None else depth[pages][:, :, None, None]
    for r in range(loop):
        step = jax.vmap(
            lambda p, prev: decode_residual(KVResidual(payload=p, shape=prev.shape), prev)
        )(_take(delta, r, pages), recon)
        recon = step if rows is None else jnp.where(rows >= r + 1, step, recon)
    return recon
