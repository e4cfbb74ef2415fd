"""Soak: hundreds of random requests through the engine, then nothing leaked and every request
equal to itself alone.

With --run-slow (a long case). Seeded: 510 requests (prompt lengths 1-300, 1-12 new tokens,
random stop ids, priorities 0-2, greedy and sampled) through a tiny 2-loop Ouro under three
loop_kv modes ("all" with int4-g16 and exits that skip loops, "last" with int4-g16+win, "mean"
with bf16 and exits), queued in waves into an engine of 6 slots and a pool too small for all of
them at once, so requests wait, join, leave, are preempted (swapped to host memory and back)
and forked (greedy children of greedy requests, sharing their pages) continuously. At the end:
every page and slot back with the allocators (the pool and the prefill scratch pool), nothing
left in host memory, and each request's (and fork's) tokens, exit loops and finish reason equal
those of the same request run alone in the idle engine afterwards (same compiled shapes: all
slots run every step).
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import tiny_model

from kvq_jax.engine import Engine

VOCAB = 97
#: (policy, loop_kv, exit threshold: < 1 exits early and skips loops, seed, requests). A soak
#: is a long case: every mode runs with --run-slow only (CI time: ~2 min for 80 requests on a
#: busy 2-core machine); the engine's scheduling paths run by default in
#: test_engine_scheduling.py and test_engine.py.
MODES = (
    pytest.param("int4-g16", "all", 0.5, 1, 170, marks=pytest.mark.slow, id="int4-g16-all"),
    pytest.param(
        "int4-g16+win", "last", 1.0, 2, 80, marks=pytest.mark.slow, id="int4-g16+win-last"
    ),
    pytest.param(
        "int4-g16+win", "last", 1.0, 2, 170, marks=pytest.mark.slow, id="int4-g16+win-last-170"
    ),
    pytest.param("bf16", "mean", 0.6, 3, 170, marks=pytest.mark.slow, id="bf16-mean"),
)


def _requests(rng, n):
    out = []
    for _ in range(n):
        length = int(rng.integers(1, 301))
        stops = rng.integers(0, VOCAB, int(rng.integers(0, 4))).tolist()
        options = dict(max_new_tokens=int(rng.integers(1, 13)), stop_ids=stops,
                       priority=int(rng.integers(0, 3)))  # fmt: skip
        if rng.random() < 0.3:
            options.update(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.integers(0, 8)),
                           seed=int(rng.integers(0, 2**31)))  # fmt: skip
        out.append((rng.integers(0, VOCAB, length).tolist(), options))
    return out


def _maybe_fork(engine, rng, forks, p=0.15):
    """Now and then a greedy child of a running greedy request that can still grow, with a
    longer budget (its alone run: the parent's prompt and stops, the child's budget)."""
    if rng.random() >= p:
        return
    parents = [r for r in engine.running.values() if r.temperature == 0 and not r.done]
    if not parents or not engine.allocator.free_slots:
        return
    parent = parents[int(rng.integers(0, len(parents)))]
    budget = min(len(parent.tokens) + int(rng.integers(1, 13)),
                 engine.max_tokens_per_seq - len(parent.prompt))  # fmt: skip
    if budget <= len(parent.tokens):
        return
    try:
        child = engine.fork(parent, max_new_tokens=budget)
    except ValueError as e:  # no slot or out of pages: the engine is unchanged
        assert "out of pages" in str(e) or "no free sequence slot" in str(e), e
        return
    forks.append((child, dict(max_new_tokens=budget, stop_ids=sorted(parent.stop_ids))))


@pytest.mark.parametrize("policy,loop_kv,threshold,seed,requests", MODES)
def test_soak(policy, loop_kv, threshold, seed, requests):
    model = tiny_model("ouro", seed=7, layers=1, hidden=64, heads=2, kv_heads=2, head_dim=32,
                       loops=2, threshold=threshold)  # fmt: skip
    engine = Engine(model, policy, num_pages=40, page_size=16, max_seqs=6,
                    max_pages_per_seq=20, prefill_chunk=64, loop_kv=loop_kv,
                    prefill_batch=2)  # fmt: skip
    rng = np.random.default_rng(seed)
    specs = _requests(rng, requests)
    submitted = []
    forks = []  # (child, its options for the alone run)
    for wave in range(0, len(specs), 40):  # new requests arrive while others run
        submitted += [engine.submit(p, **o) for p, o in specs[wave : wave + 40]]
        for _ in range(int(rng.integers(5, 30))):
            engine.step()
            _maybe_fork(engine, rng, forks)
    engine.run()
    assert all(r.done for r in submitted + [c for c, _ in forks])
    pools = [engine.allocator] + ([engine.prefill_allocator] if engine.prefill_allocator else [])
    for pool in pools:
        assert pool.num_free_pages == pool.num_pages and not pool.live_slots
    assert not engine.running and not engine.waiting and not engine.swapped
    assert not engine._host_kv
    need = 5 if requests >= 170 else 2  # the schedule really preempted and forked
    assert engine.stats["preemptions"] >= need and engine.stats["forks"] >= need, engine.stats
    for child, options in forks:
        specs.append((child.prompt, options))
        submitted.append(child)
    for request, (prompt, options) in zip(submitted, specs, strict=True):
        alone = engine.add_request(prompt, **options)
        engine.run()
        assert (alone.tokens, alone.exit_loops, alone.finish_reason) == (
            request.tokens,
            request.exit_loops,
            request.finish_reason,
        ), f"request of {len(prompt)} prompt tokens, {options}"
    for pool in pools:
        assert pool.num_free_pages == pool.num_pages and not pool.live_slots
