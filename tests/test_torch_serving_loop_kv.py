"""Loop-KV sharing through `kvq_torch_bridge.serving` (docs/GUIDE.md "Torch serving"): one cache
per layer holds the shared plane (the last loop's K/V, or the mean over loops formed in
float32); loop l of a new token attends over the shared plane of the earlier tokens and its
own loop-l K/V (`paged_attention_prefill` with one query per sequence: its K/V raw, not
stored); after its last loop the token's shared row is written (`reshape_and_cache`). The
prompt's loops attend their own loop's K/V. Checked over prefill + decode steps that cross a
block edge against float64 attention over the shared rows decoded with the public codec
(pack_kv + unpack_kv per complete block, the open block raw), and the shared blocks' bytes
against pack_kv of the shared rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import serving_rows

import kvq_torch_bridge as kt
from kvq_torch_bridge.serving import allocate_kv_cache, paged_attention_prefill, reshape_and_cache

BS, H, D, HQ, LOOPS = 64, 2, 64, 4, 4


def shared_row(k_loops, mode):
    """The shared plane's row of K/V [LOOPS, n, H, D] bfloat16: loop LOOPS - 1, or the mean
    over loops as the JAX engine forms it (float32 sum in loop order / LOOPS, rounded to
    bfloat16, the cache's dtype)."""
    if mode == "last":
        return k_loops[-1]
    total = k_loops[0].float()
    for loop in range(1, LOOPS):
        total = total + k_loops[loop].float()
    return (total / LOOPS).to(torch.bfloat16)


def dense(q, k, v):
    """float64 softmax attention of q [n, Hq, D] (query j at the end) over k, v [T, H, D], causal
    over the last n rows (row T - n + j is query j's own)."""
    q, k, v = (np.asarray(x.double()) for x in (q, k, v))
    n, t = q.shape[0], k.shape[0]
    kk, vv = np.repeat(k, HQ // H, axis=1), np.repeat(v, HQ // H, axis=1)
    s = np.einsum("nhd,thd->nht", q, kk) / np.sqrt(D)
    s = np.where(np.arange(t)[None, None, :] <= (t - n + np.arange(n))[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("nht,thd->nhd", p / p.sum(-1, keepdims=True), vv)


@pytest.mark.parametrize("mode", ["last", "mean"])
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int4-g64", "nvfp4"])
def test_loop_kv_sharing_matches_a_dense_reference(kv_cache_dtype, mode):
    gen = torch.Generator().manual_seed(1)
    cache = allocate_kv_cache(kv_cache_dtype, 8, BS, H, D, max_num_seqs=2)
    tables = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32)
    prompt, steps = [60, 9], 8  # sequence 0 crosses its block edge at token 64
    shared_k = [torch.zeros(0, H, D, dtype=torch.bfloat16) for _ in prompt]
    shared_v = [torch.zeros(0, H, D, dtype=torch.bfloat16) for _ in prompt]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    def slots(seq, start, n):
        pos = torch.arange(start, start + n)
        return tables[seq, pos // BS].to(torch.int64) * BS + pos % BS

    # prefill: loop l of the prompt attends its own loop-l K/V (nothing cached yet)
    k_all = [randn(LOOPS, n, H, D) for n in prompt]
    v_all = [randn(LOOPS, n, H, D) for n in prompt]
    cu = torch.tensor([0, prompt[0], sum(prompt)])
    lens = torch.tensor(prompt)
    for loop in range(LOOPS):
        q = randn(sum(prompt), HQ, D)
        k = torch.cat([k_all[s][loop] for s in range(2)])
        v = torch.cat([v_all[s][loop] for s in range(2)])
        out = paged_attention_prefill(q, k, v, cache, cu, tables, lens)
        for s in range(2):
            a, b = int(cu[s]), int(cu[s + 1])
            want = dense(q[a:b], k_all[s][loop], v_all[s][loop])
            np.testing.assert_allclose(out[a:b].numpy(), want, rtol=2e-5, atol=2e-5)
    for s in range(2):  # the prompt's shared rows, once its loops are done
        shared_k[s] = shared_row(k_all[s], mode)
        shared_v[s] = shared_row(v_all[s], mode)
    reshape_and_cache(torch.cat(shared_k), torch.cat(shared_v), cache,
                      torch.cat([slots(s, 0, prompt[s]) for s in range(2)]))  # fmt: skip

    # decode: loop l attends the shared plane of the earlier tokens + its own loop-l K/V
    for _ in range(steps):
        ctx = torch.tensor([x.shape[0] for x in shared_k])
        k_loops, v_loops = randn(LOOPS, 2, H, D), randn(LOOPS, 2, H, D)
        for loop in range(LOOPS):
            q = randn(2, HQ, D)
            out = paged_attention_prefill(q, k_loops[loop], v_loops[loop], cache,
                                          torch.arange(3), tables, ctx + 1)  # fmt: skip
            for s in range(2):
                k = torch.cat([serving_rows(cache, shared_k[s], "key"), k_loops[loop, s : s + 1]])
                v = torch.cat([serving_rows(cache, shared_v[s], "value"), v_loops[loop, s : s + 1]])
                want = dense(q[s : s + 1], k, v)
                np.testing.assert_allclose(out[s : s + 1].numpy(), want, rtol=2e-5, atol=2e-5)
        row_k, row_v = shared_row(k_loops, mode), shared_row(v_loops, mode)
        reshape_and_cache(row_k, row_v, cache,
                          torch.cat([slots(s, int(ctx[s]), 1) for s in range(2)]))  # fmt: skip
        for s in range(2):
            shared_k[s] = torch.cat([shared_k[s], row_k[s : s + 1]])
            shared_v[s] = torch.cat([shared_v[s], row_v[s : s + 1]])

    # the complete block of sequence 0 holds the codec's bytes of its shared rows
    assert shared_k[0].shape[0] > BS
    if cache.config is not None:
        for kind, rows, pages in (("key", shared_k[0], cache.k_pages),
                                  ("value", shared_v[0], cache.v_pages)):  # fmt: skip
            want = kt.pack_kv(rows[:BS], **cache.config.pack_args(kind, "base"))
            for name, arr in want.arrays.items():
                got = pages.arrays[name][int(tables[0, 0])]
                assert torch.equal(got.reshape(-1).view(torch.uint8),
                                   arr.reshape(-1).view(torch.uint8)), (kind, name)  # fmt: skip
    else:
        assert torch.equal(cache.key_cache[int(tables[0, 0])], shared_k[0][:BS])
