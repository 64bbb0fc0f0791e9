"""``rollout.continuous.slots: auto`` (issue 49 item 7): the slot count the engine picks
for a rollout, host arithmetic only."""

from __future__ import annotations

import math

import pytest

from grpo.core.config import load_config
from grpo.engine.rollout.paged.slots import auto_slots


def test_every_row_at_once_without_a_pool_budget():
    # pool_pages 0: the pool is sized for every slot at the cap, so it holds every row.
    for rows in (1, 12, 64, 128, 1000):
        assert auto_slots(rows, shards=8, pool_pages=0, prompt_length=256, cap=1024, page_size=16) == rows


def test_a_given_pool_holds_rows_at_half_the_cap():
    # prompt 64 + cap/2 = 128 tokens = 8 pages of 16 a row; 30 pages a part hold 3 rows, 8 parts 24.
    assert auto_slots(128, shards=8, pool_pages=30, prompt_length=64, cap=128, page_size=16) == 24
    # The same by the rule written out: shards * (pool // ceil((prompt + ceil(cap / 2)) / page)).
    for pool, prompt, cap, page in ((100, 256, 1024, 16), (77, 100, 33, 4), (5, 3, 9, 2)):
        want = min(500, 4 * (pool // math.ceil((prompt + math.ceil(cap / 2)) / page)))
        assert auto_slots(500, shards=4, pool_pages=pool, prompt_length=prompt, cap=cap, page_size=page) == want


def test_bounded_by_the_rows_and_one_row_a_part():
    assert auto_slots(16, shards=2, pool_pages=10_000, prompt_length=8, cap=8, page_size=4) == 16
    # A pool smaller than one row at half the cap still runs a row a part (it may evict).
    assert auto_slots(16, shards=2, pool_pages=3, prompt_length=64, cap=64, page_size=4) == 2
    with pytest.raises(ValueError, match="rows must be >= 1"):
        auto_slots(0)


def test_config_default_is_auto_and_counts_stay_valid():
    base = {"model": {"source": "random", "random": {"preset": "tiny"}}}
    assert load_config(base).rollout.continuous.slots == "auto"
    assert load_config({**base, "rollout": {"continuous": {"slots": 0}}}).rollout.continuous.slots == 0
    assert load_config({**base, "rollout": {"continuous": {"slots": 32}}}).rollout.continuous.slots == 32
