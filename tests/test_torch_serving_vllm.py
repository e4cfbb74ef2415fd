"""kvq_torch_bridge.serving driven by a minimal vLLM-v1-style attention layer built here:
`forward(query, key, value, kv_cache, attn_metadata)` with slot_mapping, block_tables,
seq_lens and query_start_loc, over batches that mix prefill chunks and decode tokens with
padded (-1) slots, several steps. Outputs against dense float32 attention over the decoded K/V
(public Torch codec), cache bytes against kvq_jax's paged cache fed the same tokens."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import serving_rows

from kvq_jax.cache import paged_cache as jax_cache
from kvq_jax.core.policies import cache_config_for
from kvq_torch_bridge.serving import (
    allocate_kv_cache,
    paged_attention_decode,
    paged_attention_prefill,
    policy_for_kv_cache_dtype,
    reshape_and_cache,
)

BS, H, D, HQ, NUM_BLOCKS, SEQS = 64, 2, 64, 4, 16, 3


@dataclasses.dataclass
class AttnMetadata:
    """What a vLLM v1 attention backend receives per step."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs], with this step's tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]


class Attention:
    """The layer: write this step's K/V by slot, then attend by block tables."""

    def forward(self, query, key, value, kv_cache, m: AttnMetadata):
        n = m.query_start_loc[-1]
        reshape_and_cache(key, value, kv_cache, m.slot_mapping)
        return paged_attention_prefill(query[:n], key[:n], value[:n], kv_cache,
                                       m.query_start_loc, m.block_tables, m.seq_lens)  # fmt: skip


def schedule():
    """Per step: {seq: new tokens}; prefill chunks and decode tokens mixed."""
    return [{0: 70, 1: 20}, {0: 1, 1: 50, 2: 64}, {0: 1, 1: 1, 2: 30}] + [{0: 1, 1: 1, 2: 1}] * 6


def run(kv_cache_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = allocate_kv_cache(kv_cache_dtype, NUM_BLOCKS, BS, H, D, max_num_seqs=SEQS)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = {s: [] for s in range(SEQS)}
    lens = dict.fromkeys(range(SEQS), 0)
    raw = {s: ([], []) for s in range(SEQS)}
    layer = Attention()
    steps = []
    for counts in schedule():
        seqs = sorted(counts)
        q, k, v, slots, starts = [], [], [], [], [0]
        for s in seqs:
            n = counts[s]
            for pos in range(lens[s], lens[s] + n):
                if pos // BS >= len(tables[s]):
                    tables[s].append(free.pop())
                slots.append(tables[s][pos // BS] * BS + pos % BS)
            k.append(torch.randn(n, H, D, generator=gen).to(torch.bfloat16))
            v.append(torch.randn(n, H, D, generator=gen).to(torch.bfloat16))
            q.append(torch.randn(n, HQ, D, generator=gen))
            raw[s][0].append(k[-1])
            raw[s][1].append(v[-1])
            lens[s] += n
            starts.append(starts[-1] + n)
        pad = 3  # padded tokens at the end, as a CUDA-graph batch has
        key = torch.cat([*k, torch.zeros(pad, H, D, dtype=torch.bfloat16)])
        value = torch.cat([*v, torch.zeros(pad, H, D, dtype=torch.bfloat16)])
        query = torch.cat([*q, torch.zeros(pad, HQ, D)])
        width = max(len(tables[s]) for s in seqs)
        meta = AttnMetadata(
            slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
            block_tables=torch.tensor([tables[s] + [0] * (width - len(tables[s])) for s in seqs],
                                      dtype=torch.int32),
            seq_lens=torch.tensor([lens[s] for s in seqs], dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
        )  # fmt: skip
        out = layer.forward(query, key, value, cache, meta)
        steps.append((dict(counts), {s: lens[s] for s in seqs}, query, out))
    return cache, tables, raw, steps


def attention(q, k, v):
    g = q.shape[0] // k.shape[1]
    s = torch.einsum("hd,thd->ht", q.float(), k.float().repeat_interleave(g, 1)) * D**-0.5
    return torch.einsum("ht,thd->hd", torch.softmax(s, -1), v.float().repeat_interleave(g, 1))


FORMATS = ["bfloat16", "int4", "nvfp4", "kvq:fp8"]


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_mixed_batches_against_dense_attention(kv_cache_dtype):
    cache, _, raw, steps = run(kv_cache_dtype)
    k_all = {s: torch.cat(raw[s][0]) for s in raw}
    v_all = {s: torch.cat(raw[s][1]) for s in raw}
    for counts, lens, query, out in steps:
        row = 0
        for s in sorted(counts):
            n, total = counts[s], lens[s]
            ctx = total - n
            # the context as the cache holds it now (complete blocks quantized), then the
            # step's own tokens raw
            k_ctx = serving_rows(cache, k_all[s][:total], "key")[:ctx]
            v_ctx = serving_rows(cache, v_all[s][:total], "value")[:ctx]
            for j in range(n):
                k = torch.cat([k_ctx, k_all[s][ctx : ctx + j + 1]])
                v = torch.cat([v_ctx, v_all[s][ctx : ctx + j + 1]])
                torch.testing.assert_close(out[row + j], attention(query[row + j], k, v),
                                           rtol=1e-5, atol=1e-5)  # fmt: skip
            row += n


@pytest.mark.parametrize("kv_cache_dtype", ["int4", "nvfp4", "kvq:fp8"])
def test_pages_equal_kvq_jax_paged_cache(kv_cache_dtype):
    """The same tokens appended to kvq_jax's paged cache (per sequence, by its block table):
    every complete block's arrays are the same bytes."""
    cache, tables, raw, _ = run(kv_cache_dtype)
    policy = policy_for_kv_cache_dtype(kv_cache_dtype)
    config = cache_config_for(policy, num_pages=NUM_BLOCKS, page_size=BS, num_heads=H,
                              head_dim=D, dtype="bfloat16", num_loops=1, max_seqs=SEQS)  # fmt: skip
    jc = jax_cache.init_cache(config)
    width = NUM_BLOCKS
    bt = np.zeros((SEQS, width), np.int32)
    for s, t in tables.items():
        bt[s, : len(t)] = t
    for s in range(SEQS):
        for kc, vc in zip(*raw[s], strict=True):  # the same chunks, in order
            k = jnp.asarray(kc.float().numpy(), jnp.bfloat16)[None]
            v = jnp.asarray(vc.float().numpy(), jnp.bfloat16)[None]
            jc = jax_cache.append(jc, k, v, block_tables=jnp.asarray(bt),
                                  seq_ids=jnp.asarray([s], jnp.int32), loop=0)  # fmt: skip
    checked = 0
    for s, t in tables.items():
        complete = sum(x.shape[0] for x in raw[s][0]) // BS
        for i in range(complete):
            for mine, theirs in ((cache.k_pages, jc.k_base), (cache.v_pages, jc.v_base)):
                for name, arr in mine.arrays.items():
                    want = np.asarray(theirs.arrays[name][t[i]]).reshape(-1).view(np.uint8)
                    got = arr[t[i]].reshape(-1).view(torch.uint8).numpy()
                    assert np.array_equal(got, want), (s, i, name)
            checked += 1
    assert checked == 3  # one complete block per sequence in this schedule


def assert_blocks_equal_kvq_jax(cache, config, k, v, table, cuts):
    """Feed kvq_jax's paged cache (`config`, one sequence on block table `table`) the chunks
    [cuts[i], cuts[i + 1]) of k, v [T, H, D] that `cache` was fed: every complete block of
    `cache` holds the same arrays with the same bytes."""
    jc = jax_cache.init_cache(config)
    bt = jnp.asarray(np.asarray([table + [0] * (config.num_pages - len(table))], np.int32))
    for a, b in itertools.pairwise(cuts):
        jc = jax_cache.append(jc, jnp.asarray(k[a:b].float().numpy(), config.dtype)[None],
                              jnp.asarray(v[a:b].float().numpy(), config.dtype)[None],
                              block_tables=bt, seq_ids=jnp.asarray([0], jnp.int32),
                              loop=0)  # fmt: skip
    for block in table[: cuts[-1] // BS]:
        for mine, theirs in ((cache.k_pages, jc.k_base), (cache.v_pages, jc.v_base)):
            assert set(mine.arrays) == set(theirs.arrays)
            for name, arr in mine.arrays.items():
                want = np.asarray(theirs.arrays[name][block]).reshape(-1).view(np.uint8)
                got = arr[block].reshape(-1).view(torch.uint8).numpy()
                assert np.array_equal(got, want), (block, name)


@pytest.mark.parametrize("layer", [2, 15])
def test_calibrated_policy_per_layer_equals_kvq_jax(layer):
    """kv_cache_dtype "kvq:intb-hint4-smollm2" (keys INTB with SmolLM2's table of the given
    model layer, values HINT4), SmolLM2's head shape: one cache per layer, its complete blocks
    the bytes of kvq_jax's paged cache under that layer's policy (the engine's)."""
    from kvq_jax.codecs.formats.intb import register_table as jax_register
    from kvq_jax.core.calibration import get_key_tables
    from kvq_jax.core.policies import POLICIES, per_layer_policies

    h, d, blocks = 3, 64, 6
    gen = torch.Generator().manual_seed(layer)
    cache = allocate_kv_cache("kvq:intb-hint4-smollm2", blocks, BS, h, d, max_num_seqs=2,
                              layer=layer)  # fmt: skip
    policy = POLICIES["intb-hint4-smollm2"]
    (jax_policy,) = per_layer_policies(policy, get_key_tables(policy.key_tables), [layer],
                                       jax_register)  # fmt: skip
    assert cache.policy == jax_policy  # the same formats, registered in each stack
    k = torch.randn(150, h, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(150, h, d, generator=gen).to(torch.bfloat16)
    table = [4, 1, 3]
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(150)])
    reshape_and_cache(k[:70], v[:70], cache, slots[:70])  # block 4 whole, block 1 staged
    reshape_and_cache(k[70:], v[70:], cache, slots[70:])  # block 1 completes, block 3 staged
    config = cache_config_for(jax_policy, num_pages=blocks, page_size=BS, num_heads=h,
                              head_dim=d, dtype="bfloat16", num_loops=1, max_seqs=1)  # fmt: skip
    assert_blocks_equal_kvq_jax(cache, config, k, v, table, (0, 70, 150))
    # decode attention reads what it stored: the dense reference over the decoded blocks
    q = torch.randn(1, 9, d, generator=gen)
    out = paged_attention_decode(q, cache, torch.tensor([table]), torch.tensor([150]))
    kk, vv = serving_rows(cache, k, "key"), serving_rows(cache, v, "value")
    torch.testing.assert_close(out[0], attention(q[0], kk, vv), rtol=1e-5, atol=1e-5)


HEAVY_CASES = [
    ("intb-hint4-heavy-smollm2", torch.bfloat16),
    pytest.param("intb-hint4-heavy-smollm2", torch.float32, marks=pytest.mark.slow),
    ("intb-prerope-hint4-heavy-smollm2", torch.bfloat16),
    pytest.param("intb-prerope-hint4-heavy-smollm2", torch.float32, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,dtype", HEAVY_CASES, ids=str)
def test_heavy_row_policy_equals_kvq_jax(name, dtype):
    """kv_cache_dtype "kvq:<name>" at SmolLM2's layer 7 (keys INTB with a heavy INT8 row per
    64 tokens chosen by the layer's mean-query table, values HINT4 taking the keys' rows; the
    prerope policy stores the keys with RoPE taken off at the positions passed): the formats
    are the ones kvq_jax's engine registers for that layer, the complete blocks the bytes of
    kvq_jax's paged cache fed the same tokens, and decode attention the dense reference over
    blocks decoded by the public functions (`select_heavy` on the keys as written,
    `pack_heavy` / `unpack_heavy`, and RoPE off and back on with `rope_tables`' numbers)."""
    import kvq_torch_bridge as kt
    from kvq_jax.codecs.formats.heavy_rows import register_heavy as jax_heavy
    from kvq_jax.codecs.formats.intb import register_table as jax_register
    from kvq_jax.core.calibration import get_key_tables
    from kvq_jax.core.policies import POLICIES, per_layer_policies
    from kvq_jax.core.rope import rope_tables
    from kvq_torch_bridge.codecs.rope import apply_rope, invert_rope

    layer, h, d, blocks, t = 7, 3, 64, 6, 150
    gen = torch.Generator().manual_seed(layer)
    cache = allocate_kv_cache("kvq:" + name, blocks, BS, h, d, dtype=dtype, max_num_seqs=2,
                              layer=layer)  # fmt: skip
    policy = POLICIES[name]
    tables = get_key_tables(policy.key_tables)
    (layer_policy,) = per_layer_policies(policy, tables, [layer], jax_register)
    key_base, value_base = layer_policy.base_format, policy.formats("value")[0]  # INTB, HINT4
    queries = np.asarray(tables.heavy_table(policy.name, layer))
    jax_policy = layer_policy.with_heavy_formats(
        jax_heavy(key_base, policy.heavy, queries),
        jax_heavy(value_base, policy.heavy), num_loops=1, rope_theta=tables.rope_theta,
    )  # fmt: skip
    config = cache_config_for(jax_policy, num_pages=blocks, page_size=BS, num_heads=h,
                              head_dim=d, dtype=np.dtype(str(dtype).removeprefix("torch.")),
                              num_loops=1, max_seqs=1)  # fmt: skip
    assert (cache.config.k_base_format, cache.config.v_base_format, cache.config.rope_theta) == (
        config.k_base_format, config.v_base_format, config.rope_theta)  # fmt: skip
    assert (config.rope_theta is not None) == policy.pre_rope
    k = (torch.randn(t, h, d, generator=gen) * torch.linspace(0.2, 3, d)).to(dtype)
    v = torch.randn(t, h, d, generator=gen).to(dtype)
    table = [4, 1, 3]
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(t)])
    positions = torch.arange(t)
    for a, b in ((0, 70), (70, t)):  # block 4 whole, block 1 staged; block 1 completes
        reshape_and_cache(k[a:b], v[a:b], cache, slots[a:b], positions[a:b])
    assert_blocks_equal_kvq_jax(cache, config, k, v, table, (0, 70, t))
    # the dense reference: each complete block through the public functions
    mq = torch.from_numpy(queries.view(np.int16)).view(torch.bfloat16)
    cos, sin = (torch.from_numpy(x) for x in rope_tables(t, d, tables.rope_theta or 1.0))
    kk, vv = [], []
    for start in range(0, t, BS):
        kb, vb = k[start : start + BS], v[start : start + BS]
        if kb.shape[0] == BS:
            rows = kt.select_heavy(kb, mq, group_size=64)  # from the keys as written
            turn = (cos[start : start + BS], sin[start : start + BS])
            if policy.pre_rope:
                kb = invert_rope(kb, *turn).to(dtype)
            kb = kt.unpack_heavy(kt.pack_heavy(kb, rows, kind="key", format=key_base))
            if policy.pre_rope:
                kb = apply_rope(kb, *turn).to(dtype)
            vb = kt.unpack_heavy(kt.pack_heavy(vb, rows, kind="value", format=value_base))
        kk.append(kb)
        vv.append(vb)
    q = torch.randn(1, 9, d, generator=gen)
    out = paged_attention_decode(q, cache, torch.tensor([table]), torch.tensor([t]))
    want = attention(q[0], torch.cat(kk).float(), torch.cat(vv).float())
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.xfail(strict=True, reason="a planted defect must be caught")
def test_heavy_comparison_catches_values_with_other_rows(monkeypatch):
    """The byte check can fail: value blocks packed with rows other than their keys' (each
    moved down one token) differ from kvq_jax's."""
    from kvq_torch_bridge.serving import kv_cache

    pack = kv_cache.pack_paged

    def other_rows(pages, rows=None, **kw):
        return pack(pages, rows=None if rows is None else (rows + 1) % 64, **kw)

    monkeypatch.setattr(kv_cache, "pack_paged", other_rows)
    test_heavy_row_policy_equals_kvq_jax("intb-hint4-heavy-smollm2", torch.bfloat16)


@pytest.mark.xfail(strict=True, reason="a planted defect must be caught")
def test_prerope_comparison_catches_rope_one_position_late(monkeypatch):
    """The byte check can fail: RoPE taken off one position late (a planted defect in the
    serving cache's tables) changes the stored keys."""
    from kvq_torch_bridge.serving import kv_cache

    rope_at = kv_cache.rope_at
    monkeypatch.setattr(kv_cache, "rope_at", lambda pos, d, theta: rope_at(pos + 1, d, theta))
    test_heavy_row_policy_equals_kvq_jax("intb-prerope-hint4-heavy-smollm2", torch.bfloat16)


def test_calibrated_policy_needs_its_layer():
    with pytest.raises(ValueError, match="layer: policy 'intb-hint4-smollm2' has per-layer"):
        allocate_kv_cache("kvq:intb-hint4-smollm2", 4, BS, 3, 64)
    with pytest.raises(ValueError, match="no key table for layer 30"):
        allocate_kv_cache("kvq:intb-hint4-smollm2", 4, BS, 3, 64, layer=30)
    with pytest.raises(ValueError, match=r"is for \(3, 64\)"):
        allocate_kv_cache("kvq:intb-hint4-smollm2", 4, BS, 2, 64, layer=3)
    base = allocate_kv_cache("kvq:intb-hint4-smollm2", 4, BS, 3, 64, layer=3)
    with pytest.raises(ValueError, match="the loop before must be the same"):
        allocate_kv_cache("kvq:intb-hint4-smollm2", 4, BS, 3, 64, layer=4, previous=base)
