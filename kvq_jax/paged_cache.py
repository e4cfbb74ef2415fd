"""The append-time quantized paged KV cache for looped LMs: the operations (functional, jittable).

The state is a `PagedKVCache` (`kvq_jax.cache_state`, which documents its fields) built by
`init_cache(PagedCacheConfig(...))`. `append` writes tokens, `gather` / `gather_batch` read a
sequence's reconstructed K and V, `decode_pages` reconstructs physical pages, `check_append`
runs an append's data checks on the host.

A page is quantized once, when it fills, and never again. For loop l > 0 its delta is taken
against loop l - 1 of the same physical page, so loop l - 1 must already be complete there:
append loop l - 1's tokens first (the natural order of a looped LM, prefill and decode alike;
`check_append` verifies seq_lens[l - 1] >= seq_lens[l] + n). The residual chain runs over the
quantized pages only; the raw sink rows replace the first `sink` rows at read time and take no
part in the chain.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvq_jax import cache_state
from kvq_jax._numerics import subtract_in_dtype
from kvq_jax.cache_state import PagedKVCache, check_cache, init_cache
from kvq_jax.core import checks
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.kernels.page_pack import api as page_pack
from kvq_jax.kernels.page_reconstruct import api as page_reconstruct
from kvq_jax.kernels.page_reconstruct.api import decode_pages

__all__ = [
    "PagedCacheConfig",
    "PagedKVCache",
    "append",
    "check_append",
    "decode_pages",
    "gather",
    "gather_batch",
    "init_cache",
]


def check_append(cache: PagedKVCache, k, v, *, block_tables, seq_ids, loop: int) -> None:
    """Host-side data checks of an `append` call (reads seq_lens, block_tables, seq_ids: a
    device->host transfer; `append` itself never syncs): `kvq_jax.core.checks.host_check_append`
    after the shape checks of `append`."""
    config = check_cache(cache)
    _, n = checks.check_append_args(config, k, v, block_tables, seq_ids, loop)
    checks.host_check_append(
        config, np.asarray(cache.seq_lens), n, np.asarray(block_tables), np.asarray(seq_ids), loop
    )


# -- append -----------------------------------------------------------------------------------


def _append_one(cache, kind, new, start, tables, seq_ids, loop, backend):
    """The update of one of K / V; returns (packed pages, staging, sink) of that kind."""
    config = cache.config
    ps, h, d, num_pages = config.page_size, config.num_heads, config.head_dim, config.num_pages
    b, n = new.shape[:2]
    complete_max = -(-n // ps)  # an append of n tokens completes at most ceil(n / ps) pages
    off = start % ps  # [B] fill of the partial page before the call
    fill = off + n  # rows of the buffer holding data

    prefix = "k" if kind == "key" else "v"
    stage = getattr(cache, f"{prefix}_stage")[loop]  # [S, ps, H, D]
    sink = getattr(cache, f"{prefix}_sink")[loop]  # [S, sink, H, D]
    old_stage = stage.at[seq_ids].get(mode="fill", fill_value=0)

    def build(old, rows, o):
        buf = jnp.zeros(((complete_max + 1) * ps, h, d), new.dtype).at[:ps].set(old)
        return lax.dynamic_update_slice(buf, rows, (o, 0, 0))

    buf = jax.vmap(build)(old_stage, new, off).reshape(b, complete_max + 1, ps, h, d)

    # Pages completed by this call: buffer page j, logical page start // ps + j.
    j = jnp.arange(complete_max)
    complete = (j[None] + 1) * ps <= fill[:, None]  # [B, C]
    logical = (start // ps)[:, None] + j[None]
    phys = tables.at[seq_ids[:, None], logical].get(mode="fill", fill_value=-1)
    valid = complete & (phys >= 0) & (phys < num_pages)
    target = jnp.where(valid, phys, num_pages).reshape(-1)  # num_pages: dropped by the scatter
    pages = buf[:, :complete_max].reshape(b * complete_max, ps, h, d)

    if loop == 0:
        args = config.pack_args(kind, "base")
        packed = page_pack.dispatch(pages, **args, backend=backend)
        store = getattr(cache, f"{prefix}_base")
        store = jax.tree.map(lambda a, u: a.at[target].set(u, mode="drop"), store, packed)
    else:
        args = config.pack_args(kind, "residual")
        previous = page_reconstruct.dispatch(
            cache, kind, jnp.clip(target, 0, num_pages - 1), loop=loop - 1, backend=backend
        )
        # A dense residual without window has payload pack_kv(subtract_in_dtype(cur, prev))
        # (`encode_residual`): the deltas of the completed pages are packed as pages.
        delta = subtract_in_dtype(pages, previous)
        packed = page_pack.dispatch(delta, **args, backend=backend)
        store = getattr(cache, f"{prefix}_delta")
        store = jax.tree.map(lambda a, u: a.at[loop - 1, target].set(u, mode="drop"), store, packed)

    # New partial page: buffer page fill // ps, rows past fill % ps zeroed.
    last = jax.vmap(lambda bb, q: lax.dynamic_index_in_dim(bb, q, keepdims=False))(buf, fill // ps)
    rows = jnp.arange(ps)[None, :, None, None] < (fill % ps)[:, None, None, None]
    new_stage = jnp.where(rows, last, jnp.zeros((), new.dtype))
    stage = stage.at[seq_ids].set(new_stage, mode="drop")

    # Sink rows: position i < sink takes new token i - start when it is in this call.
    if config.sink:
        idx = jnp.arange(config.sink)[None] - start[:, None]  # [B, sink]
        in_call = (idx >= 0) & (idx < n)
        taken = jnp.take_along_axis(new, jnp.clip(idx, 0, n - 1)[:, :, None, None], axis=1)
        old_sink = sink.at[seq_ids].get(mode="fill", fill_value=0)
        sink = sink.at[seq_ids].set(
            jnp.where(in_call[:, :, None, None], taken, old_sink), mode="drop"
        )
    return store, stage, sink


@functools.partial(jax.jit, static_argnames=("loop", "backend"))
def append(
    cache: PagedKVCache, k, v, *, block_tables, seq_ids, loop: int, backend: str = "auto"
) -> PagedKVCache:
    """Append `n` tokens to each of `B` sequences in loop `loop`; returns the new cache.

    Args:
      cache: a `PagedKVCache`.
      k, v: [B, n, H, D] in the cache dtype (n = 1 in decode, the prompt in prefill).
      block_tables: int32 [max_seqs, max_pages_per_seq]; logical page i of sequence s is
        physical page block_tables[s, i] (shared by every loop).
      seq_ids: int32 [B], distinct sequence slots in [0, max_seqs).
      loop: static loop index in [0, num_loops).
      backend: static ("auto", "xla", "pallas", "pallas_interpret"); how completed pages are
        packed (`pack_paged`) and loop l - 1 pages reconstructed (`decode_pages`) for the
        deltas. Same bytes either way.

    Tokens land at positions seq_lens[loop, s] .. + n. Every page the call fills is quantized
    once into its physical page (loop 0: `pack_kv`; loop l > 0: the delta against the
    reconstructed loop l - 1 page, which must be complete); the rest stays in staging, and
    positions < sink are also copied to the sink rows. Shape/dtype errors are raised while
    tracing; data errors (full sequence, bad page or slot ids: their writes are dropped, loop
    l - 1 not ready) are caught by `check_append` on the host, never here.
    """
    config = check_cache(cache)
    checks.check_append_args(config, k, v, block_tables, seq_ids, loop)
    k, v = jnp.asarray(k), jnp.asarray(v)
    seq_ids, tables = jnp.asarray(seq_ids), jnp.asarray(block_tables)
    start = cache.seq_lens[loop].at[seq_ids].get(mode="fill", fill_value=0)
    k_store, k_stage, k_sink = _append_one(cache, "key", k, start, tables, seq_ids, loop, backend)
    v_store, v_stage, v_sink = _append_one(cache, "value", v, start, tables, seq_ids, loop, backend)
    lens = cache.seq_lens.at[loop, seq_ids].set(start + k.shape[1], mode="drop")
    store = (
        dict(k_base=k_store, v_base=v_store)
        if loop == 0
        else dict(k_delta=k_store, v_delta=v_store)
    )
    return dataclasses.replace(
        cache,
        **store,
        k_stage=cache.k_stage.at[loop].set(k_stage),
        v_stage=cache.v_stage.at[loop].set(v_stage),
        k_sink=cache.k_sink.at[loop].set(k_sink),
        v_sink=cache.v_sink.at[loop].set(v_sink),
        seq_lens=lens,
    )


# -- reconstruction ---------------------------------------------------------------------------


def _decoder(cache, *, loop: int, backend: str):
    """The page decoder `cache_state.read_batch` calls: `decode_pages` with `backend`."""

    def decode(kind, pages):
        return page_reconstruct.dispatch(cache, kind, pages, loop=loop, backend=backend)

    return decode


@functools.partial(jax.jit, static_argnames=("loop", "backend"))
def gather_batch(cache: PagedKVCache, block_tables, seq_lens, *, loop: int, seq_ids=None,
                 backend: str = "auto"):  # fmt: skip
    """Reconstructed K, V of a batch of sequences in loop `loop` (the inputs attention reads):
    [B, max_pages_per_seq * page_size, H, D] each in the cache dtype, rows >= seq_lens[b]
    zero.

    block_tables: int32 [max_seqs, max_pages_per_seq]; seq_lens: int32 [B], each <= the stored
    length seq_lens[loop, seq] (not checked: no host sync); seq_ids: int32 [B] slots (default
    0..B-1). Complete pages decode through the residual chain up to `loop` (`decode_pages`
    with `backend`), the partial page comes from staging, and the sink rows override the
    first `sink` rows.
    """
    config = check_cache(cache)
    checks.check_loop_index(loop, config.num_loops)
    checks.check_block_tables(config, block_tables)
    b = checks.check_batch(config, seq_lens, seq_ids)
    seq_ids = jnp.arange(b, dtype=jnp.int32) if seq_ids is None else jnp.asarray(seq_ids)
    rows = cache_state.table_rows(block_tables, seq_ids)
    decode = _decoder(cache, loop=loop, backend=backend)
    return cache_state.read_batch(cache, rows, seq_lens, seq_ids, loop=loop, decode=decode)


@functools.partial(jax.jit, static_argnames=("seq_len", "loop", "backend"))
def gather(
    cache: PagedKVCache, *, seq_id, seq_len: int, block_table, loop: int, backend: str = "auto"
):
    """Reconstructed (K, V), each [seq_len, H, D] in the cache dtype, of sequence `seq_id` in
    loop `loop`. `seq_len` (static) must not exceed the stored length seq_lens[loop, seq_id];
    `block_table` is that sequence's int32 row (>= ceil(seq_len / page_size) entries). Full
    pages decode through the residual chain up to `loop`, the partial page comes from
    staging, and sink rows override the first `sink` rows. `backend` (static) picks the page
    reconstruction, as in `decode_pages`."""
    config = check_cache(cache)
    loop = checks.check_loop_index(loop, config.num_loops)
    max_pages = checks.check_gather_args(config, seq_len, block_table)
    if max_pages == 0:
        empty = jnp.zeros((0, config.num_heads, config.head_dim), config.dtype)
        return empty, empty
    rows = jnp.asarray(block_table)[None, :max_pages]
    seq_ids = jnp.asarray(seq_id, jnp.int32).reshape(1)
    lens = jnp.full((1,), seq_len, jnp.int32)
    decode = _decoder(cache, loop=loop, backend=backend)
    k, v = cache_state.read_batch(cache, rows, lens, seq_ids, loop=loop, decode=decode)
    return k[0, :seq_len], v[0, :seq_len]
