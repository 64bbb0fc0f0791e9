"""The host page allocator: no page leaked or shared, reuse after free, exhaustion."""

import numpy as np
import pytest

from grpo.engine.rollout.paged.pages import PageAllocator, PoolExhausted


def test_random_grow_and_free_never_leaks_or_shares_pages():
    rng = np.random.default_rng(0)
    a = PageAllocator(pages=20, page_size=4, slots=5, max_pages=6)
    tokens = [0] * 5
    for _ in range(400):
        s = int(rng.integers(5))
        if rng.random() < 0.3:
            a.free(s)
            tokens[s] = 0
        else:
            want = tokens[s] + int(rng.integers(1, 9))
            try:
                a.grow(s, min(want, 24))
                tokens[s] = min(want, 24)
            except PoolExhausted:
                pass  # nothing allocated: the invariant below still holds
        a.check()
        for slot in range(5):  # every slot holds exactly the pages its tokens need
            assert len(a.held(slot)) == -(-tokens[slot] // 4)
        table = a.table()
        held = [p for slot in range(5) for p in table[slot, : len(a.held(slot))]]
        assert len(held) == len(set(held)) == a.held_pages
    assert a.peak <= 20


def test_freed_pages_are_reused_and_exhaustion_allocates_nothing():
    a = PageAllocator(pages=4, page_size=2, slots=2, max_pages=4)
    a.grow(0, 5)  # 3 pages
    assert a.held(0) == (0, 1, 2) and a.free_pages == 1
    with pytest.raises(PoolExhausted):
        a.grow(1, 3)  # 2 pages, 1 free
    assert a.held(1) == () and a.free_pages == 1
    assert a.free(0) == 3
    a.grow(1, 8)
    assert sorted(a.held(1)) == [0, 1, 2, 3] and a.peak == 4
    np.testing.assert_array_equal(a.table()[0], [0, 0, 0, 0])
    with pytest.raises(ValueError, match="max_pages"):
        a.grow(1, 9)
    a.check()


def test_shards_take_pages_of_their_own_part():
    a = PageAllocator(pages=6, page_size=2, slots=4, max_pages=3, shards=2)  # slots 0-1: pages 0-2; 2-3: 3-5
    a.grow(0, 4)
    a.grow(2, 6)
    assert a.held(0) == (0, 1) and a.held(2) == (3, 4, 5)
    with pytest.raises(PoolExhausted):
        a.grow(3, 1)  # its shard is full, though shard 0 has a free page
    a.grow(1, 2)
    assert a.held(1) == (2,)
    np.testing.assert_array_equal(a.table()[3], [3, 3, 3])  # unheld: the shard's first page
    a.check()
    with pytest.raises(ValueError, match="divide"):
        PageAllocator(pages=5, page_size=2, slots=4, max_pages=3, shards=2)
