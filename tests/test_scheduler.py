"""The scheduler alone (host-only, no model): page accounting, preemption order, priorities.

Requests are stand-ins with the attributes the scheduler reads; a tiny executor plays the
engine (swap out frees the slot, resume / admit take pages, decode grows each running request
by one token), so the checks are against the allocator's own page and slot counts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvq_jax.core.allocator import PageAllocator
from kvq_jax.engine.scheduler import Scheduler

PS = 4  # tokens per page


@dataclasses.dataclass(eq=False)
class Req:
    prompt: list
    max_new: int
    priority: int = 0
    arrival: int = 0
    position: int = 0
    slot: int | None = None
    made: int = 0

    @property
    def done(self):
        return self.made >= self.max_new


def execute(sched: Scheduler, plan) -> None:
    """What the engine does with a plan (the K/V copies aside)."""
    alloc = sched.allocator
    for r in plan.preempt:
        alloc.free(r.slot)
        r.slot = None
    for r in plan.resume:
        r.slot = alloc.add_sequence(r.position + 1)
        sched.running[r.slot] = r
    for r in plan.admit:
        r.slot = alloc.add_sequence(len(r.prompt) + 1)
        r.position = len(r.prompt)
        r.made = 1
        sched.running[r.slot] = r
    for slot, r in list(sched.running.items()):  # decode: grow, write, maybe finish
        if r.done:
            del sched.running[slot]
            alloc.free(slot)
            continue
        alloc.reserve(slot, r.position + 1)
        r.position += 1
        r.made += 1


def check_victims(log) -> None:
    """A victim is never better ranked than a request that keeps running in that step."""
    for plan in log:
        for v in plan.preempt:
            kept = [g for g in plan.grow if Scheduler.rank(g) > Scheduler.rank(v)]
            assert not kept, f"victim ranked {Scheduler.rank(v)} better than a kept request"


def run(sched, max_steps=10_000):
    log = []
    for _ in range(max_steps):
        if not sched.busy:
            return log
        plan = sched.schedule()
        log.append(plan)
        execute(sched, plan)
    raise AssertionError("no progress")


def test_growth_preempts_the_worst_ranked_and_everything_finishes():
    alloc = PageAllocator(num_pages=10, page_size=PS, max_seqs=4, max_pages_per_seq=10)
    sched = Scheduler(alloc, max_admit=4)
    reqs = [Req([0] * 5, 12, priority=p) for p in (1, 0, 2, 1)]
    for r in reqs:
        sched.add(r)
    log = run(sched)
    preempted = [r for plan in log for r in plan.preempt]
    assert preempted, "the pool of 10 pages cannot hold four sequences growing to 17 tokens"
    check_victims(log)
    assert all(r.done for r in reqs)
    assert alloc.num_free_pages == alloc.num_pages and not alloc.live_slots


def test_the_plan_fits_the_pool():
    """Replaying each plan never asks the allocator for more than it has (it would raise)."""
    rng = np.random.default_rng(0)
    alloc = PageAllocator(num_pages=24, page_size=PS, max_seqs=5, max_pages_per_seq=12)
    sched = Scheduler(alloc, max_admit=2)
    reqs = []
    for _ in range(60):
        r = Req([0] * int(rng.integers(1, 30)), int(rng.integers(1, 15)),
                priority=int(rng.integers(0, 3)))  # fmt: skip
        reqs.append(r)
        sched.add(r)
        if rng.random() < 0.5:
            execute(sched, sched.schedule())
    run(sched)
    assert all(r.done for r in reqs)
    assert alloc.num_free_pages == alloc.num_pages and not alloc.live_slots


def test_priority_preemption_takes_the_fewest_worst_victims():
    alloc = PageAllocator(num_pages=6, page_size=PS, max_seqs=4, max_pages_per_seq=6)
    sched = Scheduler(alloc, max_admit=4)
    low = [Req([0] * 7, 50, priority=5), Req([0] * 7, 50, priority=3)]  # 2 pages each
    for r in low:
        sched.add(r)
    execute(sched, sched.schedule())
    urgent = Req([0] * 10, 5, priority=0)  # needs 3 pages: 6 - 4 held - growth short
    sched.add(urgent)
    plan = sched.schedule()
    assert plan.preempt == [low[0]], "one victim suffices, and it is the worst ranked"
    assert plan.admit == [urgent]
    execute(sched, plan)
    assert low[0] in sched.swapped


def test_no_overtaking_and_no_preemption_for_an_equal_rank():
    alloc = PageAllocator(num_pages=4, page_size=PS, max_seqs=4, max_pages_per_seq=4)
    sched = Scheduler(alloc, max_admit=4)
    first = Req([0] * 10, 3)  # 3 pages
    sched.add(first)
    execute(sched, sched.schedule())
    big, small = Req([0] * 9, 2), Req([0] * 1, 2)  # big needs 3 pages, 1 free: waits
    sched.add(big)
    sched.add(small)
    plan = sched.schedule()
    assert plan.admit == [] and plan.preempt == [], "small must not overtake big"


def test_planted_defect_preempting_the_best_is_caught():
    """The ordering check fails when the scheduler takes its victims best-first."""

    class BestFirst(Scheduler):
        rank = staticmethod(lambda r: (-r.priority, -r.arrival))  # plant: the order reversed

    alloc = PageAllocator(num_pages=10, page_size=PS, max_seqs=4, max_pages_per_seq=10)
    sched = BestFirst(alloc, max_admit=4)
    for p in (1, 0, 2, 1):
        sched.add(Req([0] * 5, 12, priority=p))
    with pytest.raises(AssertionError, match="better than a kept request"):
        check_victims(run(sched))
