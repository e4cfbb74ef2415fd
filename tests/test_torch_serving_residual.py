"""Cross-loop residual pages through `kvq_torch_bridge.serving`: one cache per (loop, layer),
loop l allocated with `previous=` loop l - 1's cache, driven as a looped model's forward
drives it (each step: loop 0's write and attention, then loop 1's, ...), prefill chunks and
decode tokens mixed, padded slots. Checked against two independent things: kvq_jax's paged
cache with num_loops loops fed the same chunks (every complete block's arrays, every loop,
the same bytes), and attention over each loop's K/V rebuilt with the public Torch codec
(`pack_kv` / `unpack_kv` for loop 0, `encode_residual` / `decode_residual` against the
rebuilt loop before for loop l, the open block raw)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvq_torch_bridge as kt
from kvq_jax.cache import paged_cache as jax_cache
from kvq_jax.core.policies import cache_config_for
from kvq_torch_bridge.serving import (
    allocate_kv_cache,
    paged_attention_prefill,
    policy_for_kv_cache_dtype,
    reshape_and_cache,
)

BS, H, D, HQ, NUM_BLOCKS, SEQS, LOOPS = 64, 2, 64, 4, 12, 2, 3
SCHEDULE = [{0: 70, 1: 20}, {0: 1, 1: 50}] + [{0: 1, 1: 1}] * 3  # sequence 1 completes block 0


def run(kv_cache_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(LOOPS):
        caches.append(allocate_kv_cache(kv_cache_dtype, NUM_BLOCKS, BS, H, D, max_num_seqs=SEQS,
                                        previous=caches[-1] if caches else None))  # fmt: skip
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = {s: [] for s in range(SEQS)}
    lens = dict.fromkeys(range(SEQS), 0)
    raw = {(s, loop): ([], []) for s in range(SEQS) for loop in range(LOOPS)}
    outputs = []
    for counts in SCHEDULE:
        seqs = sorted(counts)
        slots, starts = [], [0]
        for s in seqs:
            for pos in range(lens[s], lens[s] + counts[s]):
                if pos // BS >= len(tables[s]):
                    tables[s].append(free.pop())
                slots.append(tables[s][pos // BS] * BS + pos % BS)
            lens[s] += counts[s]
            starts.append(starts[-1] + counts[s])
        n, pad = starts[-1], 2
        width = max(len(tables[s]) for s in seqs)
        block_tables = torch.tensor([tables[s] + [0] * (width - len(tables[s])) for s in seqs],
                                    dtype=torch.int32)  # fmt: skip
        slot_mapping = torch.tensor(slots + [-1] * pad, dtype=torch.int64)
        cu = torch.tensor(starts, dtype=torch.int32)
        seq_lens = torch.tensor([lens[s] for s in seqs], dtype=torch.int32)
        k = torch.randn(n + pad, H, D, generator=gen)
        v = torch.randn(n + pad, H, D, generator=gen)
        for loop, cache in enumerate(caches):  # trained loops move a little: K_l = K_l-1 + e
            if loop:
                k = k + 0.2 * torch.randn(n + pad, H, D, generator=gen)
                v = v + 0.2 * torch.randn(n + pad, H, D, generator=gen)
            kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
            for i, s in enumerate(seqs):
                raw[s, loop][0].append(kb[starts[i] : starts[i + 1]])
                raw[s, loop][1].append(vb[starts[i] : starts[i + 1]])
            q = torch.randn(n, HQ, D, generator=gen)
            reshape_and_cache(kb, vb, cache, slot_mapping)
            out = paged_attention_prefill(q, kb[:n], vb[:n], cache, cu, block_tables, seq_lens)
            outputs.append((loop, dict(counts), dict(lens), q, out))
    return caches, tables, raw, outputs


def rebuilt(cache, rows_by_loop, kind):
    """Each loop's rows [T, H, D] as the caches should hold them (public codec)."""
    out, previous = [], None
    for loop, rows in enumerate(rows_by_loop):
        parts, recon = [], []
        for start in range(0, rows.shape[0], BS):
            page = rows[start : start + BS]
            if page.shape[0] < BS:
                parts.append(page)  # the open block: raw
                continue
            if loop == 0:
                r = kt.unpack_kv(kt.pack_kv(page, **cache.config.pack_args(kind, "base")))
            else:
                prev = previous[start : start + BS]
                res = kt.encode_residual(page, prev, **cache.config.pack_args(kind, "residual"))
                r = kt.decode_residual(res, prev)
            parts.append(r.to(torch.bfloat16))
            recon.append(r.to(torch.bfloat16))
        out.append(torch.cat(parts))
        previous = torch.cat(recon) if recon else None
    return out


def dense(q, k, v):
    g = q.shape[0] // k.shape[1]
    s = torch.einsum("hd,thd->ht", q.float(), k.float().repeat_interleave(g, 1)) * D**-0.5
    return torch.einsum("ht,thd->hd", torch.softmax(s, -1), v.float().repeat_interleave(g, 1))


#: INT4 and kvq:fp8 run with --run-slow (NVFP4 takes the same paths and its global scale; CI time)
@pytest.mark.parametrize(
    "kv_cache_dtype",
    [pytest.param(f, marks=pytest.mark.slow) for f in ("int4", "kvq:fp8")] + ["nvfp4"],
)
def test_residual_loops_against_the_codec_and_kvq_jax(kv_cache_dtype):
    caches, tables, raw, outputs = run(kv_cache_dtype)
    assert [c.loop for c in caches] == [0, 1, 2] and caches[1].role == "residual"
    cat = {key: (torch.cat(a), torch.cat(b)) for key, (a, b) in raw.items()}

    # attention of every loop at every step over its own loop's rebuilt context
    for loop, counts, lens, q, out in outputs:
        row = 0
        for s in sorted(counts):
            n, total = counts[s], lens[s]
            ctx = total - n
            k_loops = rebuilt(caches[0], [cat[s, lp][0][:total] for lp in range(LOOPS)], "key")
            v_loops = rebuilt(caches[0], [cat[s, lp][1][:total] for lp in range(LOOPS)], "value")
            k_ctx, v_ctx = k_loops[loop][:ctx], v_loops[loop][:ctx]
            for j in range(n):
                k = torch.cat([k_ctx, cat[s, loop][0][ctx : ctx + j + 1]])
                v = torch.cat([v_ctx, cat[s, loop][1][ctx : ctx + j + 1]])
                torch.testing.assert_close(out[row + j], dense(q[row + j], k, v),
                                           rtol=1e-5, atol=1e-5)  # fmt: skip
            row += n

    # every loop's complete blocks: the bytes of kvq_jax's paged cache fed the same chunks
    policy = policy_for_kv_cache_dtype(kv_cache_dtype)
    config = cache_config_for(policy, num_pages=NUM_BLOCKS, page_size=BS, num_heads=H,
                              head_dim=D, dtype="bfloat16", num_loops=LOOPS,
                              max_seqs=SEQS)  # fmt: skip
    jc = jax_cache.init_cache(config)
    bt = np.zeros((SEQS, NUM_BLOCKS), np.int32)
    for s, t in tables.items():
        bt[s, : len(t)] = t
    for s in range(SEQS):
        for chunk in range(len(raw[s, 0][0])):
            for loop in range(LOOPS):
                k, v = (jnp.asarray(x[chunk].float().numpy(), jnp.bfloat16)[None]
                        for x in raw[s, loop])  # fmt: skip
                jc = jax_cache.append(jc, k, v, block_tables=jnp.asarray(bt),
                                      seq_ids=jnp.asarray([s], jnp.int32), loop=loop)  # fmt: skip
    checked = 0
    for s, t in tables.items():
        for i in range(cat[s, 0][0].shape[0] // BS):
            for loop, cache in enumerate(caches):
                for mine, theirs in ((cache.k_pages, "k"), (cache.v_pages, "v")):
                    want = getattr(jc, f"{theirs}_base" if loop == 0 else f"{theirs}_delta")
                    for name, arr in mine.arrays.items():
                        w = want.arrays[name] if loop == 0 else want.arrays[name][loop - 1]
                        w = np.asarray(w[t[i]]).reshape(-1).view(np.uint8)
                        got = arr[t[i]].reshape(-1).view(torch.uint8).numpy()
                        assert np.array_equal(got, w), (s, i, loop, name)
                checked += 1
    assert checked == 2 * LOOPS  # one complete block per sequence, every loop


def test_previous_is_checked():
    base = allocate_kv_cache("int4", NUM_BLOCKS, BS, H, D, max_num_seqs=SEQS)
    with pytest.raises(ValueError, match="previous: the loop before must be the same"):
        allocate_kv_cache("nvfp4", NUM_BLOCKS, BS, H, D, max_num_seqs=SEQS, previous=base)
    with pytest.raises(ValueError, match=r"previous: .*raw rows"):
        allocate_kv_cache("bfloat16", NUM_BLOCKS, BS, H, D, previous=base)
    with pytest.raises(TypeError, match="previous must be a ServingKVCache"):
        allocate_kv_cache("int4", NUM_BLOCKS, BS, H, D, previous="loop 0")
    one = allocate_kv_cache("int4", NUM_BLOCKS, BS, H, D, max_num_seqs=SEQS, previous=base)
    assert not set(map(id, one.tensors().values())) & set(map(id, base.tensors().values()))
