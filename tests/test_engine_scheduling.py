"""The engine's scheduler at work: preemption through swap, priorities, forks.

* A pool too small for the batch: sequences are swapped out to host memory and back while
  they generate; each request's tokens equal the request run alone, and its logits equal
  within the batch tolerance (the same batch run without preemption differs from the alone
  runs by as much: batch composition changes the float summation, not the swap).
* Swap round trip: a request preempted for an urgent one and resumed later reads back, in its
  new slot and pages, byte for byte the K/V it had (`paged_cache.gather` per layer and loop).
* Forks share the parent's complete pages (reference counts), a greedy fork generates the
  parent's tokens, a sampled fork's logits equal a teacher-forced replay of its tokens alone.
* Errors: a bad priority, a fork of a request that is not running, decode_step out of pages.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import prompt_of, tiny_model

from kvq_jax.cache import paged_cache
from kvq_jax.engine import Engine

#: |logit difference| of a request in a batch vs alone (tiny float32 Ouro, logits ~2): the
#: batch's rows change the float32 summation order of nothing but XLA's fused reductions;
#: measured <= 1e-5 with and without preemption.
BATCH_TOL = 5e-3

CASES = [("int4-g16", "all"), ("bf16", "last")]
#: the bf16 case of the two longest tests runs with --run-slow (CI time)
SLOW_BF16 = [CASES[0], pytest.param(*CASES[1], marks=pytest.mark.slow, id="bf16-last")]


@pytest.fixture(scope="module")
def model():
    return tiny_model("ouro", seed=5, layers=2, hidden=64, heads=2, kv_heads=2, head_dim=32,
                      loops=2)  # fmt: skip


def _engine(model, policy, loop_kv, **kw):
    args = dict(num_pages=10, page_size=16, max_seqs=3, max_pages_per_seq=8, prefill_chunk=32,
                loop_kv=loop_kv)  # fmt: skip
    return Engine(model, policy, **(args | kw))


SPECS = [(30, 1, 40), (20, 2, 45), (35, 3, 38)]  # (prompt length, seed, new tokens)


@pytest.mark.parametrize("policy,loop_kv", SLOW_BF16, ids=["int4-g16-all", "bf16-last"])
def test_preemption_through_swap_equals_alone(model, policy, loop_kv):
    engine = _engine(model, policy, loop_kv)
    alone = []
    for n, seed, new in SPECS:
        r = engine.add_request(prompt_of(n, seed), max_new_tokens=new, keep_logits=True)
        engine.run()
        alone.append(r)
    assert engine.stats["preemptions"] == 0
    batch = [engine.submit(prompt_of(n, seed), max_new_tokens=new, keep_logits=True)
             for n, seed, new in SPECS]  # fmt: skip
    engine.run()
    # 3 sequences growing to ~70 tokens need 15 pages of 16; the pool has 10
    assert engine.stats["preemptions"] >= 1 and engine.stats["swap_bytes"] > 0
    assert sum(r.preemptions for r in batch) == engine.stats["preemptions"]
    for got, want in zip(batch, alone, strict=True):
        assert got.tokens == want.tokens
        assert got.exit_loops == want.exit_loops
        diff = np.abs(np.stack(got.logits) - np.stack(want.logits)).max()
        assert diff < BATCH_TOL, diff
    assert engine.allocator.num_free_pages == 10 and not engine.allocator.live_slots
    assert not engine.swapped and not engine._host_kv


def _read_back(engine, request):
    """Every layer and stored loop of `request`'s K/V as the cache returns it (decoded)."""
    out = []
    table = np.asarray(engine.allocator.block_tables()[request.slot])
    for layer in range(engine.config.num_layers):
        cache = engine.layer_cache(layer)
        for loop in range(engine.stored_loops):
            if engine.cache_config is None:  # raw store: the pages themselves
                pages = table[: -(-request.position // engine.page_size)]
                rows = [np.asarray(a[loop, pages]).reshape(-1, *a.shape[3:])[: request.position]
                        for a in (cache.k, cache.v)]  # fmt: skip
            else:
                rows = paged_cache.gather(cache, seq_id=request.slot, seq_len=request.position,
                                          block_table=table, loop=loop)  # fmt: skip
            out += [np.asarray(a) for a in rows]
    return out


@pytest.mark.parametrize("policy,loop_kv", SLOW_BF16, ids=["int4-g16-all", "bf16-last"])
def test_swap_round_trip_is_byte_exact(model, policy, loop_kv):
    engine = _engine(model, policy, loop_kv, num_pages=7)
    victim = engine.submit(prompt_of(50, 7), max_new_tokens=30, priority=5)
    for _ in range(6):
        engine.step()
    before = _read_back(engine, victim)
    old_slot, old_pages = victim.slot, engine.allocator.pages(victim.slot).tolist()
    urgent = engine.submit(prompt_of(60, 8), max_new_tokens=3, priority=0)
    engine.step()  # the urgent request needs 4 pages, 3 are free: the victim is swapped out
    assert victim.slot is None and victim in engine.swapped and victim.preemptions == 1
    # the urgent request wrote over the victim's old slot and pages
    assert urgent.slot == old_slot and set(engine.allocator.pages(urgent.slot)) & set(old_pages)
    while victim.slot is None:
        engine.step()
    position = victim.position
    after = _read_back(engine, victim)
    victim.position = position
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        n = min(len(a), len(b))
        np.testing.assert_array_equal(a[:n], b[:n])
    engine.run()
    assert urgent.done and victim.done


@pytest.mark.parametrize("policy,loop_kv", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_fork_shares_pages_and_continues(model, policy, loop_kv):
    engine = _engine(model, policy, loop_kv, num_pages=16, max_seqs=4)
    parent = engine.submit(prompt_of(40, 9), max_new_tokens=12, keep_logits=True)
    for _ in range(3):
        engine.step()
    greedy = engine.fork(parent)
    sampled = engine.fork(parent, temperature=1.0, top_k=5, seed=11)
    shared = 40 // 16 if (parent.position % 16) else parent.position // 16
    for logical in range(shared):
        assert engine.allocator.refcount(engine.allocator.pages(parent.slot)[logical]) == 3
    engine.run()
    assert engine.stats["forks"] == 2
    assert greedy.tokens == parent.tokens
    assert sampled.tokens[:3] == parent.tokens[:3] and len(sampled.tokens) == 12
    assert engine.allocator.num_free_pages == 16 and not engine.allocator.live_slots
    # the sampled fork alone: teacher-forced on its own tokens, its logits are the fork's
    replay = engine.add_request(prompt_of(40, 9), max_new_tokens=12, keep_logits=True,
                                forced_tokens=sampled.tokens)  # fmt: skip
    engine.run()
    diff = np.abs(np.stack(replay.logits) - np.stack(sampled.logits)).max()
    assert diff < BATCH_TOL, diff


def test_errors_leave_the_engine_usable(model):
    engine = _engine(model, "int4-g16", "all", num_pages=6, max_seqs=2)
    with pytest.raises(ValueError, match="priority must be an int"):
        engine.submit(prompt_of(5), max_new_tokens=3, priority=0.5)
    queued = engine.submit(prompt_of(5), max_new_tokens=3)
    with pytest.raises(ValueError, match="fork: the request is not running"):
        engine.fork(queued)
    a = engine.add_request(prompt_of(47, 1), max_new_tokens=40)  # 3 pages
    b = engine.add_request(prompt_of(47, 2), max_new_tokens=40)  # 3 pages: the pool is full
    with pytest.raises(ValueError, match="no free sequence slot"):
        engine.fork(a)
    engine.decode_step()  # writes row 47: the last of their 3 pages
    free = engine.allocator.num_free_pages
    with pytest.raises(ValueError, match="out of pages"):
        engine.decode_step()  # both grow to a 4th page, none free
    assert engine.allocator.num_free_pages == free and a.position == 48 and b.position == 48
    engine.run()  # step() preempts one of them instead
    assert a.done and b.done and queued.done and engine.stats["preemptions"] >= 1
    assert engine.allocator.num_free_pages == 6
