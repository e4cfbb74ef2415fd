"""An append-time quantized paged KV cache for looped LMs (functional, jit-compatible).

Layout (P physical pages of `page_size` tokens, L loops, S sequence slots, H heads, D dims):

    k_base, v_base:    PackedKV, batch shape (P,): loop 0 of every physical page, packed with
                       `pack_kv` exactly as `pack_paged` packs it.
    k_delta, v_delta:  PackedKV, batch shape (L - 1, P) (None for L == 1): plane l - 1 holds
                       loop l of every physical page as a residual delta against the
                       *reconstructed* loop l - 1 of the same physical page (the payload of
                       `encode_residual(page_l, recon_{l-1})`).
    k_stage, v_stage:  [L, S, page_size, H, D] raw rows of each sequence's current partial page
                       (rows past the fill are zero).
    k_sink, v_sink:    [L, S, sink, H, D] raw copies of each sequence's first `sink` tokens.
    seq_lens:          int32 [L, S] tokens written per loop and sequence.

Base and deltas are two containers (not one (L, P) stack) because loop 0 and the deltas may use
different formats, whose packed arrays differ. All loops share one block table: a sequence's
logical page i is physical page `block_tables[seq, i]` in every loop plane.

A page is quantized once, when it fills, and never again. For loop l > 0 its delta is taken
against loop l - 1 of the same physical page, so loop l - 1 must already be complete there:
append loop l - 1's tokens first (the natural order of a looped LM, prefill and decode alike;
`check_append` verifies seq_lens[l - 1] >= seq_lens[l] + n). The residual chain runs over the
quantized pages only; the raw sink rows replace the first `sink` rows at read time (`gather`)
and take no part in the chain.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvq_jax._numerics import subtract_in_dtype
from kvq_jax.api import pack_kv, unpack_kv
from kvq_jax.layouts import check_float_dtype
from kvq_jax.packed import PackedKV
from kvq_jax.paged import pack_paged, resolve_paged
from kvq_jax.registry import get_codec
from kvq_jax.residual import KVResidual, decode_residual

_INT_FIELDS = ("num_pages", "page_size", "num_heads", "head_dim", "num_loops", "max_seqs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedCacheConfig:
    """Static (hashable) configuration of a `PagedKVCache`.

    Group sizes of None take the `resolve_paged` defaults; the residual formats use the same
    group size as the base when they share its format, else their own default (as
    `encode_loops`). Token-axis groups must divide page_size.
    """

    num_pages: int
    page_size: int
    num_heads: int
    head_dim: int
    dtype: Any = np.float32
    num_loops: int = 1
    k_base_format: str = "int4"
    k_residual_format: str = "int4"
    v_base_format: str = "int4"
    v_residual_format: str = "int4"
    k_group_size: int | None = None
    v_group_size: int | None = None
    sink: int = 0
    max_seqs: int = 1

    def __post_init__(self):
        for name in (*_INT_FIELDS, "sink"):
            value = getattr(self, name)
            low = 0 if name == "sink" else 1
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"PagedCacheConfig.{name} must be an int >= {low}, got {value!r}")
        object.__setattr__(self, "dtype", check_float_dtype(self.dtype, "PagedCacheConfig.dtype"))
        for name in ("k_base_format", "k_residual_format", "v_base_format", "v_residual_format"):
            get_codec(getattr(self, name))
        for kind in ("key", "value"):
            for level in ("base", "residual"):
                self.spec(kind, level)  # raises for a group size that does not fit the page

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (self.page_size, self.num_heads, self.head_dim)

    def spec(self, kind: str, level: str) -> dict:
        """pack_kv keyword arguments (kind, format, axis, group_size) of K/V base/residual."""
        prefix = {"key": "k", "value": "v"}[kind]
        base_format = getattr(self, f"{prefix}_base_format")
        group_size = getattr(self, f"{prefix}_group_size")
        format = base_format
        if level == "residual":
            format = getattr(self, f"{prefix}_residual_format")
            group_size = group_size if format == base_format else None
        axis, group_size = resolve_paged(format, kind, self.page_shape, None, group_size)
        return dict(kind=kind, format=format, axis=axis, group_size=group_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedKVCache:
    """The cache state (see the module doc for the fields); `config` is static."""

    k_base: PackedKV
    v_base: PackedKV
    k_delta: PackedKV | None
    v_delta: PackedKV | None
    k_stage: Any
    v_stage: Any
    k_sink: Any
    v_sink: Any
    seq_lens: Any
    config: PagedCacheConfig

    @property
    def storage_bytes(self) -> int:
        """Bytes of every array held (packed pages, staging, sink rows, lengths)."""
        leaves = jax.tree.leaves(self)
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in leaves)


jax.tree_util.register_dataclass(
    PagedKVCache,
    data_fields=[
        "k_base",
        "v_base",
        "k_delta",
        "v_delta",
        "k_stage",
        "v_stage",
        "k_sink",
        "v_sink",
        "seq_lens",
    ],
    meta_fields=["config"],
)


def _empty_packed(config: PagedCacheConfig, spec: dict, batch: tuple[int, ...]) -> PackedKV:
    page = jax.ShapeDtypeStruct(config.page_shape, config.dtype)
    shapes = jax.eval_shape(functools.partial(pack_kv, **spec), page)
    return jax.tree.map(lambda s: jnp.zeros((*batch, *s.shape), s.dtype), shapes)


def init_cache(config: PagedCacheConfig) -> PagedKVCache:
    """An empty cache: zero pages, zero staging and sink rows, seq_lens 0."""
    if not isinstance(config, PagedCacheConfig):
        raise TypeError(f"config must be a PagedCacheConfig, got {type(config).__name__}")
    c = config
    delta_batch = (c.num_loops - 1, c.num_pages)
    stage = jnp.zeros((c.num_loops, c.max_seqs, *c.page_shape), c.dtype)
    sink = jnp.zeros((c.num_loops, c.max_seqs, c.sink, c.num_heads, c.head_dim), c.dtype)
    has_delta = c.num_loops > 1
    return PagedKVCache(
        k_base=_empty_packed(c, c.spec("key", "base"), (c.num_pages,)),
        v_base=_empty_packed(c, c.spec("value", "base"), (c.num_pages,)),
        k_delta=_empty_packed(c, c.spec("key", "residual"), delta_batch) if has_delta else None,
        v_delta=_empty_packed(c, c.spec("value", "residual"), delta_batch) if has_delta else None,
        k_stage=stage,
        v_stage=stage,
        k_sink=sink,
        v_sink=sink,
        seq_lens=jnp.zeros((c.num_loops, c.max_seqs), jnp.int32),
        config=c,
    )


# -- argument checks --------------------------------------------------------------------------


def _check_cache(cache) -> PagedCacheConfig:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    return cache.config


def _check_loop(config: PagedCacheConfig, loop) -> int:
    if isinstance(loop, bool) or not isinstance(loop, int | np.integer):
        raise TypeError(f"loop must be a static int, got {type(loop).__name__}")
    if not 0 <= loop < config.num_loops:
        raise ValueError(f"loop must be in [0, {config.num_loops}), got {loop}")
    return int(loop)


def _check_int32(x, name: str, ndim: int):
    shape, dtype = np.shape(x), getattr(x, "dtype", None)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {shape}")
    if dtype is None or np.dtype(dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {dtype}")


def _check_block_tables(config: PagedCacheConfig, block_tables) -> int:
    _check_int32(block_tables, "block_tables", 2)
    rows, max_pages = np.shape(block_tables)
    if rows != config.max_seqs or max_pages < 1:
        raise ValueError(
            f"block_tables must be [max_seqs={config.max_seqs}, max_pages_per_seq >= 1], "
            f"got shape {np.shape(block_tables)}"
        )
    return max_pages


def _check_append_static(config, k, v, block_tables, seq_ids, loop) -> tuple[int, int]:
    """Trace-time checks (shapes, dtypes, static values); returns (B, n)."""
    _check_loop(config, loop)
    for name, x in (("k", k), ("v", v)):
        shape = np.shape(x)
        if len(shape) != 4:
            raise ValueError(f"{name} must have rank 4 [B, n, H, D], got shape {shape}")
        if shape[2:] != (config.num_heads, config.head_dim):
            raise ValueError(
                f"{name} must have H={config.num_heads}, D={config.head_dim} "
                f"([B, n, H, D]), got shape {shape}"
            )
        if np.dtype(x.dtype) != config.dtype:
            raise TypeError(f"{name}.dtype {np.dtype(x.dtype)} != cache dtype {config.dtype}")
    if np.shape(k) != np.shape(v):
        raise ValueError(f"k {np.shape(k)} and v {np.shape(v)} must have the same shape")
    b, n = np.shape(k)[:2]
    _check_int32(seq_ids, "seq_ids", 1)
    if np.shape(seq_ids)[0] != b:
        raise ValueError(f"seq_ids has {np.shape(seq_ids)[0]} entries but k has B = {b}")
    max_pages = _check_block_tables(config, block_tables)
    if n < 1:
        raise ValueError("k, v must hold at least one token (n >= 1)")
    if n > max_pages * config.page_size:
        raise ValueError(
            f"n = {n} tokens exceed the block table's capacity of "
            f"{max_pages} pages x {config.page_size} tokens per sequence"
        )
    return b, n


def check_append(cache: PagedKVCache, k, v, *, block_tables, seq_ids, loop: int) -> None:
    """Host-side data checks of an `append` call (reads seq_lens, block_tables, seq_ids: a
    device->host transfer; `append` itself never syncs). Raises ValueError when:

    - a seq_id lies outside [0, max_seqs), or appears twice;
    - the new tokens run past the block table (the sequence is full);
    - a page the call writes to is not a physical page id in [0, num_pages), or two
      sequences of the call would write to the same physical page;
    - loop > 0 and loop - 1 of a sequence does not yet hold the tokens being appended
      (its pages must be complete before loop `loop`'s deltas are taken against them).
    """
    config = _check_cache(cache)
    _, n = _check_append_static(config, k, v, block_tables, seq_ids, loop)
    ids, tables = np.asarray(seq_ids), np.asarray(block_tables)
    lens = np.asarray(cache.seq_lens)
    if ids.size and (ids.min() < 0 or ids.max() >= config.max_seqs):
        raise ValueError(f"seq_ids must lie in [0, {config.max_seqs}), got {ids.tolist()}")
    if len(np.unique(ids)) != ids.size:
        raise ValueError(f"seq_ids must be distinct, got {ids.tolist()}")
    ps, capacity = config.page_size, tables.shape[1] * config.page_size
    touched = []
    for s in ids.tolist():
        start, end = int(lens[loop, s]), int(lens[loop, s]) + n
        if end > capacity:
            raise ValueError(
                f"sequence {s} is full: positions {start}..{end - 1} run past its block table "
                f"({tables.shape[1]} pages x {ps} = {capacity} tokens)"
            )
        pages = tables[s, start // ps : (end - 1) // ps + 1]
        bad = pages[(pages < 0) | (pages >= config.num_pages)]
        if bad.size:
            raise ValueError(
                f"sequence {s}: block table holds page id(s) {bad.tolist()} outside "
                f"[0, {config.num_pages}) for positions {start}..{end - 1}"
            )
        touched.extend(pages.tolist())
        if loop > 0 and int(lens[loop - 1, s]) < end:
            raise ValueError(
                f"sequence {s}: loop {loop - 1} holds {int(lens[loop - 1, s])} tokens but loop "
                f"{loop} would reach {end}; append loop {loop - 1} first"
            )
    if len(set(touched)) != len(touched):
        raise ValueError("two sequences of one append write to the same physical page")


# -- page reconstruction ----------------------------------------------------------------------


def _take(packed, *index):
    return jax.tree.map(lambda a: a[index], packed)


def decode_pages(
    cache: PagedKVCache, kind: str, pages, *, loop: int, backend: str = "auto"
) -> jnp.ndarray:
    """Loop `loop` of physical pages `pages` (int32 [N], in range), through the residual
    chain: [N, page_size, H, D] in the cache dtype. `backend` (static): "xla" is the
    reference path below; "auto" / "pallas" / "pallas_interpret" go through
    `kvq_jax.kernels.page_reconstruct.reconstruct_pages` (same bytes, one pass per page)."""
    config = _check_cache(cache)
    loop = _check_loop(config, loop)
    if backend != "xla":
        from kvq_jax.kernels.page_reconstruct import reconstruct_pages

        return reconstruct_pages(cache, kind, pages, loop=loop, backend=backend)
    base, delta = (cache.k_base, cache.k_delta) if kind == "key" else (cache.v_base, cache.v_delta)
    recon = jax.vmap(unpack_kv)(_take(base, pages))
    for r in range(loop):
        payload = _take(delta, r, pages)
        recon = jax.vmap(
            lambda p, prev: decode_residual(KVResidual(payload=p, shape=prev.shape), prev)
        )(payload, recon)
    return recon


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
        spec = config.spec(kind, "base")
        packed = pack_paged(pages, **spec, backend=backend)  # vmap(pack_kv) over pages
        store = getattr(cache, f"{prefix}_base")
        store = jax.tree.map(lambda a, u: a.at[target].set(u, mode="drop"), store, packed)
    else:
        spec = config.spec(kind, "residual")
        previous = decode_pages(
            cache, kind, jnp.clip(target, 0, num_pages - 1), loop=loop - 1, backend=backend
        )
        # A dense residual without window has payload pack_kv(subtract_in_dtype(cur, prev))
        # (`encode_residual`): the deltas of the completed pages are packed as pages.
        delta = subtract_in_dtype(pages, previous)
        packed = pack_paged(delta, **spec, backend=backend)
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
    config = _check_cache(cache)
    _check_append_static(config, k, v, block_tables, seq_ids, loop)
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


def reconstruct(
    cache: PagedKVCache,
    *,
    seq_id,
    length,
    table_row,
    loop: int,
    max_pages: int,
    backend: str = "auto",
):
    """K, V of one sequence and loop as [max_pages * page_size, H, D] (traceable).

    Rows < `length` (a traced int, <= the stored seq_lens[loop, seq_id]) hold the sequence:
    page i comes from the quantized store when it is complete in the cache, from staging when
    it is the partial page; the first `sink` rows are the raw sink rows. Rows >= length are 0.
    """
    config = cache.config
    ps, num_pages = config.page_size, config.num_pages
    stored = cache.seq_lens[loop, seq_id]
    page_ids = jnp.clip(table_row[:max_pages], 0, num_pages - 1)
    i = jnp.arange(max_pages)
    full = ((i + 1) * ps <= stored)[:, None, None, None]
    partial = (i == stored // ps)[:, None, None, None]
    pos = jnp.arange(max_pages * ps)[:, None, None]
    zero = jnp.zeros((), config.dtype)
    out = []
    for kind, prefix in (("key", "k"), ("value", "v")):
        pages = decode_pages(cache, kind, page_ids, loop=loop, backend=backend)
        stage = getattr(cache, f"{prefix}_stage")[loop, seq_id]
        rows = jnp.where(full, pages, jnp.where(partial, stage[None], zero))
        rows = rows.reshape(max_pages * ps, config.num_heads, config.head_dim)
        if config.sink:
            sink_rows = getattr(cache, f"{prefix}_sink")[loop, seq_id]
            n_sink = min(config.sink, rows.shape[0])
            head = jnp.where(pos[:n_sink] < stored, sink_rows[:n_sink], rows[:n_sink])
            rows = rows.at[:n_sink].set(head)
        out.append(jnp.where(pos < length, rows, zero))
    return tuple(out)


@functools.partial(jax.jit, static_argnames=("seq_len", "loop", "backend"))
def gather(
    cache: PagedKVCache, *, seq_id, seq_len: int, block_table, loop: int, backend: str = "auto"
):
    """Reconstructed (K, V), each [seq_len, H, D] in the cache dtype, of sequence `seq_id` in
    loop `loop` (reference path). `seq_len` (static) must not exceed the stored length
    seq_lens[loop, seq_id]; `block_table` is that sequence's int32 row (>= ceil(seq_len /
    page_size) entries). Full pages decode through the residual chain up to `loop`, the
    partial page comes from staging, and sink rows override the first `sink` rows. `backend`
    (static) picks the page reconstruction, as in `decode_pages`."""
    config = _check_cache(cache)
    loop = _check_loop(config, loop)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int | np.integer) or seq_len < 0:
        raise ValueError(f"seq_len must be a static int >= 0, got {seq_len!r}")
    _check_int32(block_table, "block_table", 1)
    max_pages = -(-seq_len // config.page_size)
    if np.shape(block_table)[0] < max_pages:
        raise ValueError(
            f"block_table has {np.shape(block_table)[0]} entries, fewer than the "
            f"{max_pages} pages of {seq_len} tokens"
        )
    if max_pages == 0:
        empty = jnp.zeros((0, config.num_heads, config.head_dim), config.dtype)
        return empty, empty
    k, v = reconstruct(
        cache,
        seq_id=jnp.asarray(seq_id, jnp.int32),
        length=seq_len,
        table_row=jnp.asarray(block_table),
        loop=loop,
        max_pages=max_pages,
        backend=backend,
    )
    return k[:seq_len], v[:seq_len]
