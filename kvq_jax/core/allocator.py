"""The page allocator: host-side owner of a paged cache's physical pages and sequence slots.

One implementation for both stacks (NumPy only). A sequence lives in a slot (a row of the
block tables and of the cache's staging, sink and length arrays); its logical page i is
physical page `block_tables[slot, i]` in every loop plane (-1: none yet). Pages are
reference-counted: `fork` lets a new sequence share the complete pages of a prefix, and a
page returns to the free list when its last sequence is freed.

Every method validates first and changes nothing when it raises (ValueError naming the
problem): out of pages or slots, a freed or unknown slot, a double free, a block table that
points to a page another sequence owns.

The cache never writes a page that is shared: an append writes only the pages from a
sequence's current partial page on, and `fork` shares only pages that are complete in the
parent (the partial page's rows are copied, raw, by `kvq_jax.cache.paged_cache.fork` /
`kvq_torch_bridge.cache.paged_cache.fork`: copy-on-write of the partial page).
"""

from __future__ import annotations

import numpy as np

from kvq_jax.core.checks import is_int


class PageAllocator:
    """Pages and slots of one paged cache.

    num_pages, page_size, max_seqs: the cache's (`PagedCacheConfig`); max_pages_per_seq: the
    block tables' width (a sequence holds at most max_pages_per_seq * page_size tokens).
    """

    def __init__(self, num_pages: int, page_size: int, max_seqs: int, max_pages_per_seq: int):
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("max_seqs", max_seqs),
            ("max_pages_per_seq", max_pages_per_seq),
        ):
            if not is_int(value) or value < 1:
                raise ValueError(f"PageAllocator.{name} must be an int >= 1, got {value!r}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.max_seqs, self.max_pages_per_seq = int(max_seqs), int(max_pages_per_seq)
        self._tables = np.full((max_seqs, max_pages_per_seq), -1, np.int32)
        self._num_held = np.zeros(max_seqs, np.int64)  # pages held per slot (a prefix of its row)
        self._live = np.zeros(max_seqs, bool)
        self._refs = np.zeros(num_pages, np.int32)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest id

    @classmethod
    def for_config(cls, config, max_pages_per_seq: int) -> PageAllocator:
        """An allocator for a cache of `config` (a `PagedCacheConfig`)."""
        return cls(config.num_pages, config.page_size, config.max_seqs, max_pages_per_seq)

    # -- reading ---------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> list[int]:
        return np.flatnonzero(~self._live).tolist()

    @property
    def live_slots(self) -> list[int]:
        return np.flatnonzero(self._live).tolist()

    def block_tables(self) -> np.ndarray:
        """int32 [max_seqs, max_pages_per_seq], a copy: logical -> physical page, -1 = none
        (`append` drops writes to -1, attention masks what lies past a sequence's length)."""
        return self._tables.copy()

    def pages(self, slot: int) -> np.ndarray:
        """The physical pages sequence `slot` holds, in logical order (int32, a copy)."""
        slot = self._check_live(slot)
        return self._tables[slot, : self._num_held[slot]].copy()

    def capacity(self, slot: int) -> int:
        """Tokens sequence `slot` can hold with the pages it has."""
        return int(self._num_held[self._check_live(slot)]) * self.page_size

    def refcount(self, page: int) -> int:
        """How many sequences hold physical page `page`."""
        return int(self._refs[page])

    def is_shared(self, slot: int, logical_page: int) -> bool:
        """Whether the page at `logical_page` of `slot` is held by another sequence too."""
        slot = self._check_live(slot)
        page = self._tables[slot, logical_page]
        return bool(page >= 0 and self._refs[page] > 1)

    # -- changing ---------------------------------------------------------------------------

    def add_sequence(self, num_tokens: int = 0) -> int:
        """A free slot for a new sequence with pages for `num_tokens` tokens; returns it."""
        slot = self._free_slot()
        self._check_tokens(num_tokens)
        need = self._pages_for(num_tokens)
        self._check_pages_available(need, f"a new sequence of {num_tokens} tokens")
        self._live[slot] = True
        self._grow(slot, need)
        return slot

    def reserve(self, slot: int, num_tokens: int) -> np.ndarray:
        """Make sequence `slot` able to hold `num_tokens` tokens (allocating pages as it grows;
        never shrinking); returns the pages allocated by this call."""
        slot = self._check_live(slot)
        self._check_tokens(num_tokens)
        need = max(0, self._pages_for(num_tokens) - int(self._num_held[slot]))
        self._check_pages_available(need, f"sequence {slot} to grow to {num_tokens} tokens")
        return self._grow(slot, need)

    def free(self, slot: int) -> list[int]:
        """Release sequence `slot` and its pages; returns the pages that became free (those no
        other sequence shares)."""
        slot = self._check_live(slot, action="free")
        held = self._tables[slot, : self._num_held[slot]]
        self._refs[held] -= 1
        released = [int(p) for p in held if self._refs[p] == 0]
        self._free.extend(sorted(released, reverse=True))
        self._free.sort(reverse=True)
        self._tables[slot] = -1
        self._num_held[slot] = 0
        self._live[slot] = False
        return released

    def fork(self, parent: int, num_tokens: int) -> int:
        """A new sequence whose first `num_tokens` tokens are `parent`'s: it shares the parent's
        pages that `num_tokens` fills completely (reference-counted, never written again) and
        gets its own page for a partial last page. Returns the new slot; the cache's `fork`
        copies the partial page's raw rows (copy-on-write). num_tokens must not exceed the
        parent's capacity."""
        parent = self._check_live(parent)
        self._check_tokens(num_tokens)
        if num_tokens > self.capacity(parent):
            raise ValueError(
                f"fork: num_tokens = {num_tokens} exceeds sequence {parent}'s "
                f"{self.capacity(parent)} tokens of pages"
            )
        slot = self._free_slot()
        shared = num_tokens // self.page_size
        need = self._pages_for(num_tokens) - shared
        self._check_pages_available(need, f"a fork of {num_tokens} tokens")
        pages = self._tables[parent, :shared]
        self._refs[pages] += 1
        self._tables[slot, :shared] = pages
        self._num_held[slot] = shared
        self._live[slot] = True
        self._grow(slot, need)
        return slot

    def hold_page(self, page: int) -> None:
        """Take free page `page` out of circulation (no sequence is given it) until
        `release_page`: a page an outside user of the pool writes (the scratch block of a
        Torch serving view, `kvq_torch_bridge.bridge.handoff`). ValueError if it is held."""
        if not is_int(page) or not 0 <= page < self.num_pages:
            raise ValueError(f"page must be an int in [0, {self.num_pages}), got {page!r}")
        if page not in self._free:
            raise ValueError(f"page {page} is in use (held by a sequence or already held)")
        self._free.remove(page)
        self._refs[page] = 1

    def release_page(self, page: int) -> None:
        """Return a page taken by `hold_page` to the free pages."""
        if not is_int(page) or not 0 <= page < self.num_pages or page in self._free:
            raise ValueError(f"page {page!r} is not held")
        if (self._tables == page).any():
            raise ValueError(f"page {page} belongs to a sequence, not to hold_page")
        self._refs[page] = 0
        self._free.append(int(page))
        self._free.sort(reverse=True)

    def hold_slot(self, slot: int) -> None:
        """Take free slot `slot` (no pages) out of use until `free(slot)` (see `hold_page`)."""
        if not is_int(slot) or not 0 <= slot < self.max_seqs:
            raise ValueError(f"slot must be an int in [0, {self.max_seqs}), got {slot!r}")
        if self._live[slot]:
            raise ValueError(f"slot {slot} is in use")
        self._live[slot] = True

    def check_block_tables(self, block_tables) -> None:
        """Raise ValueError unless `block_tables` [max_seqs, >= 1] maps every live sequence
        only onto pages it holds (at the logical positions it holds them) and free slots onto
        nothing; names the first offending entry and the sequence that owns the page."""
        tables = np.asarray(block_tables)
        if tables.ndim != 2 or tables.shape[0] != self.max_seqs:
            raise ValueError(
                f"block_tables must be [max_seqs={self.max_seqs}, pages], got {tables.shape}"
            )
        width = min(tables.shape[1], self.max_pages_per_seq)
        for slot in range(self.max_seqs):
            row = tables[slot]
            held = self._tables[slot, :width]
            for i in np.flatnonzero((row[:width] != held) & (row[:width] >= 0)).tolist():
                page = int(row[i])
                owners = [s for s in self.live_slots if page in self._tables[s]]
                owner = f"owned by sequence {owners[0]}" if owners else "free"
                raise ValueError(
                    f"block_tables[{slot}, {i}] = {page}: that page is {owner}, not held by "
                    f"sequence {slot} at logical page {i}"
                )
            extra = row[width:]
            if (extra >= 0).any():
                raise ValueError(f"block_tables[{slot}] maps pages past max_pages_per_seq")

    # -- helpers ------------------------------------------------------------------------------

    def _pages_for(self, num_tokens: int) -> int:
        pages = -(-num_tokens // self.page_size)
        if pages > self.max_pages_per_seq:
            raise ValueError(
                f"{num_tokens} tokens need {pages} pages, more than max_pages_per_seq = "
                f"{self.max_pages_per_seq}"
            )
        return pages

    def _check_tokens(self, num_tokens) -> None:
        if not is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")

    def _check_pages_available(self, need: int, what: str) -> None:
        if need > len(self._free):
            raise ValueError(
                f"out of pages: {what} needs {need} more page(s), {len(self._free)} of "
                f"{self.num_pages} free (free a sequence or swap one out)"
            )

    def _free_slot(self) -> int:
        free = np.flatnonzero(~self._live)
        if not free.size:
            raise ValueError(f"no free sequence slot: all {self.max_seqs} are live")
        return int(free[0])

    def _check_live(self, slot, action: str = "use") -> int:
        if not is_int(slot) or not 0 <= slot < self.max_seqs:
            raise ValueError(f"slot must be an int in [0, {self.max_seqs}), got {slot!r}")
        if not self._live[slot]:
            what = "freed twice" if action == "free" else "used after it was freed (or never added)"
            raise ValueError(f"sequence slot {slot} is not live: {what}")
        return int(slot)

    def _grow(self, slot: int, need: int) -> np.ndarray:
        start = int(self._num_held[slot])
        new = np.array([self._free.pop() for _ in range(need)], np.int32)
        self._tables[slot, start : start + need] = new
        self._refs[new] += 1
        self._num_held[slot] = start + need
        return new
