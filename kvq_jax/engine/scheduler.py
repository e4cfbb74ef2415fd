"""The engine's scheduler: which requests run, which wait, which are swapped out, per step.

Host-only (NumPy and the `PageAllocator`; no JAX). Requests are ranked by `(priority,
arrival)`: a smaller priority number first, then the earlier arrival. Pages are taken on
demand, as vLLM does: admission takes a slot and the pages of prompt + 1 tokens, and every
decode step grows each running sequence to `position + 1` tokens (the row it writes).

`Scheduler.schedule()` returns a `Plan` for one step, which the engine carries out in order:

1. **preempt** running requests, worst ranked first, until every remaining running request can
   grow by the row it writes this step (their pages and slot go back to the allocator; the
   engine copies their K/V to host memory first: *swap*);
2. **grow** the running requests;
3. **resume** swapped-out requests and **admit** waiting ones, one queue ranked as above, as
   long as the head of the queue fits (a free slot, its pages): no request overtakes a better
   ranked one that does not fit. When the head does not fit and running requests rank worse
   than it, the fewest worst-ranked of them whose pages make it fit are preempted for it
   (*priority preemption*); if no such set exists nothing starts. After a growth preemption
   nothing new starts in that step (the pool is short), and nothing ranked after a request
   preempted in this step starts in it.

The engine validates every request against the pool (a request alone always fits), so the best
ranked request can always run: the schedule makes progress.
"""

from __future__ import annotations

import dataclasses

from kvq_jax.core.allocator import PageAllocator

__all__ = ["Plan", "Scheduler"]


@dataclasses.dataclass
class Plan:
    """One step's decisions, in the order the engine carries them out (lists of requests)."""

    preempt: list = dataclasses.field(default_factory=list)
    grow: list = dataclasses.field(default_factory=list)
    resume: list = dataclasses.field(default_factory=list)
    admit: list = dataclasses.field(default_factory=list)


class Scheduler:
    """Queues and decisions over one allocator.

    allocator: the engine's `PageAllocator`; max_admit: requests admitted per step (the
    engine's prefill_batch). A request needs the attributes `priority`, `arrival`, `prompt`,
    `position` (tokens in the cache) and `slot`; the scheduler sets none of them but
    `arrival` (`add` / `stamp`)."""

    def __init__(self, allocator: PageAllocator, max_admit: int):
        self.allocator = allocator
        self.max_admit = int(max_admit)
        self.waiting: list = []  # not started
        self.swapped: list = []  # preempted, their K/V in host memory
        self.running: dict = {}  # slot -> request
        self._clock = 0

    # -- queues ------------------------------------------------------------------------------

    def stamp(self, request) -> None:
        """Give `request` the next arrival number (its rank among equal priorities)."""
        request.arrival = self._clock
        self._clock += 1

    def add(self, request) -> None:
        """Queue a new request (stamped on arrival)."""
        self.stamp(request)
        self.waiting.append(request)

    @property
    def busy(self) -> bool:
        """Whether any request is waiting, swapped out or running."""
        return bool(self.waiting or self.swapped or self.running)

    @staticmethod
    def rank(request) -> tuple:
        return (request.priority, request.arrival)

    @staticmethod
    def tokens_needed(request) -> int:
        """Tokens of pages `request` needs to take its next step: prompt + 1 when it has not
        started, else its position + 1 (the row the next decode writes)."""
        if request.position == 0:
            return len(request.prompt) + 1
        return request.position + 1

    # -- the plan ----------------------------------------------------------------------------

    def schedule(self) -> Plan:
        """This step's `Plan` (changes only the queues' order and membership: the engine acts)."""
        alloc, ps = self.allocator, self.allocator.page_size
        plan = Plan()
        running = sorted(self.running.values(), key=self.rank)
        held = {r.slot: len(alloc.pages(r.slot)) for r in running}
        refs = self._refcounts()

        def growth(rs):
            return sum(max(0, -(-self.tokens_needed(r) // ps) - held[r.slot]) for r in rs)

        free = alloc.num_free_pages
        while running and growth(running) > free:
            victim = running.pop()  # the worst ranked
            free += self._release(victim, refs)
            plan.preempt.append(victim)
        free -= growth(running)
        plan.grow = list(running)
        slots = alloc.max_seqs - len(running)
        # after a growth preemption the pool is short: nothing starts in this step
        queue = [] if plan.preempt else sorted(self.swapped + self.waiting, key=self.rank)
        barrier = None  # the best rank preempted for a priority: nothing after it starts
        started = 0
        for cand in queue:
            if barrier is not None and self.rank(cand) >= barrier:
                break
            if cand.position == 0 and started >= self.max_admit:
                break
            need = -(-self.tokens_needed(cand) // ps)
            if need > free or slots == 0:
                victims = self._victims(running, cand, need - free, slots == 0, refs)
                if victims is None:
                    break
                for v in victims:
                    running.remove(v)
                    plan.grow.remove(v)
                    free += self._release(v, refs) + growth([v])
                    slots += 1
                    plan.preempt.append(v)
                barrier = min([self.rank(v) for v in victims] + ([barrier] if barrier else []))
            free -= need
            slots -= 1
            if cand.position == 0:
                plan.admit.append(cand)
                started += 1
            else:
                plan.resume.append(cand)
        for r in plan.preempt:
            del self.running[r.slot]
        self.waiting = [r for r in self.waiting if r not in plan.admit]
        self.swapped = [r for r in self.swapped if r not in plan.resume]
        self.swapped += plan.preempt
        return plan

    def _refcounts(self) -> dict:
        """page -> how many running sequences hold it (the allocator's counts, as a copy)."""
        refs: dict = {}
        for slot in self.running:
            for p in self.allocator.pages(slot).tolist():
                refs[p] = refs.get(p, 0) + 1
        return refs

    def _release(self, request, refs) -> int:
        """Count `request`'s pages out of `refs`; returns how many become free."""
        freed = 0
        for p in self.allocator.pages(request.slot).tolist():
            refs[p] -= 1
            freed += refs[p] == 0
        return freed

    def _victims(self, running, cand, short_pages, need_slot, refs):
        """The fewest worst-ranked running requests ranked after `cand` whose release frees
        `short_pages` pages (and a slot when `need_slot`), or None."""
        trial = dict(refs)
        victims, freed = [], 0
        for r in reversed(running):
            if self.rank(r) <= self.rank(cand):
                break
            victims.append(r)
            freed += self._release(r, trial) + self._growth_of(r)
            if freed >= short_pages:
                return victims
        return None

    def _growth_of(self, request) -> int:
        ps = self.allocator.page_size
        held = len(self.allocator.pages(request.slot))
        return max(0, -(-self.tokens_needed(request) // ps) - held)
