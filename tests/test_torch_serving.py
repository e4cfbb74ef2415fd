"""kvq_torch_bridge.serving driven as vLLM drives a cache: per-layer allocation, writes by
slot mapping (-1 skipped, blocks in any order, many sequences per call), decode and chunked
prefill attention by block tables. Checked against independent references: each complete
block's bytes against the public codec (`kvq_torch_bridge.pack_kv` of that block's raw
rows), attention against float32 softmax attention written here over K/V rebuilt with the
public `unpack_kv`; bad input refused with the cache unchanged; a planted defect caught."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import serving_rows

import kvq_torch_bridge as kt
from kvq_torch_bridge.serving import (
    allocate_kv_cache,
    paged_attention_decode,
    paged_attention_prefill,
    read_blocks,
    reshape_and_cache,
)
from kvq_torch_bridge.serving import kv_cache as kvc

BS, H, D, HQ = 64, 2, 64, 4  # int4-g64 keys group 64 tokens: blocks of 64
FORMATS = ["int4-g64", "nvfp4", "kvq:fp8", "int4-g32"]


class Sim:
    """A tiny vLLM-style scheduler: random block allocation, slot mappings, the raw rows
    of every sequence kept aside as the reference."""

    def __init__(self, kv_cache_dtype, num_blocks=24, max_num_seqs=4, seed=0):
        self.cache = allocate_kv_cache(kv_cache_dtype, num_blocks, BS, H, D,
                                       max_num_seqs=max_num_seqs)  # fmt: skip
        self.gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}

    def slots(self, seq: int, count: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        start = sum(len(x) for x in self.k.get(seq, []))
        out = []
        for pos in range(start, start + count):
            if pos // BS >= len(table):
                table.append(self.free.pop())
            out.append(table[pos // BS] * BS + pos % BS)
        return out

    def write(self, counts: dict[int, int], pad: int = 0):
        """One call: `counts[seq]` new tokens per sequence, shuffled, plus `pad` -1 slots."""
        keys, values, slots = [], [], []
        for seq, count in counts.items():
            k = torch.randn(count, H, D, generator=self.gen).to(torch.bfloat16)
            v = torch.randn(count, H, D, generator=self.gen).to(torch.bfloat16)
            slots += self.slots(seq, count)
            self.k.setdefault(seq, []).append(k)
            self.v.setdefault(seq, []).append(v)
            keys.append(k)
            values.append(v)
        key, value = torch.cat(keys), torch.cat(values)
        slot = torch.tensor(slots, dtype=torch.int64)
        perm = torch.randperm(len(slots), generator=self.gen)
        key, value, slot = key[perm], value[perm], slot[perm]
        if pad:
            key = torch.cat([key, torch.randn(pad, H, D).to(torch.bfloat16)])
            value = torch.cat([value, torch.randn(pad, H, D).to(torch.bfloat16)])
            slot = torch.cat([slot, torch.full((pad,), -1, dtype=torch.int64)])
        reshape_and_cache(key, value, self.cache, slot)
        return key, value, slot

    def raw(self, seq):
        return torch.cat(self.k[seq]), torch.cat(self.v[seq])

    def tables_tensor(self, seqs):
        width = max(len(self.tables[s]) for s in seqs)
        rows = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32)


def expected_kv(sim: Sim, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's K / V as the cache should hold them: complete blocks through the public
    codec (pack_kv + unpack_kv of the block's raw rows), the open block raw."""
    k, v = sim.raw(seq)
    return serving_rows(sim.cache, k, "key"), serving_rows(sim.cache, v, "value")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def check_bytes(sim: Sim) -> None:
    """Every complete block's packed arrays equal pack_kv of its raw rows."""
    cfg = sim.cache.config
    for seq, table in sim.tables.items():
        for kind, raw, pages in (("key", sim.raw(seq)[0], sim.cache.k_pages),
                                 ("value", sim.raw(seq)[1], sim.cache.v_pages)):  # fmt: skip
            for i in range(raw.shape[0] // BS):
                want = kt.pack_kv(raw[i * BS : (i + 1) * BS], **cfg.pack_args(kind, "base"))
                for name, arr in want.arrays.items():
                    got = pages.arrays[name][table[i]]
                    assert torch.equal(as_bytes(got), as_bytes(arr)), (seq, kind, i, name)


def schedule(sim: Sim):
    """Chunked prefills of three sequences in shared calls, then decode steps."""
    sim.write({0: 150, 1: 64}, pad=3)
    sim.write({1: 20, 2: 130})
    sim.write({0: 41})
    for _ in range(12):
        sim.write({0: 1, 1: 1, 2: 1}, pad=1)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_blocks_hold_the_codecs_bytes(kv_cache_dtype):
    sim = Sim(kv_cache_dtype)
    ptrs = {n: t.data_ptr() for n, t in sim.cache.tensors().items()}
    schedule(sim)
    check_bytes(sim)
    # in place: no tensor of the cache was reallocated
    assert {n: t.data_ptr() for n, t in sim.cache.tensors().items()} == ptrs
    # the open blocks' rows are staged raw; staging is O(max_num_seqs), not O(num_blocks)
    assert sim.cache.k_stage.shape[0] == sim.cache.max_num_seqs + 1
    for seq in sim.tables:
        k, _ = sim.raw(seq)
        n = k.shape[0]
        if n % BS:
            block = sim.tables[seq][n // BS]
            row = int(sim.cache.block_stage[block])
            assert row >= 0
            assert torch.equal(sim.cache.k_stage[row, : n % BS], k[n - n % BS :])
    assert int(sim.cache.overflow) == 0


def test_planted_defect_is_caught(monkeypatch):
    """A cache whose whole-block path writes nothing fails the byte check."""
    monkeypatch.setattr(kvc, "_pack_whole", lambda *a, **k: None)
    sim = Sim("int4-g64")
    schedule(sim)
    with pytest.raises(AssertionError):
        check_bytes(sim)


def test_raw_cache_is_vllms_layout():
    sim = Sim("bfloat16")
    key, value, slot = sim.write({0: 20, 1: 3}, pad=2)
    kc = sim.cache.key_cache
    assert kc.shape == (24 + 1, BS, H, D) and kc.dtype == torch.bfloat16
    for i, s in enumerate(slot.tolist()):
        if s >= 0:
            assert torch.equal(kc[s // BS, s % BS], key[i])
            assert torch.equal(sim.cache.value_cache[s // BS, s % BS], value[i])


def reference_attention(q, k, v, scale):
    """float32 softmax attention of q [Hq, D] over k, v [T, H, D] (GQA)."""
    g = q.shape[0] // k.shape[1]
    kk = k.float().repeat_interleave(g, dim=1)  # [T, Hq, D]
    vv = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("hd,thd->ht", q.float(), kk) * scale
    return torch.einsum("ht,thd->hd", torch.softmax(s, dim=-1), vv)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int4-g64", "nvfp4"])
def test_decode_attention_against_a_dense_reference(kv_cache_dtype):
    sim = Sim(kv_cache_dtype)
    schedule(sim)
    seqs = [0, 1, 2]
    q = torch.randn(3, HQ, D, generator=sim.gen)
    lens = torch.tensor([sim.raw(s)[0].shape[0] for s in seqs], dtype=torch.int32)
    out = paged_attention_decode(q, sim.cache, sim.tables_tensor(seqs), lens)
    for i, s in enumerate(seqs):
        k, v = expected_kv(sim, s)
        want = reference_attention(q[i], k, v, D**-0.5)
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int4-g64"])
def test_chunked_prefill_attention_against_a_dense_reference(kv_cache_dtype):
    sim = Sim(kv_cache_dtype)
    sim.write({0: 100, 1: 7})  # cached context
    ctx = {0: 100, 1: 7}
    new = {0: 9, 1: 70}
    keys, values = [], []
    for seq, count in new.items():  # the new tokens, written first as vLLM does
        before = len(sim.k[seq])
        sim.write({seq: count})
        keys.append(sim.k[seq][before])
        values.append(sim.v[seq][before])
    key, value = torch.cat(keys), torch.cat(values)
    n = key.shape[0]
    q = torch.randn(n, HQ, D, generator=sim.gen)
    cu = torch.tensor([0, new[0], new[0] + new[1]], dtype=torch.int32)
    lens = torch.tensor([ctx[0] + new[0], ctx[1] + new[1]], dtype=torch.int32)
    out = paged_attention_prefill(q, key, value, sim.cache, cu, sim.tables_tensor([0, 1]), lens)
    for i, seq in enumerate([0, 1]):
        kc, vc = expected_kv(sim, seq)
        kc, vc = kc[: ctx[seq]], vc[: ctx[seq]]  # the context as the cache holds it
        for j in range(new[seq]):
            t = int(cu[i]) + j
            k = torch.cat([kc, key[int(cu[i]) : t + 1]])
            v = torch.cat([vc, value[int(cu[i]) : t + 1]])
            want = reference_attention(q[t], k, v, D**-0.5)
            torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)


def snapshot(cache):
    return {n: t.clone() for n, t in cache.tensors().items()}


def assert_unchanged(cache, before):
    for n, t in cache.tensors().items():
        assert torch.equal(
            t.reshape(-1).view(torch.uint8), before[n].reshape(-1).view(torch.uint8)
        ), n


def test_bad_input_is_refused_with_the_cache_unchanged():
    sim = Sim("int4-g64", max_num_seqs=2)
    sim.write({0: 20})
    before = snapshot(sim.cache)
    k = torch.randn(2, H, D).to(torch.bfloat16)
    with pytest.raises(ValueError, match="slot_mapping holds slot 1536"):
        reshape_and_cache(k, k, sim.cache, torch.tensor([3, 24 * BS]))
    with pytest.raises(ValueError, match="slot_mapping writes a slot twice"):
        reshape_and_cache(k, k, sim.cache, torch.tensor([40, 40]))
    with pytest.raises(ValueError, match="key must be"):
        reshape_and_cache(k[:, :1], k, sim.cache, torch.tensor([40, 41]))
    with pytest.raises(ValueError, match="slot_mapping has 1 entries"):
        reshape_and_cache(k, k, sim.cache, torch.tensor([40]))
    with pytest.raises(TypeError, match="cache must be"):
        reshape_and_cache(k, k, object(), torch.tensor([40, 41]))
    # three blocks opened at once with two staging rows
    k3 = torch.randn(3, H, D).to(torch.bfloat16)
    free = sim.free[-3:]
    with pytest.raises(ValueError, match="max_num_seqs"):
        reshape_and_cache(k3, k3, sim.cache, torch.tensor([b * BS for b in free]))
    assert_unchanged(sim.cache, before)
    q = torch.randn(1, HQ, D)
    with pytest.raises(ValueError, match="block_tables points outside"):
        paged_attention_decode(q, sim.cache, torch.tensor([[99, 0]]), torch.tensor([20]))
    with pytest.raises(ValueError, match="seq_lens must lie"):
        paged_attention_decode(q, sim.cache, sim.tables_tensor([0]), torch.tensor([BS + 1]))
    with pytest.raises(ValueError, match="query must be"):
        paged_attention_decode(q[:, :3], sim.cache, sim.tables_tensor([0]), torch.tensor([20]))


def test_kv_cache_dtype_names():
    assert kvc.policy_for_kv_cache_dtype("bfloat16") is None
    assert kvc.policy_for_kv_cache_dtype("int4").name == "int4-g64"
    assert kvc.policy_for_kv_cache_dtype("kvq:fp8").name == "fp8"
    assert kvc.policy_for_kv_cache_dtype("kvq:int4-g64").name == "int4-g64"
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{name}' is refused"):
            allocate_kv_cache(name, 4, BS, H, D)
    with pytest.raises(ValueError, match="raw window rows"):
        allocate_kv_cache("int4-g64+win", 4, BS, H, D)
    with pytest.raises(ValueError, match=r"not served.*known: "):
        allocate_kv_cache("int5", 4, BS, H, D)
    pre_rope = allocate_kv_cache("intb-prerope-hint4-heavy-smollm2", 4, 64, 3, 64, layer=0)
    rows = torch.zeros(2, 3, 64)
    with pytest.raises(ValueError, match=r"positions: .* stores keys before RoPE"):
        reshape_and_cache(rows, rows, pre_rope, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"positions must be \[2\]"):
        reshape_and_cache(rows, rows, pre_rope, torch.tensor([0, 1]), torch.tensor([0]))
    assert int(pre_rope.block_start.abs().sum()) == 0  # nothing written by a refused call
    base = allocate_kv_cache("kvq:intb-hint4-heavy-smollm2", 4, 64, 3, 64, layer=0)
    with pytest.raises(ValueError, match=r"previous: .* stores its later loops whole"):
        allocate_kv_cache("kvq:intb-hint4-heavy-smollm2", 4, 64, 3, 64, layer=0, previous=base)
    with pytest.raises(ValueError, match="num_blocks must be"):
        allocate_kv_cache("int4", 0, BS, H, D)
    with pytest.raises(ValueError, match="block_size 12"):  # token groups must divide a block
        allocate_kv_cache("int4-g64", 4, 12, H, D)


def test_storage_is_a_fraction_of_bf16():
    raw = allocate_kv_cache("bfloat16", 64, BS, H, D, max_num_seqs=2)
    q = allocate_kv_cache("int4-g64", 64, BS, H, D, max_num_seqs=2)
    pages = sum(a.numel() * a.element_size() for n, a in q.tensors().items() if "pages" in n)
    ratio = pages / (raw.key_cache.numel() * 2 * 2)
    assert 0.25 < ratio < 0.32, ratio  # 4.5 bits of 16 for K and V


def test_imports_no_jax():
    code = (
        "import sys, torch\n"
        "from kvq_torch_bridge.serving import allocate_kv_cache, reshape_and_cache\n"
        "c = allocate_kv_cache('nvfp4', 4, 16, 2, 64, max_num_seqs=2)\n"
        "k = torch.randn(16, 2, 64).to(torch.bfloat16)\n"
        "reshape_and_cache(k, k, c, torch.arange(16) + 16)\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kv_cache_dtype", ["int4-g64", "nvfp4"])
def test_completing_a_block_frees_its_staging_row_for_the_next(kv_cache_dtype):
    """One staging row per sequence is enough: a call that completes a sequence's open block
    and opens its next one reuses the row (max_num_seqs = the sequences)."""
    sim = Sim(kv_cache_dtype, max_num_seqs=2)
    sim.write({0: 20, 1: 5})
    sim.write({0: 50, 1: 100})  # both complete block 0 and open block 1
    sim.write({0: 70, 1: 1})  # sequence 0 completes block 1 and opens block 2
    check_bytes(sim)
    assert int(sim.cache.overflow) == 0
    for seq in (0, 1):
        k, v = expected_kv(sim, seq)
        got_k, got_v = read_blocks(sim.cache, sim.tables_tensor([seq]))
        torch.testing.assert_close(got_k[0, : k.shape[0]], k, rtol=0, atol=0)
        torch.testing.assert_close(got_v[0, : v.shape[0]], v, rtol=0, atol=0)
