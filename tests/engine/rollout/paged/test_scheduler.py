"""The continuous engine's scheduler alone (host bookkeeping at chunk boundaries)."""

from __future__ import annotations

import numpy as np

from grpo.engine.rollout.paged.pages import PageAllocator
from grpo.engine.rollout.paged.scheduler import Scheduler


def test_schedule_queue_order_refill_and_eviction():
    """The host's chunk-boundary bookkeeping alone: rows enter in queue order, a row gets
    the pages of its next chunk, a short pool evicts the latest admitted row back to the
    head of the queue, and finished rows' slots and pages are refilled."""
    alloc = PageAllocator(pages=5, page_size=4, slots=2, max_pages=3)
    sched = Scheduler(alloc, prompt_len=np.array([4, 4, 4]), cap=8, chunk=4)
    assert sched.admit() == [(0, 0), (1, 1)]  # prompt + one chunk: 8 tokens, 2 pages each
    assert list(sched.queue) == [2] and alloc.free_pages == 1
    sched.sync(np.array([False, False]), np.array([8, 8]))  # both need 11 tokens (cap: 4 + 8 - 1): 3 pages
    assert sched.slot_row == [0, -1] and list(sched.queue) == [1, 2] and sched.evictions == 1
    assert len(alloc.held(0)) == 3
    assert sched.admit() == [(1, 1)]  # the evicted row first, into the freed slot
    sched.sync(np.array([True, False]), np.array([11, 4]))  # row 0 done: slot 0 and its pages freed
    assert sched.slot_row == [-1, 1] and alloc.held(0) == ()
    assert sched.admit() == [(0, 2)] and not sched.queue
    alloc.check()


def test_schedule_selection_decodes_live_slots_of_each_part():
    """A chunk decodes each part's live slots padded with its own free ones to a power of
    two (so each device keeps its rows), over the fewest power-of-two pages covering them."""
    alloc = PageAllocator(pages=32, page_size=4, slots=8, max_pages=6, shards=2)
    sched = Scheduler(alloc, prompt_len=np.array([2, 2, 2, 2, 2]), cap=20, chunk=4)
    sched.admit()  # rows 0-4 into slots 0-4: part 0 full (slots 0-3), part 1 holds slot 4
    for s in (1, 2):
        sched._release(s)
    alloc.grow(4, 13)  # slot 4 holds 4 pages
    idx, table = sched.selection()
    assert idx.tolist() == [0, 3, 4, 5]  # part 0: slots 0 and 3; part 1: slot 4 and free slot 5
    assert table.shape == (4, 4)  # 4 pages cover every selected slot
    np.testing.assert_array_equal(table, alloc.table()[idx, :4])
    alloc.grow(0, 21)  # 6 pages: the width is capped at max_pages, not the next power of two
    assert sched.selection()[1].shape == (4, 6)
