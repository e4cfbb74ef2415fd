"""The serving cache's lifecycle in both stacks: in-place appends, the page allocator, swap to
host and disk, prefix sharing and adaptive exits, driven the way a server drives the cache.

Every check compares against something independent: a dense reference built from the same
tokens with the public codec functions, page by page (`reference_rows`), the other stack's
bytes, or the state before a refused call.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import assert_same_bytes, numpy_to_torch, torch_to_numpy

from kvq_jax.cache import paged_cache as jpc
from kvq_jax.codecs.api import pack_kv, unpack_kv
from kvq_jax.codecs.cache_state import codec_view
from kvq_jax.codecs.residual import decode_residual, encode_residual
from kvq_jax.core.allocator import PageAllocator
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.offload import HostSequence, load_sequence, save_sequence
from kvq_torch_bridge.cache import paged_cache as tpc

H, D = 2, 16
MAX_PAGES = 5


def make_config(**kw) -> PagedCacheConfig:
    base = dict(
        num_pages=14, page_size=4, num_heads=H, head_dim=D, dtype=ml_dtypes.bfloat16,
        num_loops=3, k_base_format="int4", k_residual_format="fp8_e4m3", v_base_format="nvfp4",
        v_residual_format="int4", sink=2, max_seqs=3, adaptive_exit=True,
    )  # fmt: skip
    base.update(kw)
    return PagedCacheConfig(**base)


def jax_leaves(cache) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(cache)]


def torch_leaves(cache) -> list[np.ndarray]:
    return [torch_to_numpy(a) for a in torch.utils._pytree.tree_leaves(cache)]


def assert_stacks_equal(jcache, tcache, what="cache"):
    for i, (a, b) in enumerate(zip(jax_leaves(jcache), torch_leaves(tcache), strict=True)):
        assert_same_bytes(a, b, f"{what} leaf {i}")


class Both:
    """A JAX cache and a Torch cache driven by the same calls."""

    def __init__(self, config):
        self.config = config
        self.j = jpc.init_cache(config)
        self.t = tpc.init_cache(config)

    def append(self, k, v, tables, ids, loop, exited=None):
        ex_j = None if exited is None else jnp.asarray(exited)
        ex_t = None if exited is None else torch.from_numpy(np.asarray(exited))
        jpc.check_append(self.j, jnp.asarray(k), jnp.asarray(v), block_tables=jnp.asarray(tables),
                         seq_ids=jnp.asarray(ids), loop=loop, exited=ex_j)  # fmt: skip
        self.j = jpc.append(self.j, jnp.asarray(k), jnp.asarray(v),
                            block_tables=jnp.asarray(tables), seq_ids=jnp.asarray(ids),
                            loop=loop, exited=ex_j)  # fmt: skip
        self.t = tpc.append(self.t, numpy_to_torch(k), numpy_to_torch(v),
                            block_tables=torch.from_numpy(tables), seq_ids=torch.from_numpy(ids),
                            loop=loop, exited=ex_t)  # fmt: skip


# -- in place ---------------------------------------------------------------------------------


def _one_token(config, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((2, 1, H, D)).astype(config.dtype)
    tables = (np.arange(config.max_seqs * MAX_PAGES) % config.num_pages).astype(np.int32)
    return k, tables.reshape(config.max_seqs, MAX_PAGES), np.arange(2, dtype=np.int32)


@pytest.mark.parametrize("pool", [16, 512])
def test_jax_append_updates_every_leaf_in_place(pool):
    """Every cache leaf is an input/output alias of the compiled append, and after a call the
    returned leaves are the buffers that were passed in (the old cache is consumed)."""
    config = make_config(num_pages=pool)
    cache = jpc.init_cache(config)
    k, tables, ids = _one_token(config)
    args = (jnp.asarray(k), jnp.asarray(k), jnp.asarray(tables), jnp.asarray(ids), None)
    text = jpc._APPEND[True].lower(cache, *args, loop=0, backend="xla").compile().as_text()
    aliases = re.search(r"input_output_alias=\{(.*?)\}\s*,?\s*(entry|$)", text, re.S)
    n_leaves = len(jax.tree.leaves(cache))
    assert (
        aliases
        and aliases.group(1).count("may-alias") + aliases.group(1).count("must-alias") == n_leaves
    )
    before = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(cache)]
    out = jpc.append(cache, *args[:2], block_tables=args[2], seq_ids=args[3], loop=0)
    assert all(a.is_deleted() for a in jax.tree.leaves(cache))
    assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves(out)] == before
    kept = jpc.append(out, *args[:2], block_tables=args[2], seq_ids=args[3], loop=0, donate=False)
    assert not any(a.is_deleted() for a in jax.tree.leaves(out))
    assert int(kept.seq_lens[0, 0]) == 2


def _pool_wide_ops(cache, loop: int) -> list[str]:
    """Instructions of the compiled, donated append whose result spans the page pool and that
    are neither a parameter, the output tuple nor an in-place update (scatter / dynamic
    update slice): each one is a pass over the whole pool."""
    config = cache.config
    k, tables, ids = _one_token(config)
    args = (jnp.asarray(k), jnp.asarray(k), jnp.asarray(tables), jnp.asarray(ids), None)
    text = jpc._APPEND[True].lower(cache, *args, loop=loop, backend="xla").compile().as_text()
    out = []
    for line in text[text.index("\nENTRY") :].splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = \(?\w+\[([\d,]*)\]\S* (\w[\w-]*)\(", line)
        if not m or str(config.num_pages) not in m.group(2).split(","):
            continue
        name, op = m.group(1), m.group(3)
        in_place = op == "fusion" and ("scatter" in name or "dynamic-update-slice" in name)
        if op not in ("parameter", "tuple") and not in_place:
            out.append(f"{op} {name} [{m.group(2)}]")
    return out


@pytest.mark.parametrize("loop", [0, 1])
def test_jax_append_touches_the_pool_only_in_place(loop):
    """E4M3 fields (NVFP4 block scales, FP8 codes) included: the pool is written by in-place
    scatters only (a float8 plane would be widened, copied and narrowed on XLA:CPU)."""
    cache = jpc.init_cache(make_config(num_pages=509))
    assert _pool_wide_ops(cache, loop) == []


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_pool_check_catches_float8_planes():
    """Planted defect: planes holding E4M3 fields as float8 (not as uint8 bits)."""
    cache = jpc.init_cache(make_config(num_pages=509))
    planted = dataclasses.replace(
        cache, v_base=codec_view(cache.v_base), k_delta=codec_view(cache.k_delta)
    )
    assert _pool_wide_ops(planted, 0) + _pool_wide_ops(planted, 1) == []


def test_init_cache_leaves_are_distinct_buffers():
    cache = jpc.init_cache(make_config())
    pointers = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(cache)]
    assert len(set(pointers)) == len(pointers)


def test_torch_append_writes_into_the_store():
    """The Torch append returns the same cache object and tensors: every tensor keeps its data
    pointer (no reallocation of the store), through page completions and residual loops."""
    config = make_config()
    cache = tpc.init_cache(config)
    pointers = [a.data_ptr() for a in torch.utils._pytree.tree_leaves(cache)]
    rng = np.random.default_rng(1)
    tables = torch.from_numpy(np.arange(15, dtype=np.int32).reshape(3, 5) % 14)
    ids = torch.tensor([0, 2], dtype=torch.int32)
    for loop in range(3):
        x = numpy_to_torch(rng.standard_normal((2, 6, H, D)).astype(config.dtype))
        out = tpc.append(cache, x, x, block_tables=tables, seq_ids=ids, loop=loop)
        assert out is cache
    assert [a.data_ptr() for a in torch.utils._pytree.tree_leaves(cache)] == pointers
    assert cache.seq_lens[:, 0].tolist() == [6, 6, 6]


# -- the allocator ----------------------------------------------------------------------------


def _state(alloc: PageAllocator):
    return (alloc.block_tables(), alloc.num_free_pages, alloc.live_slots,
            [alloc.refcount(p) for p in range(alloc.num_pages)])  # fmt: skip


def _assert_unchanged(alloc, before):
    after = _state(alloc)
    np.testing.assert_array_equal(after[0], before[0])
    assert after[1:] == before[1:]


def test_allocator_grows_frees_and_forks():
    alloc = PageAllocator(num_pages=6, page_size=4, max_seqs=3, max_pages_per_seq=4)
    a = alloc.add_sequence(5)  # 2 pages
    assert alloc.pages(a).tolist() == [0, 1] and alloc.capacity(a) == 8
    assert alloc.reserve(a, 9).tolist() == [2]
    b = alloc.fork(a, 10)  # shares pages 0, 1 (8 tokens), own page for the partial one
    assert alloc.pages(b).tolist()[:2] == [0, 1] and alloc.pages(b)[2] == 3
    assert alloc.is_shared(b, 0) and not alloc.is_shared(b, 2)
    assert alloc.refcount(0) == 2
    assert alloc.free(a) == [2]  # pages 0, 1 stay with b
    assert alloc.refcount(0) == 1 and alloc.num_free_pages == 3
    alloc.check_block_tables(alloc.block_tables())
    assert sorted(alloc.free(b)) == [0, 1, 3] and alloc.num_free_pages == 6


@pytest.mark.parametrize(
    "action, match",
    [
        (lambda a, s: a.reserve(s, 16), "out of pages"),
        (lambda a, s: a.reserve(s, 17), "more than max_pages_per_seq"),
        (lambda a, s: a.add_sequence(8), "out of pages"),
        (lambda a, s: a.free(2), "freed twice|not live"),
        (lambda a, s: a.reserve(2, 1), "not live"),
        (lambda a, s: a.fork(s, 9), "exceeds"),
        (lambda a, s: a.reserve(s, -1), "num_tokens"),
        (lambda a, s: a.free(7), "slot must be"),
    ],
)
def test_allocator_refusals_change_nothing(action, match):
    alloc = PageAllocator(num_pages=5, page_size=4, max_seqs=3, max_pages_per_seq=4)
    s = alloc.add_sequence(8)
    alloc.add_sequence(8)
    t = alloc.add_sequence(4)
    alloc.free(t)
    before = _state(alloc)
    with pytest.raises(ValueError, match=match):
        action(alloc, s)
    _assert_unchanged(alloc, before)


def test_allocator_slots_run_out_and_tables_are_checked():
    alloc = PageAllocator(num_pages=8, page_size=4, max_seqs=2, max_pages_per_seq=4)
    a, b = alloc.add_sequence(4), alloc.add_sequence(4)
    before = _state(alloc)
    with pytest.raises(ValueError, match="no free sequence slot"):
        alloc.add_sequence(1)
    _assert_unchanged(alloc, before)
    tables = alloc.block_tables()
    tables[b, 0] = tables[a, 0]  # b points at a's page
    with pytest.raises(
        ValueError, match=r"block_tables\[1, 0\] = 0: that page is owned by sequence 0"
    ):
        alloc.check_block_tables(tables)
    tables = alloc.block_tables()
    tables[a, 1] = 7  # a free page
    with pytest.raises(ValueError, match="is free"):
        alloc.check_block_tables(tables)


# -- the dense reference ------------------------------------------------------------------------


class Reference:
    """What one sequence's cache must hold, from its tokens alone: per loop the K (or V) rows
    appended and per token its exit loop (rows appended after it are its exit loop's)."""

    def __init__(self, config):
        self.config = config
        self.x = {"key": [], "value": []}  # per token: [L, H, D]
        self.exit = []

    def add(self, kind, rows, exits):
        self.x[kind].extend(rows)
        if kind == "key":
            self.exit.extend(exits)

    def rows(self, kind: str, loop: int, length: int) -> np.ndarray:
        """The reconstructed rows of loop `loop`: complete pages through the residual chain,
        page by page with `pack_kv` / `encode_residual` (a zero delta, kept out of the
        reconstruction, for the rows whose token had exited), the partial page and the sink
        rows raw."""
        c = self.config
        ps = c.page_size
        x = np.stack(self.x[kind])[:length]  # [T, L, H, D]
        exits = np.asarray(self.exit[:length])
        out = x[:, loop].copy()
        for p in range(length // ps):
            rows = slice(p * ps, (p + 1) * ps)
            recon = unpack_kv(pack_kv(jnp.asarray(x[rows, 0]), **c.pack_args(kind, "base")))
            for r in range(1, loop + 1):
                gone = exits[rows] < r
                current = jnp.where(gone[:, None, None], recon, jnp.asarray(x[rows, r]))
                residual = encode_residual(current, recon, **c.pack_args(kind, "residual"))
                step = decode_residual(residual, recon)
                recon = jnp.where(gone[:, None, None], recon, step)
            out[rows] = np.asarray(recon)
        out[: min(c.sink, length)] = x[: min(c.sink, length), loop]
        return out


def gather_all(cache, config, slot, table_row, loop, length):
    k, v = jpc.gather(cache, seq_id=slot, seq_len=length, block_table=jnp.asarray(table_row),
                      loop=loop)  # fmt: skip
    return np.asarray(k), np.asarray(v)


# -- the lifecycle, scripted ------------------------------------------------------------------


def _tokens(rng, config, n, exit_loops=None):
    """[L, n, H, D] K and V for n tokens; a token with exit e repeats loop e after it."""
    k = rng.standard_normal((config.num_loops, n, H, D)).astype(np.float32)
    v = rng.standard_normal((config.num_loops, n, H, D)).astype(np.float32)
    k = np.cumsum(k * np.array([1.0] + [0.3] * (config.num_loops - 1))[:, None, None, None], 0)
    v = np.cumsum(v * np.array([1.0] + [0.3] * (config.num_loops - 1))[:, None, None, None], 0)
    exits = np.full(n, config.num_loops - 1) if exit_loops is None else np.asarray(exit_loops)
    for t, e in enumerate(exits):
        k[e + 1 :, t] = k[e, t]
        v[e + 1 :, t] = v[e, t]
    return k.astype(config.dtype), v.astype(config.dtype), exits


def _append_tokens(both, refs, slots, k, v, exits, tables):
    """Append n tokens to each sequence of `slots` (k, v: [L, B, n, H, D]) loop by loop."""
    ids = np.asarray(slots, np.int32)
    for loop in range(both.config.num_loops):
        exited = None
        if loop and both.config.adaptive_exit:
            exited = exits < loop  # [B, n]
        both.append(k[loop], v[loop], tables, ids, loop, exited)
    for b, slot in enumerate(slots):
        refs[slot].add("key", list(np.moveaxis(k[:, b], 0, 1)), exits[b].tolist())
        refs[slot].add("value", list(np.moveaxis(v[:, b], 0, 1)), exits[b].tolist())


def _check_sequences(both, refs, alloc):
    assert_stacks_equal(both.j, both.t)
    tables = alloc.block_tables()
    for slot in alloc.live_slots:
        length = len(refs[slot].exit)
        for loop in range(both.config.num_loops):
            k, v = gather_all(both.j, both.config, slot, tables[slot], loop, length)
            assert_same_bytes(k, refs[slot].rows("key", loop, length), f"seq {slot} K loop {loop}")
            assert_same_bytes(
                v, refs[slot].rows("value", loop, length), f"seq {slot} V loop {loop}"
            )


@pytest.mark.slow  # 80 s; test_random_schedule runs the same operations by default
def test_lifecycle_prefill_decode_exit_swap_fork(tmp_path):
    """Two sequences prefill and decode (some tokens exit early), one swaps out to disk and
    back into other pages, one forks at its current length (copy-on-write of the partial page)
    and both branches decode on: at every step the JAX and Torch caches hold the same bytes
    and every live sequence reads back exactly the dense reference."""
    config = make_config()
    rng = np.random.default_rng(0)
    both = Both(config)
    alloc = PageAllocator.for_config(config, MAX_PAGES)
    refs = {s: Reference(config) for s in range(config.max_seqs)}
    a, b = alloc.add_sequence(6), alloc.add_sequence(3)
    for slot, n in ((a, 6), (b, 3)):
        k, v, ex = _tokens(rng, config, n, exit_loops=rng.integers(0, 3, n))
        _append_tokens(both, refs, [slot], k[:, None], v[:, None], ex[None], alloc.block_tables())
    _check_sequences(both, refs, alloc)
    for step in range(3):  # decode: one token each
        for slot in (a, b):
            alloc.reserve(slot, len(refs[slot].exit) + 1)
        k, v, ex = _tokens(rng, config, 2, exit_loops=[step % 3, 2])
        _append_tokens(both, refs, [a, b], k[:, :, None], v[:, :, None], ex[:, None],
                       alloc.block_tables())  # fmt: skip
    _check_sequences(both, refs, alloc)

    # Swap b out (to host, to disk), free it, swap it back into other pages and slot.
    pages_b = alloc.pages(b)
    host_j = jpc.swap_out(both.j, slot=b, pages=pages_b)
    host_t = tpc.swap_out(both.t, slot=b, pages=pages_b)
    for name in host_j.arrays:
        assert_same_bytes(host_t.arrays[name], host_j.arrays[name], f"swapped {name}")
    save_sequence(tmp_path / "b.safetensors", host_j)
    alloc.free(b)
    hold = alloc.add_sequence(len(pages_b) * config.page_size)  # b's old slot and pages
    loaded = load_sequence(tmp_path / "b.safetensors", config)
    c = alloc.add_sequence(len(refs[b].exit))
    assert c != b and not set(alloc.pages(c)) & set(pages_b.tolist())
    both.j = jpc.swap_in(both.j, loaded, slot=c, pages=alloc.pages(c))
    both.t = tpc.swap_in(both.t, host_t, slot=c, pages=alloc.pages(c))
    refs[c], refs[b] = refs[b], Reference(config)
    alloc.free(hold)
    _check_sequences(both, refs, alloc)

    # Fork a at its length (its partial page is copied raw), then both branches decode.
    length = len(refs[a].exit)
    jpc.check_fork(both.j, parent=a, child=b, num_tokens=length)
    child = alloc.fork(a, length)
    assert child == b
    both.j = jpc.fork(both.j, parent=a, child=child, num_tokens=length)
    both.t = tpc.fork(both.t, parent=a, child=child, num_tokens=length)
    refs[child] = Reference(config)
    for kind in ("key", "value"):
        refs[child].add(kind, list(refs[a].x[kind]), refs[a].exit)
    shared = [p for p in alloc.pages(child).tolist() if alloc.refcount(p) > 1]
    assert len(shared) == length // config.page_size
    before_shared = {p: np.asarray(both.j.k_base.codes)[p].copy() for p in shared}
    for _ in range(config.page_size + 1):  # past the shared pages: own pages only
        for slot in (a, child, c):
            alloc.reserve(slot, len(refs[slot].exit) + 1)
        k, v, ex = _tokens(rng, config, 3, exit_loops=[2, 1, 0])
        _append_tokens(both, refs, [a, child, c], k[:, :, None], v[:, :, None], ex[:, None],
                       alloc.block_tables())  # fmt: skip
    for p, codes in before_shared.items():  # a shared page is never written
        assert_same_bytes(np.asarray(both.j.k_base.codes)[p], codes, f"shared page {p}")
    _check_sequences(both, refs, alloc)


def test_fork_refuses_a_quantized_partial_page():
    config = make_config()
    both = Both(config)
    alloc = PageAllocator.for_config(config, MAX_PAGES)
    rng = np.random.default_rng(3)
    a = alloc.add_sequence(9)
    refs = {a: Reference(config)}
    k, v, ex = _tokens(rng, config, 9)
    _append_tokens(both, refs, [a], k[:, None], v[:, None], ex[None], alloc.block_tables())
    with pytest.raises(ValueError, match="already quantized"):
        jpc.check_fork(both.j, parent=a, child=1, num_tokens=6)
    with pytest.raises(ValueError, match="must lie in"):
        tpc.check_fork(both.t, parent=a, child=1, num_tokens=10)
    jpc.check_fork(both.j, parent=a, child=1, num_tokens=8)  # page-aligned: fine


# -- disk ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    config = make_config()
    both = Both(config)
    alloc = PageAllocator.for_config(config, MAX_PAGES)
    refs = {0: Reference(config)}
    slot = alloc.add_sequence(7)
    k, v, ex = _tokens(np.random.default_rng(5), config, 7)
    _append_tokens(both, refs, [slot], k[:, None], v[:, None], ex[None], alloc.block_tables())
    host = tpc.swap_out(both.t, slot=slot, pages=alloc.pages(slot))
    path = tmp_path_factory.mktemp("disk") / "seq.safetensors"
    save_sequence(path, host)
    return config, host, path


def test_saved_file_is_plain_safetensors(saved):
    import safetensors

    config, host, path = saved
    with safetensors.safe_open(path, "np") as f:
        meta = f.metadata()
        names = set(f.keys())
    assert names == set(host.arrays) and meta["format"] == "kvq.sequence/1"
    assert '"page_size": 4' in meta["config"] and len(meta["sha256"]) == 64
    loaded = load_sequence(path, config)
    for name, a in host.arrays.items():
        assert_same_bytes(loaded.arrays[name], a, name)


def _write(path, data):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "empty"])
def test_damaged_files_are_refused_before_anything_is_written(saved, tmp_path, damage):
    config, _, path = saved
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 5]
    elif damage == "flip_payload":
        data[-3] ^= 0x40
    elif damage == "flip_header":
        data[12] ^= 0x21
    else:
        data = b""
    bad = _write(tmp_path / "bad.safetensors", bytes(data))
    cache = jpc.init_cache(config)
    before = jax_leaves(cache)
    with pytest.raises(ValueError, match=r"truncated|corrupted|checksum|not a|header"):
        jpc.swap_in(cache, load_sequence(bad, config), slot=0, pages=np.arange(2))
    for a, b in zip(jax_leaves(cache), before, strict=True):
        assert_same_bytes(a, b)


def test_another_configuration_is_refused(saved):
    config, host, path = saved
    other = make_config(k_base_format="fp8_e4m3")
    with pytest.raises(ValueError, match=r"another cache configuration.*k_base_format"):
        load_sequence(path, other)
    cache = tpc.init_cache(other)
    with pytest.raises(ValueError, match="another configuration"):
        tpc.swap_in(cache, host, slot=0, pages=np.arange(2))
    with pytest.raises(ValueError, match="pages must be 2"):
        jpc.swap_in(jpc.init_cache(config), host, slot=0, pages=np.arange(3))
    with pytest.raises(ValueError, match="distinct"):
        jpc.swap_in(jpc.init_cache(config), host, slot=0, pages=np.array([1, 1]))
    with pytest.raises(ValueError, match="do not fit"):
        HostSequence(config=config, arrays={k: v for k, v in host.arrays.items() if k != "k_sink"})


# -- a random schedule --------------------------------------------------------------------------


def _check_batch(both, refs, alloc):
    """JAX and Torch hold the same bytes; every live sequence reads (`gather_batch`, one
    compiled call per loop) exactly its dense reference."""
    assert_stacks_equal(both.j, both.t)
    live = alloc.live_slots
    if not live:
        return
    tables = jnp.asarray(alloc.block_tables())
    lens = np.array([len(refs[s].exit) for s in live], np.int32)
    padded = np.zeros(both.config.max_seqs, np.int32)
    padded[: len(live)] = lens
    slots = np.zeros(both.config.max_seqs, np.int32)
    slots[: len(live)] = live
    for loop in range(both.config.num_loops):
        k, v = jpc.gather_batch(both.j, tables, jnp.asarray(padded), loop=loop,
                                seq_ids=jnp.asarray(slots))  # fmt: skip
        for i, slot in enumerate(live):
            n = int(lens[i])
            what = f"seq {slot} loop {loop}"
            assert_same_bytes(np.asarray(k[i, :n]), refs[slot].rows("key", loop, n), what)
            assert_same_bytes(np.asarray(v[i, :n]), refs[slot].rows("value", loop, n), what)


def test_random_schedule():
    """Sequences arrive (prefill), decode (tokens exit early at random), swap out and back in
    elsewhere, fork prefixes and finish in a seeded random order; after every step the two
    stacks hold the same bytes and every live sequence reads its dense reference."""
    config = make_config(num_pages=16)
    rng = np.random.default_rng(7)
    both = Both(config)
    alloc = PageAllocator.for_config(config, MAX_PAGES)
    refs: dict = {}
    swapped = []
    done = {"add": 0, "decode": 0, "swap_out": 0, "swap_in": 0, "fork": 0, "free": 0}
    for _ in range(26):
        live = alloc.live_slots
        ops = ["add", "decode", "decode", "swap_out", "swap_in", "fork", "free"]
        op = ops[rng.integers(len(ops))]
        try:
            if op == "add":
                n = int(rng.choice([3, 6]))
                slot = alloc.add_sequence(n)
                refs[slot] = Reference(config)
                k, v, ex = _tokens(rng, config, n, exit_loops=rng.integers(0, 3, n))
                _append_tokens(both, refs, [slot], k[:, None], v[:, None], ex[None],
                               alloc.block_tables())  # fmt: skip
            elif op == "decode" and live:
                group = sorted(rng.choice(live, rng.integers(1, len(live) + 1), replace=False))
                for slot in group:
                    alloc.reserve(int(slot), len(refs[slot].exit) + 1)
                k, v, ex = _tokens(
                    rng, config, len(group), exit_loops=rng.integers(0, 3, len(group))
                )
                _append_tokens(both, refs, [int(s) for s in group], k[:, :, None], v[:, :, None],
                               ex[:, None], alloc.block_tables())  # fmt: skip
            elif op == "swap_out" and live:
                slot = int(rng.choice(live))
                pages = alloc.pages(slot)
                host_j = jpc.swap_out(both.j, slot=slot, pages=pages)
                host_t = tpc.swap_out(both.t, slot=slot, pages=pages)
                swapped.append((host_j, host_t, refs.pop(slot)))
                alloc.free(slot)
                both.j = jpc.clear_slot(both.j, slot=slot)
                both.t = tpc.clear_slot(both.t, slot=slot)
            elif op == "swap_in" and swapped:
                host_j, host_t, ref = swapped[0]
                slot = alloc.add_sequence(len(ref.exit))
                swapped.pop(0)
                # Each stack takes the other's host copy: the bytes are the same.
                both.j = jpc.swap_in(both.j, host_t, slot=slot, pages=alloc.pages(slot))
                both.t = tpc.swap_in(both.t, host_j, slot=slot, pages=alloc.pages(slot))
                refs[slot] = ref
            elif op == "fork" and live:
                parent = int(rng.choice(live))
                length = len(refs[parent].exit)
                child = alloc.fork(parent, length)
                jpc.check_fork(both.j, parent=parent, child=child, num_tokens=length)
                both.j = jpc.fork(both.j, parent=parent, child=child, num_tokens=length)
                both.t = tpc.fork(both.t, parent=parent, child=child, num_tokens=length)
                refs[child] = Reference(config)
                for kind in ("key", "value"):
                    refs[child].add(kind, list(refs[parent].x[kind]), refs[parent].exit)
            elif op == "free" and live:
                slot = int(rng.choice(live))
                alloc.free(slot)
                both.j = jpc.clear_slot(both.j, slot=slot)
                both.t = tpc.clear_slot(both.t, slot=slot)
                refs.pop(slot)
            else:
                continue
        except ValueError as e:  # out of pages or slots: the allocator refused, nothing changed
            assert "out of pages" in str(e) or "no free sequence slot" in str(e), e
            continue
        done[op] += 1
        _check_batch(both, refs, alloc)
    assert all(done.values()), done  # the schedule exercised every operation
