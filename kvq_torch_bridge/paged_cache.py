"""The append-time quantized paged KV cache in torch (mirrors kvq_jax.paged_cache, same bytes).

Same layout and field names as `kvq_jax.paged_cache.PagedKVCache` (see that module's doc), with
torch tensors; the configuration is `kvq_jax.paged_cache.PagedCacheConfig` itself (static,
framework-neutral). After the same appends every packed page, staging row, sink row and
seq_lens entry has the bytes of the JAX cache, and `gather` returns the same bits.

`append` is functional (returns a new cache; the input's tensors are never written) and
vectorized over the batch: loop 0 pages go through `pack_paged`, loop l > 0 pages through the
page-wise residual (delta in the cache dtype against the reconstructed loop l - 1 page, packed
with `pack_paged`), exactly as `encode_residual` per page. Out-of-range writes are dropped the
way JAX's `mode="drop"` scatters drop them: through one spare row that is cut off afterwards,
so nothing reads data back to the host (no `.item()`, no data-dependent shapes). Data errors
are caught by `check_append` on the host, which runs kvq_jax's checks on numpy copies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from kvq_jax.core import checks
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_torch_bridge._dtypes import meta, torch_dtype
from kvq_torch_bridge._numerics import add_in_dtype, subtract_in_dtype
from kvq_torch_bridge.packed import PackedKV, register_pytree
from kvq_torch_bridge.paged import pack_paged, unpack_paged
from kvq_torch_bridge.registry import get_codec

__all__ = [
    "PagedCacheConfig",
    "PagedKVCache",
    "append",
    "check_append",
    "decode_pages",
    "gather",
    "init_cache",
    "read_batch",
]

_DATA_FIELDS = (
    "k_base",
    "v_base",
    "k_delta",
    "v_delta",
    "k_stage",
    "v_stage",
    "k_sink",
    "v_sink",
    "seq_lens",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedKVCache:
    """The cache state, torch tensors (fields as `kvq_jax.paged_cache.PagedKVCache`)."""

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
    def device(self) -> torch.device:
        return self.seq_lens.device

    @property
    def storage_bytes(self) -> int:
        """Bytes of every tensor held (packed pages, staging, sink rows, lengths)."""
        leaves = torch.utils._pytree.tree_leaves(self)
        return sum(a.numel() * a.element_size() for a in leaves)


register_pytree(PagedKVCache, _DATA_FIELDS, ("config",))


def _empty_packed(config: PagedCacheConfig, spec: dict, batch: tuple, device) -> PackedKV:
    codec = get_codec(spec["format"])
    shapes = codec.array_shapes(config.page_shape, spec["axis"], spec["group_size"])
    arrays = {
        name: torch.zeros((*batch, *shape), dtype=torch_dtype(dt), device=device)
        for name, (shape, dt) in shapes.items()
    }
    return PackedKV(**arrays, **spec, shape=config.page_shape, dtype=config.dtype)


def _check_config(config) -> PagedCacheConfig:
    if not isinstance(config, PagedCacheConfig):
        raise TypeError(f"config must be a PagedCacheConfig, got {type(config).__name__}")
    return config


def init_cache(config: PagedCacheConfig, device=None) -> PagedKVCache:
    """An empty cache on `device` (default: CPU): zero pages, staging and sink rows, seq_lens 0."""
    c = _check_config(config)
    device = torch.device("cpu" if device is None else device)
    dt = torch_dtype(c.dtype)
    delta_batch = (c.num_loops - 1, c.num_pages)
    has_delta = c.num_loops > 1

    def stage():
        return torch.zeros((c.num_loops, c.max_seqs, *c.page_shape), dtype=dt, device=device)

    def sink():
        shape = (c.num_loops, c.max_seqs, c.sink, c.num_heads, c.head_dim)
        return torch.zeros(shape, dtype=dt, device=device)

    def packed(kind, level, batch):
        return _empty_packed(c, c.pack_args(kind, level), batch, device)

    return PagedKVCache(
        k_base=packed("key", "base", (c.num_pages,)),
        v_base=packed("value", "base", (c.num_pages,)),
        k_delta=packed("key", "residual", delta_batch) if has_delta else None,
        v_delta=packed("value", "residual", delta_batch) if has_delta else None,
        k_stage=stage(),
        v_stage=stage(),
        k_sink=sink(),
        v_sink=sink(),
        seq_lens=torch.zeros((c.num_loops, c.max_seqs), dtype=torch.int32, device=device),
        config=c,
    )


# -- argument checks (kvq_jax's, on shape/dtype views of the tensors) ---------------------------


def _check_cache(cache) -> PagedCacheConfig:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    return cache.config


def _index_tensor(x, device) -> torch.Tensor:
    """An int32 index tensor on `device` (a torch tensor is moved, never read)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return torch.from_numpy(np.array(x, dtype=np.int32, copy=True)).to(device)


def _host(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def check_append(cache: PagedKVCache, k, v, *, block_tables, seq_ids, loop: int) -> None:
    """Host-side data checks of an `append` call (`kvq_jax.core.checks.host_check_append`, the
    JAX cache's checks and messages) on host copies of seq_lens, block_tables and seq_ids (a
    device->host transfer; `append` itself never syncs). k and v are checked by shape only."""
    config = _check_cache(cache)
    _, n = checks.check_append_args(
        config, meta(k), meta(v), meta(block_tables), meta(seq_ids), loop
    )
    checks.host_check_append(
        config, _host(cache.seq_lens), n, _host(block_tables), _host(seq_ids), loop
    )


# -- index helpers (JAX's out-of-bounds modes, without host reads) ------------------------------


def _normalize(ids: torch.Tensor, size: int) -> torch.Tensor:
    """Negative ids wrap once (as JAX normalizes them); the rest stay as given."""
    ids = ids.to(torch.int64)
    return torch.where(ids < 0, ids + size, ids)


def _fill_index(ids: torch.Tensor, size: int):
    """(clamped index, in-range mask) for a `mode="fill"` get of `ids` along an axis of `size`."""
    ids = _normalize(ids, size)
    valid = (ids >= 0) & (ids < size)
    return ids.clamp(0, max(size - 1, 0)), valid


def _drop_index(ids: torch.Tensor, size: int) -> torch.Tensor:
    """Index for a `mode="drop"` set along an axis of `size`: out-of-range ids -> `size`, the
    spare row `_scatter_drop` cuts off."""
    ids = _normalize(ids, size)
    return torch.where((ids >= 0) & (ids < size), ids, size)


def _scatter_drop(a: torch.Tensor, index: torch.Tensor, values: torch.Tensor, dim: int = 0):
    """A new tensor: `a` with a[..., index[i], ...] = values[i] along `dim` (index from
    `_drop_index`; entries equal to a.shape[dim] are dropped)."""
    spare = list(a.shape)
    spare[dim] = 1
    padded = torch.cat([a, a.new_zeros(spare)], dim=dim)
    prefix = (slice(None),) * dim
    padded[(*prefix, index)] = values.to(a.dtype)
    return padded.narrow(dim, 0, a.shape[dim])


def _fill_get(a: torch.Tensor, ids: torch.Tensor, fill=0) -> torch.Tensor:
    """a[ids] along dim 0, rows of out-of-range ids set to `fill` (JAX `mode="fill"`)."""
    index, valid = _fill_index(ids, a.shape[0])
    rows = a[index]
    mask = valid.reshape(valid.shape + (1,) * (rows.ndim - valid.ndim))
    return torch.where(mask, rows, torch.full((), fill, dtype=a.dtype, device=a.device))


def _map_packed(packed: PackedKV, fn) -> PackedKV:
    return dataclasses.replace(packed, **{name: fn(a) for name, a in packed.arrays.items()})


# -- page reconstruction ----------------------------------------------------------------------


@torch.no_grad()
def decode_pages(cache: PagedKVCache, kind: str, pages, *, loop: int) -> torch.Tensor:
    """Loop `loop` of physical pages `pages` (int [N], in range), through the residual chain:
    [N, page_size, H, D] in the cache dtype (reference path)."""
    config = _check_cache(cache)
    loop = checks.check_loop_index(loop, config.num_loops)
    base, delta = (cache.k_base, cache.k_delta) if kind == "key" else (cache.v_base, cache.v_delta)
    pages = _index_tensor(pages, cache.device).to(torch.int64)
    recon = unpack_paged(_map_packed(base, lambda a: a[pages]))
    for r in range(loop):
        recon = add_in_dtype(recon, unpack_paged(_map_packed(delta, lambda a, r=r: a[r][pages])))
    return recon


# -- append -----------------------------------------------------------------------------------


def _append_one(cache, kind, new, start, tables, seq_ids, loop):
    """The update of one of K / V; returns (packed store, staging [S, ...], sink [S, ...])."""
    config = cache.config
    ps, h, d, num_pages = config.page_size, config.num_heads, config.head_dim, config.num_pages
    b, n = new.shape[:2]
    device = new.device
    complete_max = -(-n // ps)  # an append of n tokens completes at most ceil(n / ps) pages
    off = start % ps  # [B] fill of the partial page before the call
    fill = off + n  # rows of the buffer holding data

    prefix = "k" if kind == "key" else "v"
    stage = getattr(cache, f"{prefix}_stage")[loop]  # [S, ps, H, D]
    sink = getattr(cache, f"{prefix}_sink")[loop]  # [S, sink, H, D]
    slots = _drop_index(seq_ids, config.max_seqs)

    # Per sequence a buffer of (C + 1) pages: the old partial page, then the new rows at `off`.
    buf = new.new_zeros((b, (complete_max + 1) * ps, h, d))
    buf[:, :ps] = _fill_get(stage, seq_ids)
    rows_at = off[:, None] + torch.arange(n, device=device)[None]  # [B, n]
    buf[torch.arange(b, device=device)[:, None], rows_at] = new
    buf = buf.reshape(b, complete_max + 1, ps, h, d)

    # Pages completed by this call: buffer page j, logical page start // ps + j.
    j = torch.arange(complete_max, device=device)
    complete = (j[None] + 1) * ps <= fill[:, None]  # [B, C]
    logical = (start // ps)[:, None] + j[None]
    seq_index, seq_valid = _fill_index(seq_ids, tables.shape[0])
    in_table = seq_valid[:, None] & (logical < tables.shape[1])
    phys = tables[seq_index[:, None], logical.clamp(max=tables.shape[1] - 1)].to(torch.int64)
    phys = torch.where(in_table, phys, -1)
    valid = complete & (phys >= 0) & (phys < num_pages)
    target = torch.where(valid, phys, num_pages).reshape(-1)  # num_pages: dropped
    pages = buf[:, :complete_max].reshape(b * complete_max, ps, h, d)

    if loop == 0:
        packed = pack_paged(pages, **config.pack_args(kind, "base"))
        store = getattr(cache, f"{prefix}_base")
        store = dataclasses.replace(
            store,
            **{
                name: _scatter_drop(a, target, packed.arrays[name])
                for name, a in store.arrays.items()
            },
        )
    else:
        previous = decode_pages(cache, kind, target.clamp(0, num_pages - 1), loop=loop - 1)
        packed = pack_paged(
            subtract_in_dtype(pages, previous), **config.pack_args(kind, "residual")
        )
        store = getattr(cache, f"{prefix}_delta")
        plane = loop - 1

        def update(name, a):
            return _replace_plane(a, plane, _scatter_drop(a[plane], target, packed.arrays[name]))

        store = dataclasses.replace(
            store, **{name: update(name, a) for name, a in store.arrays.items()}
        )

    # New partial page: buffer page fill // ps, rows past fill % ps zeroed.
    last = buf[torch.arange(b, device=device), fill // ps]  # [B, ps, H, D]
    keep = torch.arange(ps, device=device)[None, :, None, None] < (fill % ps)[:, None, None, None]
    new_stage = torch.where(keep, last, torch.zeros((), dtype=new.dtype, device=device))
    stage = _scatter_drop(stage, slots, new_stage)

    # Sink rows: position i < sink takes new token i - start when it is in this call.
    if config.sink:
        idx = torch.arange(config.sink, device=device)[None] - start[:, None]  # [B, sink]
        in_call = (idx >= 0) & (idx < n)
        taken = new[torch.arange(b, device=device)[:, None], idx.clamp(0, n - 1)]
        old_sink = _fill_get(sink, seq_ids)
        sink = _scatter_drop(sink, slots, torch.where(in_call[:, :, None, None], taken, old_sink))
    return store, stage, sink


def _replace_plane(a: torch.Tensor, plane: int, value: torch.Tensor) -> torch.Tensor:
    return torch.cat([a[:plane], value[None], a[plane + 1 :]])


@torch.no_grad()
def append(cache: PagedKVCache, k, v, *, block_tables, seq_ids, loop: int) -> PagedKVCache:
    """Append `n` tokens to each of `B` sequences in loop `loop`; returns the new cache (the
    bytes of `kvq_jax.paged_cache.append`; see it for the arguments and semantics).

    k, v: torch [B, n, H, D] in the cache dtype on the cache's device; block_tables int32
    [max_seqs, max_pages_per_seq] and seq_ids int32 [B] (torch tensors, or numpy arrays copied
    to the cache's device). Shape/dtype errors raise here; data errors (full sequence, bad page
    or slot ids: their writes are dropped, loop l - 1 not ready) are caught by `check_append`.
    """
    config = _check_cache(cache)
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    checks.check_append_args(config, meta(k), meta(v), meta(block_tables), meta(seq_ids), loop)
    device = cache.device
    k, v = k.to(device), v.to(device)
    seq_ids, tables = _index_tensor(seq_ids, device), _index_tensor(block_tables, device)
    start = _fill_get(cache.seq_lens[loop], seq_ids).to(torch.int64)
    k_store, k_stage, k_sink = _append_one(cache, "key", k, start, tables, seq_ids, loop)
    v_store, v_stage, v_sink = _append_one(cache, "value", v, start, tables, seq_ids, loop)
    slots = _drop_index(seq_ids, config.max_seqs)
    lens_row = _scatter_drop(cache.seq_lens[loop], slots, start + k.shape[1])
    store = (
        dict(k_base=k_store, v_base=v_store)
        if loop == 0
        else dict(k_delta=k_store, v_delta=v_store)
    )
    return dataclasses.replace(
        cache,
        **store,
        k_stage=_replace_plane(cache.k_stage, loop, k_stage),
        v_stage=_replace_plane(cache.v_stage, loop, v_stage),
        k_sink=_replace_plane(cache.k_sink, loop, k_sink),
        v_sink=_replace_plane(cache.v_sink, loop, v_sink),
        seq_lens=_replace_plane(cache.seq_lens, loop, lens_row),
    )


# -- reconstruction ---------------------------------------------------------------------------


@torch.no_grad()
def read_batch(cache: PagedKVCache, *, seq_ids, lengths, table_rows, loop: int, max_pages: int):
    """K, V of a batch of sequences of one loop, each [B, max_pages * page_size, H, D]
    (`kvq_jax.cache_state.read_batch`).

    seq_ids int [B]; lengths int [B] (each <= the stored seq_lens[loop, seq]); table_rows int
    [B, >= max_pages]. Rows < length hold the sequence (complete pages from the quantized
    store, the partial page from staging, the first `sink` rows from the sink rows); rows >=
    length are zero.
    """
    config = cache.config
    ps, num_pages, h, d = config.page_size, config.num_pages, config.num_heads, config.head_dim
    device = cache.device
    b = seq_ids.shape[0]
    seq_index, _ = _fill_index(seq_ids, config.max_seqs)  # JAX gets clamp out-of-range ids
    stored = cache.seq_lens[loop][seq_index].to(torch.int64)  # [B]
    page_ids = table_rows[:, :max_pages].to(torch.int64).clamp(0, num_pages - 1)  # [B, M]
    i = torch.arange(max_pages, device=device)
    full = ((i[None] + 1) * ps <= stored[:, None])[:, :, None, None, None]
    partial = (i[None] == (stored // ps)[:, None])[:, :, None, None, None]
    pos = torch.arange(max_pages * ps, device=device)[None, :, None, None]
    dtype = torch_dtype(config.dtype)
    zero = torch.zeros((), dtype=dtype, device=device)
    out = []
    for kind, prefix in (("key", "k"), ("value", "v")):
        pages = decode_pages(cache, kind, page_ids.reshape(-1), loop=loop)
        pages = pages.reshape(b, max_pages, ps, h, d)
        stage = getattr(cache, f"{prefix}_stage")[loop][seq_index][:, None]  # [B, 1, ps, H, D]
        rows = torch.where(full, pages, torch.where(partial, stage, zero))
        rows = rows.reshape(b, max_pages * ps, h, d)
        if config.sink:
            sink_rows = getattr(cache, f"{prefix}_sink")[loop][seq_index]
            n_sink = min(config.sink, rows.shape[1])
            head = torch.where(
                pos[:, :n_sink] < stored[:, None, None, None],
                sink_rows[:, :n_sink],
                rows[:, :n_sink],
            )
            rows = torch.cat([head, rows[:, n_sink:]], dim=1)
        lengths64 = lengths.to(device=device, dtype=torch.int64)
        out.append(torch.where(pos < lengths64[:, None, None, None], rows, zero))
    return tuple(out)


@torch.no_grad()
def gather(cache: PagedKVCache, *, seq_id, seq_len: int, block_table, loop: int):
    """Reconstructed (K, V), each [seq_len, H, D] in the cache dtype, of sequence `seq_id`
    (int or 0-d tensor) in loop `loop`: the bits of `kvq_jax.paged_cache.gather` (see it).
    `block_table` is that sequence's int32 row (torch tensor or numpy array)."""
    config = _check_cache(cache)
    loop = checks.check_loop_index(loop, config.num_loops)
    max_pages = checks.check_gather_args(config, seq_len, meta(block_table))
    device = cache.device
    if max_pages == 0:
        empty = torch.zeros((0, config.num_heads, config.head_dim), dtype=torch_dtype(config.dtype))
        return empty.to(device), empty.to(device)
    if isinstance(seq_id, torch.Tensor):
        seq_ids = seq_id.to(device=device, dtype=torch.int64).reshape(1)
    else:
        seq_ids = torch.full((1,), int(seq_id), dtype=torch.int64, device=device)
    k, v = read_batch(
        cache,
        seq_ids=seq_ids,
        lengths=torch.full((1,), seq_len, dtype=torch.int64, device=device),
        table_rows=_index_tensor(block_table, device)[None],
        loop=loop,
        max_pages=max_pages,
    )
    return k[0, :seq_len], v[0, :seq_len]
