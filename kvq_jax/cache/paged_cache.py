"""The append-time quantized paged KV cache for looped LMs: the operations (jittable, in place).

The state is a `PagedKVCache` (`kvq_jax.codecs.cache_state`, which documents its fields) built by
`init_cache(PagedCacheConfig(...))`; `kvq_jax.core.allocator.PageAllocator` owns its pages
and sequence slots. `append` writes tokens, `gather` / `gather_batch` read a sequence's
reconstructed K and V, `decode_pages` reconstructs physical pages, `fork` starts a sequence on
another's prefix, `clear_slot` empties a finished sequence's slot for the next one,
`swap_out` / `swap_in` move a sequence to host memory and back (and
`kvq_jax.core.offload` to disk), `check_append` runs an append's data checks on the host.

In place: every function that returns an updated cache consumes the cache it is given (its
buffers are donated to the jitted update, which writes only what changes: a decode step costs
O(the tokens appended), not O(the pool)). Do not use a cache after passing it; with
`donate=False` the input stays valid (for tests that compare caches).

A page is quantized once, when it fills, and never again. For loop l > 0 its delta is taken
against loop l - 1 of the same physical page, so loop l - 1 must already be complete there:
append loop l - 1's tokens first (the natural order of a looped LM, prefill and decode alike;
`check_append` verifies seq_lens[l - 1] >= seq_lens[l] + n). The residual chain runs over the
quantized pages only; the raw sink rows replace the first `sink` rows at read time and take no
part in the chain.

Adaptive exits (`PagedCacheConfig(adaptive_exit=True)`): a token that exits after loop e has
no K/V of its own for loops > e. Append, for each later loop, its loop-e K/V with `exited`
set: raw rows (staging, sink) hold them as given, and a quantized page records per row the
last loop with its own K/V (`depth`, 1 byte per token) and stores a zero delta for the
exited rows, so reconstruction at loop d returns loop min(d, e) of every row, bit for bit,
without re-quantizing anything.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvq_jax.codecs import cache_state
from kvq_jax.codecs._numerics import subtract_in_dtype
from kvq_jax.codecs.cache_state import PagedKVCache, at_layer, check_cache, init_cache
from kvq_jax.codecs.registry import get_codec
from kvq_jax.core import checks
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.containers import rest_dtype
from kvq_jax.core.offload import HostSequence, expected_shapes
from kvq_jax.kernels.page_pack import api as page_pack
from kvq_jax.kernels.page_reconstruct import api as page_reconstruct
from kvq_jax.kernels.page_reconstruct.api import decode_pages

__all__ = [
    "PagedCacheConfig",
    "PagedKVCache",
    "append",
    "at_layer",
    "check_append",
    "check_fork",
    "clear_slot",
    "decode_pages",
    "fork",
    "gather",
    "gather_batch",
    "init_cache",
    "swap_in",
    "swap_out",
]


def check_append(
    cache: PagedKVCache, k, v, *, block_tables, seq_ids, loop: int, exited=None
) -> None:
    """Host-side data checks of an `append` call (reads seq_lens, block_tables, seq_ids: a
    device->host transfer; `append` itself never syncs): `kvq_jax.core.checks.host_check_append`
    after the shape checks of `append`."""
    config = check_cache(cache)
    _, n = checks.check_append_args(config, k, v, block_tables, seq_ids, loop, exited)
    checks.host_check_append(
        config, np.asarray(cache.seq_lens), n, np.asarray(block_tables), np.asarray(seq_ids), loop
    )


def _set(a, index, values, **kwargs):
    """`a.at[index].set(values, **kwargs)`; 1-byte float values go into a uint8 array (a
    stored plane, `rest_dtype`) as their bits. Same bytes.

    XLA:CPU widens a scatter into a float8 array to float32 and back, a pass over the whole
    array (measured, 8 pages into 8192: 227 ms vs 0.02 ms for uint8), which is why planes
    store those fields as uint8 (a bitcast around the scatter is materialized too)."""
    values = jnp.asarray(values)
    if a.dtype != values.dtype and a.dtype == jnp.uint8 and values.dtype.itemsize == 1:
        values = lax.bitcast_convert_type(values, jnp.uint8)
    return a.at[index].set(values, **kwargs)


# -- append -----------------------------------------------------------------------------------


def _buffer(old, new, off, num_pages_out):
    """Per sequence: its old partial page [ps, ...] followed by the new rows [n, ...] written at
    row `off`, as `num_pages_out` + 1 pages: [B, C + 1, ps, ...]."""
    b, ps = old.shape[0], old.shape[1]
    rest = old.shape[2:]

    def one(o, rows, at):
        buf = jnp.zeros(((num_pages_out + 1) * ps, *rest), new.dtype).at[:ps].set(o)
        return lax.dynamic_update_slice(buf, rows, (at,) + (0,) * len(rest))

    return jax.vmap(one)(old, new, off).reshape(b, num_pages_out + 1, ps, *rest)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Where one append's rows go: per sequence b, buffer page j of C = ceil(n / ps) that
    completes lands on physical page target[b * C + j] (num_pages: dropped)."""

    off: jax.Array  # [B] rows already in the partial page
    fill: jax.Array  # [B] rows in the buffer
    target: jax.Array  # [B * C]
    logical: jax.Array  # [B * C] the logical page (of its sequence) of each buffer page
    num_complete: int  # C


def _plan(config, start, n, tables, seq_ids) -> _Plan:
    ps, num_pages = config.page_size, config.num_pages
    c = -(-n // ps)  # an append of n tokens completes at most ceil(n / ps) pages
    off = start % ps
    fill = off + n
    j = jnp.arange(c)
    complete = (j[None] + 1) * ps <= fill[:, None]  # [B, C]
    logical = (start // ps)[:, None] + j[None]
    phys = tables.at[seq_ids[:, None], logical].get(mode="fill", fill_value=-1)
    valid = complete & (phys >= 0) & (phys < num_pages)
    return _Plan(off, fill, jnp.where(valid, phys, num_pages).reshape(-1), logical.reshape(-1), c)


def _last_page(buf, fill):
    """The buffer page holding row `fill`, rows past fill % ps zeroed: the new partial page."""
    ps = buf.shape[2]
    last = jax.vmap(lambda bb, q: lax.dynamic_index_in_dim(bb, q, keepdims=False))(buf, fill // ps)
    keep = jnp.arange(ps) < (fill % ps)[:, None]
    keep = keep.reshape(keep.shape + (1,) * (last.ndim - 2))
    return jnp.where(keep, last, jnp.zeros((), last.dtype))


def _when_any_page(complete, pack):
    """pack() where some page of the call completes (`complete` bool [B * C]); on XLA:CPU a
    conditional skips the pack of a decode step that completes no page (63 of 64 steps at
    64-token pages: their writes are dropped anyway), elsewhere it always runs (a conditional
    costs a GPU a host round trip for its predicate)."""

    pack = jax.jit(pack)  # traced once, for the shapes and both platforms' branches

    def cpu(complete):
        skip = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(pack))
        return lax.cond(jnp.any(complete), pack, lambda: skip)

    return lax.platform_dependent(complete, cpu=cpu, default=lambda complete: pack())


def _heavy_rows(cache, pages, loop):
    """The heavy rows uint8 [B * C, ps / G, H] of completed key pages [B * C, ps, H, D] when
    the keys' format at `loop` chooses heavy rows (`HeavyLayout.selects_rows`: the values of
    the same tokens take them), else None."""
    codec = get_codec(cache.config.loop_pack_args("key", loop)["format"])
    if not getattr(codec, "selects_rows", False):
        return None
    return jax.vmap(lambda page: codec.select_rows(page, cache.layer))(pages)


def _store_pages(cache, kind, pages, exited_rows, plan, loop, backend, rows=None) -> dict:
    """Quantize the completed buffer pages [B * C, ps, H, D] into the plane of K or V's loop
    `loop`; returns the updated plane field ({field: value}). rows: the pages' heavy rows
    (`_heavy_rows`), for heavy-row formats."""
    config = cache.config
    plane, level = cache.loop_plane(kind, loop)
    target = plan.target
    args = config.loop_pack_args(kind, loop)
    absolute = loop in config.absolute_loops(kind)

    def pack():
        stored = pages
        if kind == "key":  # a pre-RoPE cache packs the keys with RoPE taken off
            positions = plan.logical[:, None] * config.page_size + jnp.arange(config.page_size)
            rope = cache_state.key_rope(config, positions)
            stored = cache_state.rope_keys(config, pages, rope, invert=True)
        if loop == 0 or (absolute and exited_rows is None):
            # Loop 0, or a loop stored absolute: the page itself (`encode_residual(absolute=True)`).
            payload = stored
        else:
            previous = page_reconstruct.dispatch(
                cache, kind, jnp.clip(target, 0, config.num_pages - 1), loop=loop - 1,
                backend=backend,
            )  # fmt: skip
            # The payload of `encode_residual(page, previous)` (dense, no window) for every
            # page; a row that exited keeps its previous loop (`depth`): its delta is stored as
            # zero, and in an absolute loop the row packed is its previous loop (read back
            # through `depth`).
            payload = stored if absolute else subtract_in_dtype(stored, previous)
            if exited_rows is not None:
                kept = previous if absolute else jnp.zeros((), payload.dtype)
                payload = jnp.where(exited_rows[:, :, None, None], kept, payload)
        return page_pack.dispatch(payload, **args, backend=backend, layer=cache.layer, rows=rows)

    packed = _when_any_page(target < config.num_pages, pack)
    index = target if level is None else (level, target)
    new = jax.tree.map(lambda a, u: _set(a, index, u, mode="drop"), plane, packed)
    return cache.with_loop_plane(kind, loop, new)


def _append(cache, k, v, block_tables, seq_ids, exited, *, loop: int, backend: str):
    config = check_cache(cache)
    checks.check_append_args(config, k, v, block_tables, seq_ids, loop, exited)
    k, v = jnp.asarray(k), jnp.asarray(v)
    seq_ids, tables = jnp.asarray(seq_ids), jnp.asarray(block_tables)
    b, n = k.shape[:2]
    ps = config.page_size
    start = cache.seq_lens[loop].at[seq_ids].get(mode="fill", fill_value=0)
    plan = _plan(config, start, n, tables, seq_ids)
    c = plan.num_complete
    updates = {}

    exited_rows = None
    if config.adaptive_exit:
        new = jnp.zeros((b, n), bool) if exited is None else jnp.asarray(exited, bool)
        old = cache.stage_exited[loop].at[seq_ids].get(mode="fill", fill_value=False)
        buf = _buffer(old, new, plan.off, c)  # [B, C + 1, ps]
        rows = buf[:, :c].reshape(b * c, ps)
        exited_rows = rows if loop else None
        # depth of a completed page's rows: L - 1 at loop 0 (a fresh page), else capped at
        # loop - 1 where the row exited.
        depth = cache.depth.at[plan.target].get(mode="fill", fill_value=0)
        top = jnp.uint8(config.num_loops - 1)
        fresh = jnp.full_like(depth, top) if loop == 0 else depth
        capped = jnp.where(rows, jnp.minimum(fresh, jnp.uint8(max(loop - 1, 0))), fresh)
        updates["depth"] = _set(cache.depth, plan.target, capped, mode="drop")
        updates["stage_exited"] = _set(
            cache.stage_exited, (loop, seq_ids), _last_page(buf, plan.fill), mode="drop"
        )

    rows = None  # heavy rows: chosen from the key pages, used by the value pages too
    for kind, prefix, new in (("key", "k", k), ("value", "v", v)):
        stage = getattr(cache, f"{prefix}_stage")
        old = stage[loop].at[seq_ids].get(mode="fill", fill_value=0)
        buf = _buffer(old, new, plan.off, c)  # [B, C + 1, ps, H, D]
        pages = buf[:, :c].reshape(b * c, *config.page_shape)
        if kind == "key":
            rows = _heavy_rows(cache, pages, loop)
        updates.update(_store_pages(cache, kind, pages, exited_rows, plan, loop, backend, rows))
        updates[f"{prefix}_stage"] = _set(
            stage, (loop, seq_ids), _last_page(buf, plan.fill), mode="drop"
        )
        if config.sink:  # position i < sink takes new token i - start when it is in the call
            sink = getattr(cache, f"{prefix}_sink")
            idx = jnp.arange(config.sink)[None] - start[:, None]  # [B, sink]
            in_call = ((idx >= 0) & (idx < n))[:, :, None, None]
            taken = jnp.take_along_axis(new, jnp.clip(idx, 0, n - 1)[:, :, None, None], axis=1)
            old_sink = sink[loop].at[seq_ids].get(mode="fill", fill_value=0)
            updates[f"{prefix}_sink"] = _set(
                sink, (loop, seq_ids), jnp.where(in_call, taken, old_sink), mode="drop"
            )
    updates["seq_lens"] = _set(cache.seq_lens, (loop, seq_ids), start + n, mode="drop")
    return dataclasses.replace(cache, **updates)


_APPEND = {
    donate: jax.jit(
        _append,
        static_argnames=("loop", "backend"),
        donate_argnames=("cache",) if donate else (),
    )
    for donate in (True, False)
}


def append(
    cache: PagedKVCache,
    k,
    v,
    *,
    block_tables,
    seq_ids,
    loop: int,
    exited=None,
    backend: str = "auto",
    donate: bool = True,
) -> PagedKVCache:
    """Append `n` tokens to each of `B` sequences in loop `loop`; returns the updated cache
    (in place: `cache` is consumed unless donate=False).

    Args:
      cache: a `PagedKVCache`.
      k, v: [B, n, H, D] in the cache dtype (n = 1 in decode, the prompt in prefill).
      block_tables: int32 [max_seqs, max_pages_per_seq]; logical page i of sequence s is
        physical page block_tables[s, i] (shared by every loop; `PageAllocator`).
      seq_ids: int32 [B], distinct sequence slots in [0, max_seqs).
      loop: static loop index in [0, num_loops).
      exited: None, or bool [B, n] (adaptive-exit caches, loop > 0): tokens that exited
        before this loop, whose k, v are their exit loop's (see the module doc).
      backend: static ("auto", "xla", "pallas", "pallas_interpret"); how completed pages are
        packed (`pack_paged`) and loop l - 1 pages reconstructed (`decode_pages`) for the
        deltas. Same bytes either way.
      donate: reuse the cache's buffers (default). Inside an outer `jax.jit` the outer
        function's donation decides.

    Tokens land at positions seq_lens[loop, s] .. + n. Every page the call fills is quantized
    once into its physical page (loop 0: `pack_kv`; loop l > 0: the delta against the
    reconstructed loop l - 1 page, which must be complete); the rest stays in staging, and
    positions < sink are also copied to the sink rows. Shape/dtype errors are raised while
    tracing; data errors (full sequence, bad page or slot ids: their writes are dropped, loop
    l - 1 not ready) are caught by `check_append` on the host, never here.
    """
    check_cache(cache)  # before jit flattens it: a clear error for a non-cache
    return _APPEND[bool(donate)](
        cache, k, v, block_tables, seq_ids, exited, loop=loop, backend=backend
    )


# -- reading ----------------------------------------------------------------------------------


def _decoder(cache, *, loop: int, backend: str):
    """The page decoder `cache_state.read_batch` calls: `decode_pages` with `backend`."""

    def decode(kind, pages):
        return page_reconstruct.dispatch(cache, kind, pages, loop=loop, backend=backend)

    return decode


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
    check_cache(cache)  # before jit flattens it: a clear error for a non-cache
    return _gather_batch(cache, block_tables, seq_lens, loop=loop, seq_ids=seq_ids,
                         backend=backend)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("loop", "backend"))
def _gather_batch(cache, block_tables, seq_lens, *, loop, seq_ids, backend):
    config = check_cache(cache)
    checks.check_loop_index(loop, config.num_loops)
    checks.check_block_tables(config, block_tables)
    b = checks.check_batch(config, seq_lens, seq_ids)
    seq_ids = jnp.arange(b, dtype=jnp.int32) if seq_ids is None else jnp.asarray(seq_ids)
    rows = cache_state.table_rows(block_tables, seq_ids)
    decode = _decoder(cache, loop=loop, backend=backend)
    return cache_state.read_batch(cache, rows, seq_lens, seq_ids, loop=loop, decode=decode)


def gather(
    cache: PagedKVCache, *, seq_id, seq_len: int, block_table, loop: int, backend: str = "auto"
):
    """Reconstructed (K, V), each [seq_len, H, D] in the cache dtype, of sequence `seq_id` in
    loop `loop`. `seq_len` (static) must not exceed the stored length seq_lens[loop, seq_id];
    `block_table` is that sequence's int32 row (>= ceil(seq_len / page_size) entries). Full
    pages decode through the residual chain up to `loop`, the partial page comes from
    staging, and sink rows override the first `sink` rows. `backend` (static) picks the page
    reconstruction, as in `decode_pages`."""
    check_cache(cache)  # before jit flattens it: a clear error for a non-cache
    return _gather(cache, seq_id=seq_id, seq_len=seq_len, block_table=block_table, loop=loop,
                   backend=backend)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("seq_len", "loop", "backend"))
def _gather(cache, *, seq_id, seq_len, block_table, loop, backend):
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


# -- sequences: fork, swap ---------------------------------------------------------------------


def _fork(cache, parent, child, num_tokens):
    ps = cache.config.page_size
    updates = {}
    for name, a in cache.slot_arrays():
        if name == "seq_lens":
            continue
        rows = a[:, parent]  # [L, rows, ...]
        limit = num_tokens if name.endswith("sink") else num_tokens % ps
        keep = (jnp.arange(rows.shape[1]) < limit).reshape(1, -1, *([1] * (rows.ndim - 2)))
        updates[name] = _set(a, (slice(None), child), jnp.where(keep, rows, jnp.zeros((), a.dtype)))
    updates["seq_lens"] = _set(cache.seq_lens, (slice(None), child), num_tokens)
    return dataclasses.replace(cache, **updates)


_FORK = jax.jit(_fork, donate_argnames=("cache",))


def check_fork(cache: PagedKVCache, *, parent: int, child: int, num_tokens: int) -> None:
    """Host-side checks of a `fork` (`kvq_jax.core.checks.host_check_fork`, on seq_lens)."""
    config = check_cache(cache)
    checks.host_check_fork(config, np.asarray(cache.seq_lens), parent, child, num_tokens)


def fork(cache: PagedKVCache, *, parent, child, num_tokens) -> PagedKVCache:
    """Start sequence `child` on the first `num_tokens` tokens of sequence `parent` (every
    loop): the child's staging rows (the partial page, copy-on-write), sink rows and lengths
    are the parent's; its block table shares the parent's complete pages
    (`PageAllocator.fork`). In place (`cache` is consumed); `check_fork` checks the data."""
    check_cache(cache)
    return _FORK(cache, jnp.int32(parent), jnp.int32(child), jnp.int32(num_tokens))


def _clear_slot(cache, slot):
    updates = {
        name: _set(a, (slice(None), slot), jnp.zeros((), a.dtype))
        for name, a in cache.slot_arrays()
    }
    return dataclasses.replace(cache, **updates)


_CLEAR_SLOT = jax.jit(_clear_slot, donate_argnames=("cache",))


def clear_slot(cache: PagedKVCache, *, slot) -> PagedKVCache:
    """Empty sequence slot `slot` (an int, or a sequence of ints: several at once; their
    lengths, staging, sink and exit rows: zero) so that a new sequence can start there; its
    pages are the allocator's to free. In place."""
    config = check_cache(cache)
    if isinstance(slot, (list, tuple)):
        if not slot:
            return cache
        ids = [checks.check_slot(config, s) for s in slot]
        return _CLEAR_SLOT(cache, jnp.asarray(ids, jnp.int32))
    checks.check_slot(config, slot)
    return _CLEAR_SLOT(cache, jnp.int32(slot))


@jax.jit
def _take_sequence(cache, slot, pages):
    arrays = {name: jnp.take(a, pages, axis=axis) for name, axis, a in cache.page_arrays()}
    arrays.update((name, a[:, slot]) for name, a in cache.slot_arrays())
    return arrays


def swap_out(cache: PagedKVCache, *, slot, pages) -> HostSequence:
    """Copy sequence `slot` (its physical `pages` in logical order, every loop plane, its
    staging and sink rows and lengths) to host memory. The cache is not changed; free the
    slot and pages with the allocator afterwards."""
    config = check_cache(cache)
    pages = checks.check_page_ids(config, pages)
    checks.check_slot(config, slot)
    want = expected_shapes(config, len(pages))  # stored uint8 bits -> the format's dtypes
    if _on_cpu(cache):
        # The host already holds the buffers (np.asarray is a view): gather in NumPy, straight
        # into one allocation (many separate ones page-fault their way to half the speed).
        arrays = _host_arrays(want)
        for name, axis, a in cache.page_arrays():
            src = np.asarray(a)
            np.take(src, pages, axis, out=arrays[name].view(src.dtype), mode="clip")
        for name, a in cache.slot_arrays():
            src = np.asarray(a)
            np.copyto(arrays[name].view(src.dtype), src[:, slot])
    else:  # gather on the device, then move only the sequence's bytes
        arrays = jax.device_get(_take_sequence(cache, jnp.int32(slot), jnp.asarray(pages)))
        arrays = {k: np.asarray(a).view(want[k][1]) for k, a in arrays.items()}
    return HostSequence(config=config, arrays=arrays)


def _host_arrays(want, align: int = 64) -> dict[str, np.ndarray]:
    """Empty arrays of `want` ({name: (shape, dtype)}): aligned views of one host buffer."""
    offsets, total = {}, 0
    for name, (shape, dtype) in want.items():
        total = -(-total // align) * align
        offsets[name] = total
        total += math.prod(shape) * np.dtype(dtype).itemsize
    buf = np.empty(total + align, np.uint8)
    start = -buf.ctypes.data % align
    out = {}
    for name, (shape, dtype) in want.items():
        size = math.prod(shape) * np.dtype(dtype).itemsize
        out[name] = buf[start + offsets[name] : start + offsets[name] + size].view(dtype)
        out[name] = out[name].reshape(shape)
    return out


def _on_cpu(cache) -> bool:
    return all(d.platform == "cpu" for a in jax.tree.leaves(cache) for d in a.devices())


def _put_pages(a, axis: int, pages, values):
    """a[pages] = values along page axis 0 ([P, ...]) or 1 ([L - 1, P, ...] delta planes, one
    plane at a time: a scatter at (:, pages) transposes the values and runs ~5x slower on
    XLA:CPU). `pages`: validated, distinct, in range."""
    put = functools.partial(_set, mode="promise_in_bounds", unique_indices=True)
    if axis == 0:
        return put(a, pages, values)
    for r in range(a.shape[0]):
        a = put(a, (r, pages), values[r])
    return a


def _put_sequence(cache, arrays, slot, pages):
    new = {name: _put_pages(a, axis, pages, arrays[name]) for name, axis, a in cache.page_arrays()}
    new.update(
        (name, _set(a, (slice(None), slot), arrays[name])) for name, a in cache.slot_arrays()
    )
    return cache.with_arrays(new)


_PUT_SEQUENCE = jax.jit(_put_sequence, donate_argnames=("cache",))


def swap_in(cache: PagedKVCache, sequence: HostSequence, *, slot, pages) -> PagedKVCache:
    """Write a swapped-out sequence into slot `slot` and physical `pages` (any free pages, in
    logical order; as many as it holds), byte for byte. Refuses (ValueError, nothing written)
    a sequence of another configuration or page count. In place (`cache` is consumed)."""
    config = check_cache(cache)
    pages = checks.check_swap_in(config, sequence, slot, pages)
    arrays = {k: a.view(rest_dtype(a.dtype)) for k, a in sequence.arrays.items()}
    return _PUT_SEQUENCE(cache, arrays, jnp.int32(slot), jnp.asarray(pages))
