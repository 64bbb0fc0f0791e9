"""The host side of the paged KV cache: which pages of the pool each decode slot holds.

The continuous sampler (:mod:`grpo.engine.rollout.continuous`) keeps every layer's keys
and values in one pool of fixed-size pages (``[layers, kv_heads, pages, page_size,
head_dim]``, :class:`grpo.models.layers.paged.PagedKVCache`) and gives each decode
slot a row of a page table ``[slots, max_pages_per_row]`` int32: token ``i`` of the row
in slot ``s`` lives at page ``table[s, i // page_size]``, offset ``i % page_size``. A
row holds only the pages its tokens (and the next chunk's) need; when it finishes, its
pages go back to the free list and the next admitted row reuses them.

The pool is split into ``shards`` equal parts, one per shard of the slot axis (the
devices the rows are sharded over): slot ``s`` belongs to shard ``s // (slots / shards)``
and takes pages of that shard only (global indices ``shard * pages_per_shard + local``),
so a device's rows find every page they read in its own part of the pool.

The allocator is pure host Python/numpy and changes only at chunk boundaries, so the
device never waits on it mid-chunk. It never hands out a page twice (a page belongs to at
most one slot) and never loses one (free + held == the pool, :meth:`PageAllocator.check`).
A multi-turn row that stops for a tool call leaves its slot but keeps its pages: they are
*parked* under the row (:meth:`PageAllocator.park`) until its next turn takes a slot of
the same shard (:meth:`PageAllocator.unpark`), or are dropped (:meth:`PageAllocator.drop`).

Table entries past a slot's pages hold its shard's first page: a valid local index, so a
kernel that reads a whole compute block stays in bounds; attention masks them by the row's
length.
"""

from __future__ import annotations

import math

import numpy as np


class PoolExhausted(Exception):
    """Raised by :meth:`PageAllocator.grow` when the free list cannot cover a request
    (the caller evicts a row or waits; nothing was allocated)."""


class PageAllocator:
    """Pages of a pool of ``pages`` pages of ``page_size`` tokens, held by ``slots`` decode
    slots, at most ``max_pages`` each, in ``shards`` parts (both counts divide by it).

    Pages are handed out lowest first from a free list; freed pages are reused before
    untouched ones (they go back on top), which keeps a small working set of the pool warm.
    """

    def __init__(self, *, pages: int, page_size: int, slots: int, max_pages: int, shards: int = 1):
        if min(pages, page_size, slots, max_pages, shards) < 1:
            raise ValueError(f"pages={pages}, page_size={page_size}, slots={slots}, max_pages={max_pages}, "
                             f"shards={shards} must be >= 1")
        if pages % shards or slots % shards:
            raise ValueError(f"pages={pages} and slots={slots} must divide into shards={shards}")
        self.pages, self.page_size, self.slots, self.max_pages = pages, page_size, slots, max_pages
        self.shards, self.shard_pages, self.shard_slots = shards, pages // shards, slots // shards
        # One stack per shard: pop() gives its lowest free page.
        self._free: list[list[int]] = [
            list(range((d + 1) * self.shard_pages - 1, d * self.shard_pages - 1, -1)) for d in range(shards)
        ]
        self._held: list[list[int]] = [[] for _ in range(slots)]
        self._parked: dict[int, tuple[int, list[int]]] = {}  # owner -> (shard, pages) held outside a slot
        self.peak = 0  # most pages held at once

    # ------------------------------------------------------------------ queries

    def shard(self, slot: int) -> int:
        """The shard of the pool (and of the devices) ``slot`` belongs to."""
        return slot // self.shard_slots

    @property
    def free_pages(self) -> int:
        return sum(len(f) for f in self._free)

    @property
    def held_pages(self) -> int:
        return self.pages - self.free_pages

    def held(self, slot: int) -> tuple[int, ...]:
        return tuple(self._held[slot])

    def parked(self) -> dict[int, int]:
        """Each parked owner's shard."""
        return {owner: shard for owner, (shard, _) in self._parked.items()}

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return math.ceil(max(tokens, 0) / self.page_size)

    def table(self) -> np.ndarray:
        """The page table [slots, max_pages] int32 of global page indices (unheld entries:
        the slot's shard's first page)."""
        out = np.zeros((self.slots, self.max_pages), np.int32)
        for s, pages in enumerate(self._held):
            out[s] = self.shard(s) * self.shard_pages
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
            have = len(self._held[slot])
            raise ValueError(f"slot {slot} would need {have + need} pages > max_pages={self.max_pages}")
        free = self._free[self.shard(slot)]
        if need > len(free):
            raise PoolExhausted(f"slot {slot} needs {need} more pages, {len(free)} free in its shard")
        self._held[slot].extend(free.pop() for _ in range(need))
        self.peak = max(self.peak, self.held_pages)

    def free(self, slot: int) -> int:
        """Give back every page of ``slot``; returns how many."""
        pages = self._held[slot]
        self._free[self.shard(slot)].extend(reversed(pages))
        self._held[slot] = []
        return len(pages)

    def park(self, slot: int, owner: int) -> None:
        """Move ``slot``'s pages out of the slot, held under ``owner`` (the slot is then
        empty; the pages stay allocated, in the slot's shard)."""
        if owner in self._parked:
            raise ValueError(f"owner {owner} already has parked pages")
        self._parked[owner] = (self.shard(slot), self._held[slot])
        self._held[slot] = []

    def unpark(self, owner: int, slot: int) -> None:
        """Give ``owner``'s parked pages to the empty ``slot`` of the same shard."""
        shard, pages = self._parked[owner]
        if self.shard(slot) != shard or self._held[slot]:
            raise ValueError(f"slot {slot} (shard {self.shard(slot)}, {len(self._held[slot])} pages) cannot take "
                             f"owner {owner}'s pages of shard {shard}")
        del self._parked[owner]
        self._held[slot] = pages

    def drop(self, owner: int) -> int:
        """Free ``owner``'s parked pages (none: 0); returns how many."""
        shard, pages = self._parked.pop(owner, (0, []))
        self._free[shard].extend(reversed(pages))
        return len(pages)

    def check(self) -> None:
        """Assert the invariants: every page is either free or held by exactly one slot or
        parked owner, of the page's shard."""
        for owner, (shard, pages) in self._parked.items():
            assert all(p // self.shard_pages == shard for p in pages), f"owner {owner} parks another shard's page"
        held = [p for pages in self._held for p in pages] + [p for _, pages in self._parked.values() for p in pages]
        everything = held + [p for free in self._free for p in free]
        for s, pages in enumerate(self._held):
            assert all(p // self.shard_pages == self.shard(s) for p in pages), f"slot {s} holds another shard's page"
        for d, free in enumerate(self._free):
            assert all(p // self.shard_pages == d for p in free), f"shard {d}'s free list holds another shard's page"
        assert len(everything) == len(set(everything)) == self.pages, "a page is shared, lost or duplicated"
        assert set(everything) == set(range(self.pages)), "a page index is out of the pool"


__all__ = ["PageAllocator", "PoolExhausted"]
