"""The append-time quantized paged KV cache in torch (mirrors kvq_jax.cache.paged_cache, same
bytes).

Same layout and field names as `kvq_jax.codecs.cache_state.PagedKVCache` (see that module's doc),
with torch tensors; the configuration is `kvq_jax.cache.paged_cache.PagedCacheConfig` itself
(static, framework-neutral). After the same appends every packed page, staging row, sink row and
seq_lens entry has the bytes of the JAX cache, and `gather` returns the same bits.

`append` writes into the cache's tensors in place (`index_copy_` of the rows that change: the
store is never reallocated, so a decode step costs O(the tokens appended), not O(the pool)) and
returns the same cache; it is vectorized over the batch: loop 0 pages go through `pack_paged`,
loop l > 0 pages through the page-wise residual (delta in the cache dtype against the
reconstructed loop l - 1 page, packed with `pack_paged`), exactly as `encode_residual` per page.
Out-of-range writes are dropped as JAX's `mode="drop"` scatters drop them, without reading
anything back to the host (`_put_`); data errors are caught by `check_append` on the host.
`fork`, `swap_out` / `swap_in` and adaptive exits are those of `kvq_jax.cache.paged_cache`, with the
same bytes (a sequence swapped out of one stack swaps into the other).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvq_jax.core import checks
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.containers import CACHE_FIELDS, PagedCacheBase, plane_fields, rest_dtype
from kvq_jax.core.offload import HostSequence, expected_shapes
from kvq_jax.core.registry import layout
from kvq_torch_bridge.cache.paged import pack_paged, unpack_paged
from kvq_torch_bridge.codecs._dtypes import BITS, from_numpy, meta, to_numpy, torch_dtype
from kvq_torch_bridge.codecs._numerics import add_in_dtype, subtract_in_dtype
from kvq_torch_bridge.codecs.packed import PackedKV, register_pytree
from kvq_torch_bridge.codecs.registry import get_codec
from kvq_torch_bridge.codecs.rope import apply_rope, invert_rope, rope_at

__all__ = [
    "PagedCacheConfig",
    "PagedKVCache",
    "append",
    "check_append",
    "check_fork",
    "clear_slot",
    "decode_pages",
    "fork",
    "gather",
    "gather_batch",
    "init_cache",
    "read_batch",
    "swap_in",
    "swap_out",
]


class PagedKVCache(PagedCacheBase):
    """The cache state, torch tensors (`kvq_jax.codecs.cache_state` documents the fields)."""

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device


register_pytree(PagedKVCache, CACHE_FIELDS, ("config",))


def _empty_packed(config: PagedCacheConfig, spec: dict, batch: tuple, device) -> PackedKV:
    codec = get_codec(spec["format"])
    shapes = codec.array_shapes(config.page_shape, spec["axis"], spec["group_size"])
    arrays = {
        name: torch.zeros((*batch, *shape), dtype=torch_dtype(rest_dtype(dt)), device=device)
        for name, (shape, dt) in shapes.items()
    }
    return PackedKV(**arrays, **spec, shape=config.page_shape, dtype=config.dtype)


def key_rope(config: PagedCacheConfig, positions: torch.Tensor):
    """(cos, sin) of int positions for a pre-RoPE cache's keys (`config.rope_theta`), else
    None (`kvq_jax.codecs.cache_state.key_rope`)."""
    if config.rope_theta is None:
        return None
    return rope_at(positions, config.head_dim, config.rope_theta)


def rope_keys(config: PagedCacheConfig, rows: torch.Tensor, rope, *, invert: bool = False):
    """Key rows [..., T, H, D] turned by `rope` (RoPE put back, or taken off with invert), in
    the cache dtype; rows as they are for `rope` None (`kvq_jax...cache_state.rope_keys`)."""
    if rope is None:
        return rows
    turn = invert_rope if invert else apply_rope
    return turn(rows, *rope).to(torch_dtype(config.dtype))


def _check_config(config) -> PagedCacheConfig:
    if not isinstance(config, PagedCacheConfig):
        raise TypeError(f"config must be a PagedCacheConfig, got {type(config).__name__}")
    return config


def init_cache(config: PagedCacheConfig, device=None) -> PagedKVCache:
    """An empty cache on `device` (default: CPU): zero pages, staging and sink rows, seq_lens 0."""
    c = _check_config(config)
    device = torch.device("cpu" if device is None else device)
    dt = torch_dtype(c.dtype)

    def stage():
        return torch.zeros((c.num_loops, c.max_seqs, *c.page_shape), dtype=dt, device=device)

    def sink():
        shape = (c.num_loops, c.max_seqs, c.sink, c.num_heads, c.head_dim)
        return torch.zeros(shape, dtype=dt, device=device)

    stored = {}
    for name, _, loops, args in c.plane_specs():
        batch = (c.num_pages,) if name.endswith("base") else (len(loops), c.num_pages)
        stored[name] = _empty_packed(c, args, batch, device)

    return PagedKVCache(
        **plane_fields(stored),
        k_stage=stage(),
        v_stage=stage(),
        k_sink=sink(),
        v_sink=sink(),
        seq_lens=torch.zeros((c.num_loops, c.max_seqs), dtype=torch.int32, device=device),
        depth=torch.zeros((c.num_pages, c.page_size), dtype=torch.uint8, device=device)
        if c.adaptive_exit
        else None,
        stage_exited=torch.zeros(
            (c.num_loops, c.max_seqs, c.page_size), dtype=torch.bool, device=device
        )
        if c.adaptive_exit
        else None,
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


def check_append(
    cache: PagedKVCache, k, v, *, block_tables, seq_ids, loop: int, exited=None
) -> None:
    """Host-side data checks of an `append` call (`kvq_jax.core.checks.host_check_append`, the
    JAX cache's checks and messages) on host copies of seq_lens, block_tables and seq_ids (a
    device->host transfer; `append` itself never syncs). k and v are checked by shape only."""
    config = _check_cache(cache)
    _, n = checks.check_append_args(
        config, meta(k), meta(v), meta(block_tables), meta(seq_ids), loop, meta(exited)
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


def _put_(dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """dst[index[i]] = values[i] along dim 0, in place, dropping out-of-range indices (JAX's
    `mode="drop"`, negative ids wrapped once) without a host sync: a dropped write is
    redirected to repeat the first kept one (or, when none is kept, to rewrite row 0 with
    itself), so every row written receives a single value and `index_copy_` is deterministic
    (kept indices are distinct: `check_append`)."""
    if index.numel() == 0:
        return
    # The integer view of the same bytes: index_copy_ / where exist for every width (not for
    # float8 on CPU), and a view writes into dst's own storage.
    bits = BITS[dst.element_size()] if dst.dtype != torch.bool else torch.bool
    dst, values = dst.view(bits), _bits(values, dst.dtype, bits)
    index = _normalize(index.reshape(-1), dst.shape[0])
    keep = (index >= 0) & (index < dst.shape[0])
    first = torch.argmax(keep.to(torch.uint8))
    any_kept = keep.any()
    spare_index = torch.where(any_kept, index[first], 0)
    spare_value = torch.where(any_kept, values[first], dst[0])
    mask = keep.reshape(-1, *([1] * (values.ndim - 1)))
    index = torch.where(keep, index, spare_index)
    dst.index_copy_(0, index, torch.where(mask, values, spare_value))


def _bits(values: torch.Tensor, dtype: torch.dtype, bits: torch.dtype) -> torch.Tensor:
    """`values` in `dtype` as `bits`; 1-byte floats going into a uint8 plane (`rest_dtype`) as
    their own bits."""
    if dtype == torch.uint8 and values.is_floating_point() and values.element_size() == 1:
        return values.view(bits)
    return values.to(dtype).view(bits)


def codec_view(packed: PackedKV) -> PackedKV:
    """A stored plane (or pages taken from one) with its format's dtypes (stored as
    `kvq_jax.core.containers.rest_dtype` says; `kvq_jax.codecs.cache_state.codec_view`)."""
    shapes = layout(packed.format).array_shapes(packed.shape, packed.axis, packed.group_size)
    fields = {n: a.view(torch_dtype(shapes[n][1])) for n, a in packed.arrays.items()}
    return dataclasses.replace(packed, **fields)


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
    [N, page_size, H, D] in the cache dtype (reference path; an adaptive-exit cache skips the
    deltas of rows past their `depth`)."""
    config = _check_cache(cache)
    loop = checks.check_loop_index(loop, config.num_loops)
    pages = _index_tensor(pages, cache.device).to(torch.int64)
    depth = None if cache.depth is None else cache.depth[pages][:, :, None, None]
    recon = None
    for i, plane, level, absolute in cache.loop_chain(kind, loop):
        take = (lambda a: a[pages]) if level is None else (lambda a, r=level: a[r][pages])
        decoded = unpack_paged(codec_view(_map_packed(plane, take)))
        if recon is None:  # the chain's first plane: decoded on its own
            recon = decoded
            continue
        step = decoded if absolute else add_in_dtype(recon, decoded)
        recon = step if depth is None else torch.where(depth >= i, step, recon)
    return recon


# -- append -----------------------------------------------------------------------------------


def _buffer(old: torch.Tensor, new: torch.Tensor, off: torch.Tensor, num_complete: int):
    """Per sequence: its old partial page [ps, ...] then the new rows [n, ...] at row `off`,
    as num_complete + 1 pages: [B, C + 1, ps, ...]."""
    b, ps, rest = old.shape[0], old.shape[1], old.shape[2:]
    n = new.shape[1]
    buf = new.new_zeros((b, (num_complete + 1) * ps, *rest))
    buf[:, :ps] = old
    rows_at = off[:, None] + torch.arange(n, device=new.device)[None]  # [B, n]
    buf[torch.arange(b, device=new.device)[:, None], rows_at] = new
    return buf.reshape(b, num_complete + 1, ps, *rest)


def _last_page(buf: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """The buffer page holding row `fill`, rows past fill % ps zeroed: the new partial page."""
    b, ps = buf.shape[0], buf.shape[2]
    last = buf[torch.arange(b, device=buf.device), fill // ps]  # [B, ps, ...]
    keep = torch.arange(ps, device=buf.device)[None] < (fill % ps)[:, None]
    keep = keep.reshape(*keep.shape, *([1] * (last.ndim - 2)))
    return torch.where(keep, last, torch.zeros((), dtype=last.dtype, device=buf.device))


def _plan(config, start, n, tables, seq_ids):
    """(off [B], fill [B], target [B * C], logical [B * C], C): where one append's rows go
    (`kvq_jax`'s; logical: the page of its sequence each buffer page is)."""
    ps, num_pages = config.page_size, config.num_pages
    device = start.device
    c = -(-n // ps)
    off = start % ps
    fill = off + n
    j = torch.arange(c, device=device)
    complete = (j[None] + 1) * ps <= fill[:, None]  # [B, C]
    logical = (start // ps)[:, None] + j[None]
    seq_index, seq_valid = _fill_index(seq_ids, tables.shape[0])
    in_table = seq_valid[:, None] & (logical < tables.shape[1])
    phys = tables[seq_index[:, None], logical.clamp(max=tables.shape[1] - 1)].to(torch.int64)
    phys = torch.where(in_table, phys, -1)
    valid = complete & (phys >= 0) & (phys < num_pages)
    return off, fill, torch.where(valid, phys, num_pages).reshape(-1), logical.reshape(-1), c


def _store_pages(cache, kind, pages, exited_rows, target, loop):
    """Quantize completed pages [B * C, ps, H, D] into the plane of K or V's loop `loop`, in
    place (loop 0 and absolute loops: the pages themselves; later loops: the delta against
    the reconstructed loop l - 1 page; exited rows as `kvq_jax.cache.paged_cache`'s)."""
    config = cache.config
    absolute = loop in config.absolute_loops(kind)
    if loop == 0 or (absolute and exited_rows is None):
        payload = pages
    else:
        previous = decode_pages(cache, kind, target.clamp(0, config.num_pages - 1), loop=loop - 1)
        # an exited row (`depth`): a zero delta, or in an absolute loop its previous loop
        payload = pages if absolute else subtract_in_dtype(pages, previous)
        if exited_rows is not None:
            kept = previous if absolute else torch.zeros((), dtype=payload.dtype)
            payload = torch.where(exited_rows[:, :, None, None], kept, payload)
    packed = pack_paged(payload, **config.loop_pack_args(kind, loop))
    plane, level = cache.loop_plane(kind, loop)
    for name, a in plane.arrays.items():
        _put_(a if level is None else a[level], target, packed.arrays[name])


@torch.no_grad()
def append(
    cache: PagedKVCache, k, v, *, block_tables, seq_ids, loop: int, exited=None
) -> PagedKVCache:
    """Append `n` tokens to each of `B` sequences in loop `loop`, in place; returns `cache`
    (the bytes of `kvq_jax.cache.paged_cache.append`; see it for the arguments and semantics).

    k, v: torch [B, n, H, D] in the cache dtype on the cache's device; block_tables int32
    [max_seqs, max_pages_per_seq] and seq_ids int32 [B] (torch tensors, or numpy arrays copied
    to the cache's device); exited: None or bool [B, n] (adaptive-exit caches, loop > 0).
    Shape/dtype errors raise here; data errors (full sequence, bad page or slot ids: their
    writes are dropped, loop l - 1 not ready) are caught by `check_append`.
    """
    config = _check_cache(cache)
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    checks.check_append_args(
        config, meta(k), meta(v), meta(block_tables), meta(seq_ids), loop, meta(exited)
    )
    device = cache.device
    k, v = k.to(device), v.to(device)
    seq_ids, tables = _index_tensor(seq_ids, device), _index_tensor(block_tables, device)
    b, n = k.shape[:2]
    start = _fill_get(cache.seq_lens[loop], seq_ids).to(torch.int64)
    off, fill, target, logical, c = _plan(config, start, n, tables, seq_ids)
    ps = config.page_size

    exited_rows = None
    if config.adaptive_exit:
        new = torch.zeros((b, n), dtype=torch.bool, device=device)
        if exited is not None:
            new = _index_tensor(exited, device).to(torch.bool)
        buf = _buffer(_fill_get(cache.stage_exited[loop], seq_ids, False), new, off, c)
        rows = buf[:, :c].reshape(b * c, ps)
        exited_rows = rows if loop else None
        depth = _fill_get(cache.depth, target)
        fresh = torch.full_like(depth, config.num_loops - 1) if loop == 0 else depth
        cap = torch.full_like(depth, max(loop - 1, 0))
        _put_(cache.depth, target, torch.where(rows, torch.minimum(fresh, cap), fresh))
        _put_(cache.stage_exited[loop], seq_ids, _last_page(buf, fill))

    for kind, prefix, new in (("key", "k", k), ("value", "v", v)):
        stage = getattr(cache, f"{prefix}_stage")[loop]  # [S, ps, H, D], a view
        buf = _buffer(_fill_get(stage, seq_ids), new, off, c)
        pages = buf[:, :c].reshape(b * c, *config.page_shape)
        if kind == "key":  # a pre-RoPE cache packs the keys with RoPE taken off
            positions = logical[:, None] * ps + torch.arange(ps, device=device)
            pages = rope_keys(config, pages, key_rope(config, positions), invert=True)
        _store_pages(cache, kind, pages, exited_rows, target, loop)
        _put_(stage, seq_ids, _last_page(buf, fill))
        if config.sink:  # position i < sink takes new token i - start when it is in the call
            sink = getattr(cache, f"{prefix}_sink")[loop]
            idx = torch.arange(config.sink, device=device)[None] - start[:, None]  # [B, sink]
            in_call = ((idx >= 0) & (idx < n))[:, :, None, None]
            taken = new[torch.arange(b, device=device)[:, None], idx.clamp(0, n - 1)]
            _put_(sink, seq_ids, torch.where(in_call, taken, _fill_get(sink, seq_ids)))
    _put_(cache.seq_lens[loop], seq_ids, (start + n).to(torch.int32))
    return cache


# -- reconstruction ---------------------------------------------------------------------------


@torch.no_grad()
def read_batch(cache: PagedKVCache, *, seq_ids, lengths, table_rows, loop: int, max_pages: int):
    """K, V of a batch of sequences of one loop, each [B, max_pages * page_size, H, D]
    (`kvq_jax.codecs.cache_state.read_batch`).

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
        pages = pages.reshape(b, max_pages * ps, h, d)
        if kind == "key":  # stored before RoPE: turned at each row's position in its sequence
            pages = rope_keys(config, pages, key_rope(config, pos[0, :, 0, 0]))
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
    (int or 0-d tensor) in loop `loop`: the bits of `kvq_jax.cache.paged_cache.gather` (see it).
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


# -- sequences: fork, swap ---------------------------------------------------------------------


def check_fork(cache: PagedKVCache, *, parent: int, child: int, num_tokens: int) -> None:
    """Host-side checks of a `fork` (`kvq_jax.cache.paged_cache.check_fork`'s, on a host copy of
    seq_lens)."""
    _check_cache(cache)
    checks.host_check_fork(cache.config, _host(cache.seq_lens), parent, child, num_tokens)


@torch.no_grad()
def fork(cache: PagedKVCache, *, parent: int, child: int, num_tokens: int) -> PagedKVCache:
    """Start sequence `child` on the first `num_tokens` tokens of `parent`, in place (the
    bytes of `kvq_jax.cache.paged_cache.fork`); returns `cache`."""
    config = _check_cache(cache)
    ps = config.page_size
    device = cache.device
    for name, a in cache.slot_arrays():
        if name == "seq_lens":
            continue
        rows = a[:, parent].clone()
        limit = num_tokens % ps if name != "k_sink" and name != "v_sink" else num_tokens
        keep = torch.arange(rows.shape[1], device=device) < limit
        keep = keep.reshape(1, -1, *([1] * (rows.ndim - 2)))
        a[:, child] = torch.where(keep, rows, torch.zeros((), dtype=a.dtype, device=device))
    cache.seq_lens[:, child] = num_tokens
    return cache


@torch.no_grad()
def swap_out(cache: PagedKVCache, *, slot: int, pages) -> HostSequence:
    """Copy sequence `slot` (its physical `pages` in logical order, every loop plane, its
    staging and sink rows and lengths) to host memory (`kvq_jax.cache.paged_cache.swap_out`)."""
    config = _check_cache(cache)
    pages = checks.check_page_ids(config, pages)
    checks.check_slot(config, slot)
    index = torch.from_numpy(pages.astype(np.int64)).to(cache.device)
    arrays = {name: a.index_select(axis, index) for name, axis, a in cache.page_arrays()}
    arrays.update((name, a[:, slot]) for name, a in cache.slot_arrays())
    want = expected_shapes(config, len(pages))  # stored uint8 bits -> the format's dtypes
    arrays = {k: to_numpy(a).view(want[k][1]) for k, a in arrays.items()}
    return HostSequence(config=config, arrays=arrays)


@torch.no_grad()
def swap_in(cache: PagedKVCache, sequence: HostSequence, *, slot: int, pages) -> PagedKVCache:
    """Write a swapped-out sequence (from either stack) into slot `slot` and physical `pages`,
    in place, byte for byte (`kvq_jax.cache.paged_cache.swap_in`); returns `cache`."""
    config = _check_cache(cache)
    pages = checks.check_swap_in(config, sequence, slot, pages)
    device = cache.device
    index = torch.from_numpy(pages.astype(np.int64)).to(device)
    for name, axis, a in cache.page_arrays():
        values = sequence.arrays[name]
        _index_copy_(a, axis, index, from_numpy(values.view(rest_dtype(values.dtype)), device))
    for name, a in cache.slot_arrays():
        a[:, slot] = from_numpy(sequence.arrays[name], device)
    return cache


def _index_copy_(dst: torch.Tensor, dim: int, index: torch.Tensor, values: torch.Tensor) -> None:
    """dst.index_copy_ through the integer view of the same bytes (float8 has none on CPU)."""
    bits = BITS[dst.element_size()] if dst.dtype != torch.bool else torch.bool
    dst.view(bits).index_copy_(dim, index, _bits(values, dst.dtype, bits))


@torch.no_grad()
def clear_slot(cache: PagedKVCache, *, slot: int) -> PagedKVCache:
    """Empty sequence slot `slot` in place (`kvq_jax.cache.paged_cache.clear_slot`); returns
    `cache`."""
    config = _check_cache(cache)
    checks.check_slot(config, slot)
    for _, a in cache.slot_arrays():
        a[:, slot] = 0
    return cache


@torch.no_grad()
def gather_batch(cache: PagedKVCache, block_tables, seq_lens, *, loop: int, seq_ids=None):
    """Reconstructed K, V of a batch: [B, max_pages_per_seq * page_size, H, D] each, rows
    >= seq_lens[b] zero (`kvq_jax.cache.paged_cache.gather_batch`, the same bits)."""
    config = _check_cache(cache)
    loop = checks.check_loop_index(loop, config.num_loops)
    checks.check_block_tables(config, meta(block_tables))
    b = checks.check_batch(config, meta(seq_lens), meta(seq_ids))
    return batch_rows(cache, block_tables, seq_lens, seq_ids, b, loop)


def batch_rows(cache, block_tables, seq_lens, seq_ids, b: int, loop: int):
    """`gather_batch` for validated arguments (B = b)."""
    device = cache.device
    if seq_ids is None:
        seq_ids = torch.arange(b, dtype=torch.int32, device=device)
    seq_ids, tables = _index_tensor(seq_ids, device), _index_tensor(block_tables, device)
    # tables.at[seq].get(mode="fill", fill_value=-1): out-of-range slots read page -1.
    index, valid = _fill_index(seq_ids, cache.config.max_seqs)
    rows = torch.where(valid[:, None], tables[index], torch.full_like(tables[index], -1))
    return read_batch(
        cache, seq_ids=seq_ids, lengths=_index_tensor(seq_lens, device), table_rows=rows,
        loop=loop, max_pages=tables.shape[1],
    )  # fmt: skip
