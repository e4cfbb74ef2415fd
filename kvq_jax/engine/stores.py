"""The engine's KV stores: one store per group of decoder layers, the layers folded into it.

A *layer group* is a run of consecutive layers whose caches share one static configuration
(every layer, unless a policy gives each layer its own INTB key table). Its G layers live in
one store whose pool is G x the allocator's: layer j of the group owns physical pages
[j * P, (j + 1) * P) and sequence slots [j * S, (j + 1) * S) (P pages, S slots). The
allocator's block tables address layer 0; `fold_tables` makes the G copies, and
`layer_ids(seq_ids, j, S)` the slots, so the cache operations (`append`, reads, decode
attention) run unchanged on layer j with j a *traced* index: the layer loop is a `lax.scan`
(compiled once, not once per layer), and every update writes only the rows it changes in the
one stacked buffer (in place under donation, as a single layer's cache).

Both stores implement the same operations (no `isinstance` at the call sites):

    store.at_layer(layer) -> store                   (read / write as model layer `layer`)
    store.append(k, v, tables, seq_ids, start, loop=..., backend=..., exited=None) -> store
    store.attend(q, tables, seq_ids, lens, loop=..., backend=..., return_lse=False)
        -> float32 [B, Hq, D] (and with return_lse its log-sum-exp [B, Hq])
    store.clear_slots(slots) -> store
    store.fork(parent, child, num_tokens, parent_pages, child_pages, layers=, num_pages=,
               max_seqs=) -> store
    store.take(slots, pages) -> {name: host array}       (swap out: a sequence's rows)
    store.put(rows, slots, pages) -> store               (swap in, byte for byte)

with k, v [B, n, H, D] at positions start[b] .. + n, q [B, Hq, D] (any number of query heads
per KV head: prefill passes a chunk's T queries as T x G heads), tables the folded block
tables and seq_ids the folded slots. `attend` reads the first lens[b] rows block of pages by
block of pages (online softmax: peak memory one block, whatever the context).
`QuantizedStore` wraps a `PagedKVCache` (`kvq_jax.cache.paged_cache`); `RawStore` holds
unquantized K/V ("bf16" policy) in the model's compute dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvq_jax.cache import paged_attention, paged_cache
from kvq_jax.codecs import cache_state
from kvq_jax.codecs.attention import OnlineSoftmax, default_block_pages
from kvq_jax.codecs.cache_state import PagedKVCache

__all__ = ["QuantizedStore", "RawStore", "fold_tables", "layer_ids", "sequence_ids"]


def fold_tables(tables, num_layers: int, num_pages: int):
    """Block tables int32 [S, M] of layer 0 -> [num_layers * S, M]: row j * S + s is row s
    with every page id p >= 0 moved to j * num_pages + p (-1 stays -1: no page)."""
    tables = jnp.asarray(tables, jnp.int32)
    offsets = (jnp.arange(num_layers, dtype=jnp.int32) * num_pages)[:, None, None]
    folded = jnp.where(tables[None] >= 0, tables[None] + offsets, -1)
    return folded.reshape(num_layers * tables.shape[0], tables.shape[1])


def layer_ids(seq_ids, layer, max_seqs: int):
    """Slots int32 [B] of layer `layer` (traced int) of a group: seq_ids + layer * max_seqs."""
    return jnp.asarray(seq_ids, jnp.int32) + jnp.asarray(layer, jnp.int32) * max_seqs


def sequence_ids(slot: int, pages, *, layers: int, num_pages: int, max_seqs: int):
    """The folded slots int32 [layers] and pages int32 [layers * len(pages)] (layer-major) of
    one sequence of a group of `layers` layers: slot + j * max_seqs, pages + j * num_pages."""
    pages = np.asarray(pages, np.int32)
    j = np.arange(layers, dtype=np.int32)
    return slot + j * max_seqs, (pages[None] + (j * num_pages)[:, None]).reshape(-1)


def _padded(ids, fill: int):
    """int32 ids padded with `fill` (out of range: dropped by the writes) to a power of two,
    so that swaps of any length share a few compiled shapes."""
    ids = np.asarray(ids, np.int32)
    size = 1 << max(0, int(ids.size - 1).bit_length())
    return jnp.asarray(np.pad(ids, (0, size - ids.size), constant_values=fill))


def _take_axis(a, ids, axis: int):
    return jnp.take(a, ids, axis=axis, mode="clip")


def _put_axis(a, ids, values, axis: int):
    """a with a[(:,) * axis + (ids,)] = values; ids past the end dropped. A delta plane
    ([L - 1, P, ...], axis 1) is written one loop at a time (a scatter at (:, ids) transposes
    the values and runs ~5x slower on XLA:CPU)."""
    if axis == 0:
        return a.at[ids].set(values, mode="drop")
    for r in range(a.shape[0]):
        a = a.at[r, ids].set(values[r], mode="drop")
    return a


@jax.jit
def _take_cache(cache, slots, pages):
    rows = {name: _take_axis(a, pages, axis) for name, axis, a in cache.page_arrays()}
    rows.update((name, _take_axis(a, slots, 1)) for name, a in cache.slot_arrays())
    return rows


@functools.partial(jax.jit, donate_argnums=0)
def _put_cache(cache, rows, slots, pages):
    new = {name: _put_axis(a, pages, rows[name], axis) for name, axis, a in cache.page_arrays()}
    new.update(
        (name, a.at[:, slots].set(rows[name], mode="drop")) for name, a in cache.slot_arrays()
    )
    return cache.with_arrays(new)


@functools.partial(jax.jit, donate_argnums=0)
def _copy_pages(store, src, dst):
    """RawStore with pages dst = pages src (every loop plane)."""
    return RawStore(*(a.at[:, dst].set(a[:, src]) for a in (store.k, store.v)))


@dataclasses.dataclass(frozen=True)
class QuantizedStore:
    """A quantized paged store of G layers: `cache` a PagedKVCache of G * P pages and G * S
    slots (`fold_tables`)."""

    cache: PagedKVCache

    @classmethod
    def empty(cls, config, num_layers: int):
        """Zero store of `num_layers` layers, each with PagedCacheConfig `config`."""
        folded = dataclasses.replace(
            config,
            num_pages=config.num_pages * num_layers,
            max_seqs=config.max_seqs * num_layers,
        )
        return cls(paged_cache.init_cache(folded))

    def at_layer(self, layer):
        """The store read and written as model layer `layer` (traced int): a format with one
        table per layer uses that layer's (`cache_state.at_layer`)."""
        return QuantizedStore(cache_state.at_layer(self.cache, layer))

    def append(self, k, v, tables, seq_ids, start, *, loop, backend, exited=None):
        del start  # the cache knows its lengths (seq_lens[loop])
        cache = paged_cache.append(
            self.cache, k, v, block_tables=tables, seq_ids=seq_ids, loop=loop, exited=exited,
            backend=backend,
        )  # fmt: skip
        return QuantizedStore(cache)

    def attend(self, q, tables, seq_ids, lens, *, loop, backend, return_lse=False):
        return paged_attention.paged_decode_attention(
            q, self.cache, tables, lens, loop=loop, seq_ids=seq_ids, backend=backend,
            return_lse=return_lse,
        )  # fmt: skip

    def clear_slots(self, slots):
        """Empty the folded slots `slots` (ints) for a new sequence (`paged_cache.clear_slot`)."""
        return QuantizedStore(paged_cache.clear_slot(self.cache, slot=list(slots)))

    def set_lengths(self, slots, length: int):
        """Folded slots `slots` (ints) hold `length` tokens in every stored loop: their pages
        and staging rows were written by another producer (a disaggregated prefill,
        `kvq_torch_bridge.bridge.handoff`)."""
        ids = jnp.asarray(list(slots), jnp.int32)
        lens = self.cache.seq_lens.at[:, ids].set(jnp.int32(length))
        return QuantizedStore(dataclasses.replace(self.cache, seq_lens=lens))

    def fork(self, parent, child, num_tokens, parent_pages, child_pages, *, layers, num_pages,
             max_seqs):  # fmt: skip
        """Sequence `child` starts on the first num_tokens tokens of `parent` (allocator slots)
        in every layer: `paged_cache.fork` per layer (the shared complete pages are the
        allocator's; the partial page lives in the staging rows, copied). In place."""
        del parent_pages, child_pages
        cache = self.cache
        for j in range(layers):
            cache = paged_cache.fork(cache, parent=parent + j * max_seqs,
                                     child=child + j * max_seqs, num_tokens=num_tokens)  # fmt: skip
        return QuantizedStore(cache)

    def take(self, slots, pages) -> dict:
        """Host copies of folded slots `slots` and pages `pages` (`sequence_ids`): every page
        array ([n, ...] base, [L - 1, n, ...] delta) and slot array ([L, len(slots), ...])."""
        n = len(pages)
        fill = self.cache.config.num_pages
        rows = jax.device_get(_take_cache(self.cache, _padded(slots, 0), _padded(pages, fill)))
        out = {}
        for name, axis, _ in self.cache.page_arrays():
            out[name] = np.asarray(rows[name])[(slice(None),) * axis + (slice(0, n),)]
        for name, _ in self.cache.slot_arrays():
            out[name] = np.asarray(rows[name][:, : len(slots)])
        return out

    def put(self, rows: dict, slots, pages):
        """Write `take`'s rows into folded slots `slots` and pages `pages` (any free ones, in
        the same order), byte for byte. In place."""
        cache = self.cache
        slot_ids = _padded(slots, cache.config.max_seqs)
        page_ids = _padded(pages, cache.config.num_pages)

        def pad(a, axis, size):
            widths = [(0, 0)] * a.ndim
            widths[axis] = (0, size - a.shape[axis])
            return np.pad(a, widths)

        padded = {name: pad(rows[name], axis, page_ids.size)
                  for name, axis, _ in cache.page_arrays()}  # fmt: skip
        padded.update((name, pad(rows[name], 1, slot_ids.size)) for name, _ in cache.slot_arrays())
        return QuantizedStore(_put_cache(cache, padded, slot_ids, page_ids))

    def layer(self, j: int, num_pages: int, max_seqs: int, index: int = 0) -> PagedKVCache:
        """A copy of layer j's cache as a standalone PagedKVCache (P pages, S slots), read as
        model layer `index` (`cache_state.at_layer`)."""
        cache = self.cache
        config = dataclasses.replace(cache.config, num_pages=num_pages, max_seqs=max_seqs)

        def pages(a, axis):
            return lax.slice_in_dim(a, j * num_pages, (j + 1) * num_pages, axis=axis)

        def slots(a):
            return lax.slice_in_dim(a, j * max_seqs, (j + 1) * max_seqs, axis=1)

        updates = {name: pages(a, axis) for name, axis, a in cache.page_arrays()}
        updates.update((name, slots(a)) for name, a in cache.slot_arrays())
        return cache_state.at_layer(
            dataclasses.replace(cache.with_arrays(updates), config=config), index
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of the packed pages (base and residual planes) of every layer."""
        leaves = jax.tree.leaves((self.cache.k_base, self.cache.v_base,
                                  self.cache.k_delta, self.cache.v_delta))  # fmt: skip
        return sum(a.size * a.dtype.itemsize for a in leaves)

    def shardings(self, mesh, axis: str):
        return QuantizedStore(cache_state.head_shardings(self.cache, mesh, axis))


#: 16-bit float rows kept as their bit patterns: XLA:CPU rewrites a bfloat16
#: dynamic-update-slice as float32 (a convert of the whole buffer, then a copy back: O(the
#: pool) per write, measured 9-11x the step time at 16x the pages); on integer bits the
#: update stays in place. A bitcast costs nothing on a GPU.
_STORED_AS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16)}
_LOGICAL = {v: k for k, v in _STORED_AS.items()}


def _to_stored(x, stored):
    """Values -> the store's element type (bits for bfloat16)."""
    logical = _LOGICAL.get(jnp.dtype(stored))
    if logical is None:
        return x.astype(stored)
    return lax.bitcast_convert_type(x.astype(logical), stored)


def _from_stored(a):
    """The store's elements -> values (bfloat16 from its bits)."""
    logical = _LOGICAL.get(jnp.dtype(a.dtype))
    return a if logical is None else lax.bitcast_convert_type(a, logical)


@dataclasses.dataclass(frozen=True)
class RawStore:
    """Unquantized paged K/V of G layers: k, v [loops, G * P, page_size, H, D] in the model's
    dtype, bfloat16 as its uint16 bits (`_STORED_AS`; `layer` returns values)."""

    k: Any
    v: Any

    @classmethod
    def empty(cls, num_loops, num_pages, page_size, num_heads, head_dim, dtype, num_layers=1):
        shape = (num_loops, num_pages * num_layers, page_size, num_heads, head_dim)
        stored = _STORED_AS.get(jnp.dtype(dtype), jnp.dtype(dtype))
        return cls(jnp.zeros(shape, stored), jnp.zeros(shape, stored))  # zero bits: +0.0

    @classmethod
    def from_values(cls, k, v) -> RawStore:
        """A store holding the values k, v [loops, G * P, page_size, H, D] (their dtype)."""
        stored = _STORED_AS.get(jnp.dtype(k.dtype), jnp.dtype(k.dtype))
        return cls(_to_stored(k, stored), _to_stored(v, stored))

    def at_layer(self, layer):
        del layer  # raw rows have no per-layer tables
        return self

    def append(self, k, v, tables, seq_ids, start, *, loop, backend, exited=None):
        """Write k, v [B, n, H, D] at positions start[b] .. + n (no page: dropped)."""
        del backend, exited  # one layout; an exited token's k, v are given as they are
        _, num_pages, ps = self.k.shape[:3]
        n = k.shape[1]
        pos = start[:, None] + jnp.arange(n)[None]  # [B, n]
        rows = tables.at[seq_ids].get(mode="fill", fill_value=-1)  # [B, M]
        page = jnp.take_along_axis(rows, jnp.clip(pos // ps, 0, rows.shape[1] - 1), axis=1)
        page = jnp.where((page >= 0) & (pos // ps < rows.shape[1]), page, num_pages)
        row = pos % ps
        new_k = self.k.at[loop, page, row].set(_to_stored(k, self.k.dtype), mode="drop")
        new_v = self.v.at[loop, page, row].set(_to_stored(v, self.v.dtype), mode="drop")
        return RawStore(new_k, new_v)

    def attend(self, q, tables, seq_ids, lens, *, loop, backend, return_lse=False,
               block_pages=None):  # fmt: skip
        """q [B, Hq, D] over the first lens[b] rows of slots seq_ids in `loop`, `block_pages`
        pages at a time (None: `default_block_pages`), stopping after the last block any row
        attends. float32 [B, Hq, D] (0 for lens 0), with return_lse also the log-sum-exp."""
        del backend
        _, num_pages, ps, h, d = self.k.shape
        b, hq, _ = q.shape
        rows = tables.at[seq_ids].get(mode="fill", fill_value=-1)  # [B, M]
        m_pages = rows.shape[1]
        bp = min(default_block_pages(ps) if block_pages is None else int(block_pages), m_pages)
        n_blocks = -(-m_pages // bp)
        rows = jnp.pad(rows, ((0, 0), (0, n_blocks * bp - m_pages)), constant_values=-1)
        page_ids = jnp.clip(rows, 0, num_pages - 1)
        lens = jnp.asarray(lens, jnp.int32)
        soft = OnlineSoftmax(jnp.asarray(q, jnp.float32).reshape(b, h, hq // h, d))
        block_tokens = bp * ps

        def body(j, state):
            pages = lax.dynamic_slice_in_dim(page_ids, j * bp, bp, axis=1)  # [B, bp]
            # one gather at (loop, pages): self.k[loop][pages] would copy the loop's plane
            k = _from_stored(self.k[loop, pages]).reshape(b, block_tokens, h, d)
            v = _from_stored(self.v[loop, pages]).reshape(b, block_tokens, h, d)
            pos = j * block_tokens + jnp.arange(block_tokens)[None, :]
            return soft.update(state, k, v, pos < lens[:, None])

        needed = jnp.minimum((jnp.max(lens) + block_tokens - 1) // block_tokens, n_blocks)
        state = lax.fori_loop(0, needed, body, soft.init())
        lse = soft.lse(state)
        out = jnp.where(jnp.isfinite(lse)[..., None], soft.finish(state), 0.0).reshape(b, hq, d)
        return (out, lse.reshape(b, hq)) if return_lse else out

    def clear_slots(self, slots):
        del slots  # no per-slot state: a slot's rows are its pages
        return self

    def set_lengths(self, slots, length: int):
        del slots, length  # no lengths kept: attention reads the positions it is given
        return self

    def fork(self, parent, child, num_tokens, parent_pages, child_pages, *, layers, num_pages,
             max_seqs):  # fmt: skip
        """The child's own pages (past the shared complete ones) get the parent's rows: the
        partial page, copied (copy-on-write). In place."""
        del parent, child, max_seqs
        first = num_tokens // self.k.shape[2]  # complete pages: shared, not copied
        last = -(-num_tokens // self.k.shape[2])  # the partial page, if any
        src = np.asarray(parent_pages[first:last], np.int32)
        dst = np.asarray(child_pages[first:last], np.int32)
        if not src.size:
            return self
        _, src = sequence_ids(0, src, layers=layers, num_pages=num_pages, max_seqs=0)
        _, dst = sequence_ids(0, dst, layers=layers, num_pages=num_pages, max_seqs=0)
        return _copy_pages(self, jnp.asarray(src), jnp.asarray(dst))

    def take(self, slots, pages) -> dict:
        """Host copies of pages `pages` (every loop plane): {"k", "v": [loops, n, ...]}."""
        del slots
        n = len(pages)
        ids = _padded(pages, self.k.shape[1])
        rows = jax.device_get({"k": _take_axis(self.k, ids, 1), "v": _take_axis(self.v, ids, 1)})
        return {name: np.asarray(a[:, :n]) for name, a in rows.items()}

    def put(self, rows: dict, slots, pages):
        """Write `take`'s rows into pages `pages`, byte for byte. In place."""
        del slots
        ids = _padded(pages, self.k.shape[1])
        size = ids.size

        def pad(a):
            return np.pad(a, [(0, 0), (0, size - a.shape[1])] + [(0, 0)] * (a.ndim - 2))

        return _put_raw(self, pad(rows["k"]), pad(rows["v"]), ids)

    def layer(self, j: int, num_pages: int, max_seqs: int, index: int = 0) -> RawStore:
        """A copy of layer j's K/V values: k, v [loops, P, page_size, H, D]."""
        del max_seqs, index
        return RawStore(*(_from_stored(lax.slice_in_dim(a, j * num_pages, (j + 1) * num_pages,
                                                        axis=1))
                          for a in (self.k, self.v)))  # fmt: skip

    @property
    def page_bytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (self.k, self.v))

    def shardings(self, mesh, axis: str):
        heads = self.k.shape[3]
        size = mesh.shape.get(axis)
        if size is None or heads % size:
            raise ValueError(
                f"mesh: axis {axis!r} of size {size} must divide the {heads} KV heads "
                f"(mesh axes {dict(mesh.shape)})"
            )
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        spec = NamedSharding(mesh, P(None, None, None, axis))
        return RawStore(spec, spec)


@functools.partial(jax.jit, donate_argnums=0)
def _put_raw(store, k, v, ids):
    return RawStore(store.k.at[:, ids].set(k, mode="drop"), store.v.at[:, ids].set(v, mode="drop"))


jax.tree_util.register_dataclass(QuantizedStore, data_fields=["cache"], meta_fields=[])
jax.tree_util.register_dataclass(RawStore, data_fields=["k", "v"], meta_fields=[])
