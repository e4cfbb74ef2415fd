"""torch.compile(fullgraph=True) of the serving cache's write and decode attention: one graph
each (a graph break is an error under fullgraph), and the same cache bytes and attention
outputs as eager on a schedule of mixed prefill chunks, padded (-1) slots, blocks in random
order and decode steps that complete blocks. The reference is the eager run of the same
public calls (itself checked against the codecs and a dense attention in
tests/test_torch_serving.py).

The default runs use the `aot_eager` backend (Dynamo's full capture and AOT autograd's
decomposition, run eagerly: every byte is comparable, and it compiles in seconds); the
`--run-slow` case compiles with Inductor (C++ on the CPU): the packed bytes stay equal, the
attention outputs within float tolerance (Inductor reorders the float32 reductions)."""

from __future__ import annotations

import pytest
import torch

from kvq_torch_bridge.serving import (
    allocate_kv_cache,
    paged_attention_decode,
    reshape_and_cache,
)

BS, H, D, HQ, NB = 64, 2, 64, 4, 10
FORMATS = ["bfloat16", "int4-g64", "nvfp4", "kvq:fp8"]


def run_schedule(kv_cache_dtype, write, attend):
    """Two sequences: a prefill call of 70 + 130 tokens with 3 padded slots (shuffled), then 3
    decode steps (the first completes sequence 0's second block); attention after each call.
    Returns (cache, attention outputs)."""
    cache = allocate_kv_cache(kv_cache_dtype, NB, BS, H, D, max_num_seqs=3)
    gen = torch.Generator().manual_seed(0)
    tables = torch.tensor([[7, 2, 9], [4, 0, 5]], dtype=torch.int64)
    lens = torch.tensor([0, 0])
    outs = []
    for counts, pad in (((127, 130), 3), ((1, 1), 0), ((1, 1), 1), ((1, 1), 0)):
        slots = []
        for seq, n in enumerate(counts):
            pos = lens[seq] + torch.arange(n)
            slots.append(tables[seq, pos // BS] * BS + pos % BS)
        slots.append(torch.full((pad,), -1, dtype=torch.int64))
        slot = torch.cat(slots)
        perm = torch.randperm(slot.numel(), generator=gen)
        k = torch.randn(slot.numel(), H, D, generator=gen).to(torch.bfloat16)
        v = torch.randn(slot.numel(), H, D, generator=gen).to(torch.bfloat16)
        write(k[perm], v[perm], cache, slot[perm])
        lens = lens + torch.tensor(counts)
        q = torch.randn(2, HQ, D, generator=gen).to(torch.bfloat16)
        outs.append(attend(q, cache, tables, lens))
    return cache, outs


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.ndim else t.reshape(1)


def assert_same_cache(eager, compiled):
    """Every tensor byte-equal but the last entry (the scratch entry padded tokens write into:
    with several writers its contents are whichever write lands last)."""
    got = compiled.tensors()
    for name, want in eager.tensors().items():
        if want.ndim == 0:
            assert torch.equal(got[name], want), name
        else:
            assert torch.equal(bytes_of(got[name][:-1]), bytes_of(want[:-1])), name


def compiled(fn, backend):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend, dynamic=False)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_fullgraph_write_and_decode_equal_eager(kv_cache_dtype):
    want_cache, want = run_schedule(kv_cache_dtype, reshape_and_cache, paged_attention_decode)
    write = compiled(reshape_and_cache, "aot_eager")
    attend = torch.compile(paged_attention_decode, fullgraph=True, backend="aot_eager",
                           dynamic=False)  # fmt: skip
    got_cache, got = run_schedule(kv_cache_dtype, write, attend)
    assert_same_cache(want_cache, got_cache)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_fullgraph_refuses_a_graph_break():
    """The check has teeth: a host read inside the write (a planted `.item()`) is a graph
    break, which fullgraph=True turns into an error."""

    def leaky(key, value, cache, slot_mapping):
        if int(slot_mapping.max().item()) >= 0:
            reshape_and_cache(key, value, cache, slot_mapping)

    with pytest.raises(Exception, match=r"(?i)graph break|data-dependent|Unsupported"):
        run_schedule("int4-g64", compiled(leaky, "aot_eager"), paged_attention_decode)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int4-g64", "nvfp4"])
def test_inductor_write_bytes_equal_eager(kv_cache_dtype):
    want_cache, want = run_schedule(kv_cache_dtype, reshape_and_cache, paged_attention_decode)
    write = compiled(reshape_and_cache, "inductor")
    attend = torch.compile(paged_attention_decode, fullgraph=True, dynamic=False)
    got_cache, got = run_schedule(kv_cache_dtype, write, attend)
    assert_same_cache(want_cache, got_cache)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)
