"""The host side of the paged KV cache: which pages of the pool each decode slot holds.

The continuous sampler (:mod:`grpo.engine.rollout.continuous`) keeps every layer's keys
and values in one pool of fixed-size pages (``[layers, kv_heads, pages, page_size,
head_dim]``, :class:`grpo.models.paged_attention.PagedKVCache`) and gives each decode
slot a row of a page table ``[slots, max_pages_per_row]`` int32: token ``i`` of the row
in slot ``s`` lives at page ``table[s, i // page_size]``, offset ``i % page_size``. A
row holds only the pages its tokens (and the next chunk's) need; when it finishes, its
pages go back to the free list and the next admitted row reuses them.

The allocator is pure host Python/numpy and changes only at chunk boundaries, so the
device never waits on it mid-chunk. It never hands out a page twice (a page belongs to at
most one slot) and never loses one (free + held == the pool, :meth:`PageAllocator.check`).
Table entries past a slot's pages hold page 0: a valid index, so a kernel that reads a
whole compute block stays in bounds; attention masks them by the row's length.
"""

from __future__ import annotations

import math

import numpy as np


class PoolExhausted(Exception):
    """Raised by :meth:`PageAllocator.grow` when the free list cannot cover a request
    (the caller evicts a row or waits; nothing was allocated)."""


class PageAllocator:
    """Pages of a pool of ``pages`` pages of ``page_size`` tokens, held by ``slots`` decode
    slots, at most ``max_pages`` each.

    Pages are handed out lowest first from a free list; freed pages are reused before
    untouched ones (they go back on top), which keeps a small working set of the pool warm.
    """

    def __init__(self, *, pages: int, page_size: int, slots: int, max_pages: int):
        if min(pages, page_size, slots, max_pages) < 1:
            raise ValueError(f"pages={pages}, page_size={page_size}, slots={slots}, max_pages={max_pages} must be >= 1")
        self.pages, self.page_size, self.slots, self.max_pages = pages, page_size, slots, max_pages
        self._free: list[int] = list(range(pages - 1, -1, -1))  # a stack: pop() gives the lowest
        self._held: list[list[int]] = [[] for _ in range(slots)]
        self.peak = 0  # most pages held at once

    # ------------------------------------------------------------------ queries

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def held_pages(self) -> int:
        return self.pages - len(self._free)

    def held(self, slot: int) -> tuple[int, ...]:
        return tuple(self._held[slot])

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return math.ceil(max(tokens, 0) / self.page_size)

    def table(self) -> np.ndarray:
        """The page table [slots, max_pages] int32 (unheld entries 0)."""
        out = np.zeros((self.slots, self.max_pages), np.int32)
        for s, pages in enumerate(self._held):
            out[s, : len(pages)] = pages
        return out

    # ------------------------------------------------------------------ changes

    def grow(self, slot: int, tokens: int) -> None:
        """Make ``slot`` hold enough pages for ``tokens`` tokens (never shrinks). Raises
        :class:`PoolExhausted` (allocating nothing) when the free list is too short, and
        ValueError past ``max_pages``."""
        need = self.pages_for(tokens) - len(self._held[slot])
        if need <= 0:
            return
        if len(self._held[slot]) + need > self.max_pages:
            raise ValueError(f"slot {slot} would need {len(self._held[slot]) + need} pages > max_pages={self.max_pages}")
        if need > len(self._free):
            raise PoolExhausted(f"slot {slot} needs {need} more pages, {len(self._free)} free")
        self._held[slot].extend(self._free.pop() for _ in range(need))
        self.peak = max(self.peak, self.held_pages)

    def free(self, slot: int) -> int:
        """Give back every page of ``slot``; returns how many."""
        pages = self._held[slot]
        self._free.extend(reversed(pages))
        self._held[slot] = []
        return len(pages)

    def check(self) -> None:
        """Assert the invariants: every page is either free or held by exactly one slot."""
        held = [p for pages in self._held for p in pages]
        everything = held + self._free
        assert len(everything) == len(set(everything)) == self.pages, "a page is shared, lost or duplicated"
        assert set(everything) == set(range(self.pages)), "a page index is out of the pool"


__all__ = ["PageAllocator", "PoolExhausted"]
