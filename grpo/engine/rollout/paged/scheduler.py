"""The continuous engine's scheduler: the host's view of the decode slots at chunk
boundaries (the queue, which row each slot holds, refill and eviction), over the page
allocator (:mod:`grpo.engine.rollout.paged.pages`). Pure host Python/numpy: the device
never waits on it mid-chunk.

:class:`Scheduler` serves single-turn rows; :class:`TurnScheduler` multi-turn ones, whose
row parks its pages when it finishes a turn and is seated again for its next one.
"""

from __future__ import annotations

import collections

import numpy as np

from grpo.engine.rollout.paged.pages import PageAllocator, PoolExhausted


class Scheduler:
    """The host's view of the slots at chunk boundaries: the queue, which row each slot
    holds, and the pages each needs (through the allocator)."""

    def __init__(self, alloc: PageAllocator, *, prompt_len: np.ndarray, cap: int, chunk: int):
        self.alloc, self.prompt_len, self.cap, self.chunk = alloc, prompt_len.astype(int), cap, chunk
        self.queue = collections.deque(range(len(prompt_len)))
        self.slot_row = [-1] * alloc.slots
        self.admitted_at: dict[int, int] = {}  # slot -> admission counter (eviction picks the latest)
        self.counter = self.evictions = self.prefills = 0

    def live(self) -> bool:
        return any(r >= 0 for r in self.slot_row)

    def _need(self, slot: int, length: int) -> int:
        """Tokens ``slot`` may hold by the end of the next chunk (never past the cap)."""
        row = self.slot_row[slot]
        return min(length + self.chunk, self.prompt_len[row] + self.cap - 1)

    def sync(self, done: np.ndarray, lengths: np.ndarray) -> None:
        """Free finished rows; grow live ones by the next chunk, evicting the latest
        admitted row of the same part of the pool while it is short."""
        self.release_done(done, lengths)
        self.grow_live(lengths)

    def release_done(self, done: np.ndarray, lengths: np.ndarray) -> list[int]:
        """The rows of the slots that are ``done`` leave them (:meth:`_finish`); returns them."""
        finished = []
        for s, row in enumerate(self.slot_row):
            if row >= 0 and done[s]:
                finished.append(row)
                self._finish(s, int(lengths[s]))
        return finished

    def grow_live(self, lengths: np.ndarray) -> None:
        """Every live slot given the pages of its next chunk, oldest first, evicting while
        its part of the pool is short (:meth:`_evict_one`)."""
        for s in sorted((s for s, r in enumerate(self.slot_row) if r >= 0), key=self.admitted_at.get):
            while self.slot_row[s] >= 0:
                try:
                    self.alloc.grow(s, self._need(s, int(lengths[s])))
                    break
                except PoolExhausted:
                    self._evict_one(self.alloc.shard(s))

    def _finish(self, slot: int, length: int) -> None:
        """A finished row leaves ``slot`` (holding ``length`` tokens): its pages are freed."""
        self._release(slot)

    def _evict_one(self, shard: int) -> None:
        """Evict the latest admitted row of the ``shard``'s part of the pool back to the
        head of the queue (the oldest row there always goes on: the part holds a row at
        the cap)."""
        victim = max((v for v, r in enumerate(self.slot_row) if r >= 0 and self.alloc.shard(v) == shard),
                     key=self.admitted_at.get)
        self.queue.appendleft(self.slot_row[victim])
        self._release(victim)
        self.evictions += 1

    def _admit_length(self, row: int) -> int:
        """Tokens ``row`` holds once prefilled (its prompt)."""
        return int(self.prompt_len[row])

    def selection(self) -> tuple[np.ndarray, np.ndarray]:
        """The slots the next chunk decodes and their page tables: ``idx`` [n] (each part
        of the pool's live slots padded with its free ones to the same power of two, part
        by part, so a device's rows stay its own) and ``table`` [n, W] (W: a power of two
        of pages covering every selected slot's pages, at most ``max_pages``). Powers of
        two bound the decode's compilations to about log2(slots) x log2(max_pages)."""
        a = self.alloc
        parts = [range(d * a.shard_slots, (d + 1) * a.shard_slots) for d in range(a.shards)]
        live = [[s for s in part if self.slot_row[s] >= 0] for part in parts]
        n = min(pow2(max(len(x) for x in live)), a.shard_slots)
        idx = np.asarray([s for part, lv in zip(parts, live)
                          for s in lv + [s for s in part if self.slot_row[s] < 0][: n - len(lv)]], np.int32)
        held = max(len(a.held(int(s))) for s in idx)
        width = min(pow2(held), a.max_pages)
        return idx, a.table()[idx, :width]

    def admit(self) -> list[tuple[int, int]]:
        """Queued rows, in queue order, into free slots whose part of the pool fits their
        prompt and first chunk."""
        admitted = []
        for s in range(self.alloc.slots):
            if not self.queue:
                break
            if self.slot_row[s] >= 0:
                continue
            row = self.queue[0]
            self.slot_row[s] = row
            try:
                self.alloc.grow(s, self._need(s, self._admit_length(row)))
            except PoolExhausted:  # another shard's slot may still fit it
                self.slot_row[s] = -1
                continue
            self.queue.popleft()
            self.admitted_at[s] = self.counter
            self.counter += 1
            admitted.append((s, row))
        if admitted:
            self.prefills += 1
        return admitted

    def _release(self, slot: int) -> None:
        self.alloc.free(slot)
        self.slot_row[slot] = -1
        self.admitted_at.pop(slot, None)


class TurnScheduler(Scheduler):
    """:class:`Scheduler` for multi-turn rows: a row that finishes a turn parks its pages
    (:meth:`_finish`); if its episode goes on (:meth:`resume`) it waits in ``returning``,
    admitted before the queue into a free slot of its pages' part of the pool; eviction
    takes the latest admitted row of the part, parked or in a slot, and frees its pages
    (it is then re-prefilled from its conversation)."""

    def __init__(self, alloc: PageAllocator, *, prompt_len: np.ndarray, cap: int, chunk: int):
        super().__init__(alloc, prompt_len=prompt_len, cap=cap, chunk=chunk)
        self.hist_len = self.prompt_len.copy()  # [B] tokens of each row's conversation so far
        self.base = np.zeros(len(self.prompt_len), np.int64)  # [B] of them already in its pages
        self.returning: collections.deque[int] = collections.deque()
        self.age: dict[int, int] = {}  # a parked row -> its admission counter

    def _admit_length(self, row: int) -> int:
        return int(self.hist_len[row])

    def _finish(self, slot: int, length: int) -> None:
        row = self.slot_row[slot]
        self.age[row] = self.admitted_at.pop(slot)
        self.alloc.park(slot, row)
        self.base[row] = length
        self.slot_row[slot] = -1

    def close(self, row: int) -> None:
        """``row``'s episode ended: its pages go back."""
        self.alloc.drop(row)
        self.age.pop(row, None)

    def resume(self, row: int, length: int) -> None:
        """``row`` goes on to its next turn, its conversation now ``length`` tokens."""
        self.hist_len[row] = length
        self.returning.append(row)

    def _evict_one(self, shard: int) -> None:
        parked = self.alloc.parked()
        held = [(self.admitted_at[s], s, r) for s, r in enumerate(self.slot_row)
                if r >= 0 and self.alloc.shard(s) == shard]
        held += [(self.age[r], -1, r) for r in self.returning if parked.get(r) == shard]
        _, slot, row = max(held)
        if slot >= 0:
            self._release(slot)
        else:
            self.returning.remove(row)
            self.alloc.drop(row)
            self.age.pop(row)
        self.base[row] = 0
        self.queue.appendleft(row)
        self.evictions += 1

    def admit(self) -> list[tuple[int, int]]:
        """Returning rows first (each into a free slot of its part, given its chunk's and
        next chunk's pages), then the queue's (:meth:`Scheduler.admit`)."""
        admitted = []
        for row in list(self.returning):
            if row in self.returning:
                slot = self._seat_returning(row)
                if slot is not None:
                    admitted.append((slot, row))
        prefills = self.prefills
        admitted += super().admit()
        self.prefills = prefills + bool(admitted)
        return admitted

    def _seat_returning(self, row: int) -> int | None:
        """A free slot of ``row``'s part of the pool with its parked pages grown for the
        next chunk (evicting while short); None: no free slot there yet, or it was
        evicted itself (it then waits in the queue, its pages freed)."""
        a = self.alloc
        shard = a.parked()[row]
        free = [s for s in range(shard * a.shard_slots, (shard + 1) * a.shard_slots) if self.slot_row[s] < 0]
        if not free:
            return None
        slot = free[0]
        self.returning.remove(row)
        a.unpark(row, slot)
        self.slot_row[slot], self.admitted_at[slot] = row, self.age.pop(row)
        while self.slot_row[slot] == row:
            try:
                a.grow(slot, self._need(slot, int(self.hist_len[row])))
                return slot
            except PoolExhausted:
                self._evict_one(shard)
        return None


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


__all__ = ["Scheduler", "TurnScheduler", "pow2"]
