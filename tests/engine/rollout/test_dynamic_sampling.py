"""Dynamic sampling's group filter (rounds, surplus, short steps) and down-sampling (PODS's
max-variance rule against a brute force, the random rule)."""

from __future__ import annotations

import numpy as np
import pytest


def test_group_filter_rounds_surplus_and_short_steps():
    from grpo.engine.rollout.dynamic_sampling import GroupFilter, group_spread

    np.testing.assert_array_equal(group_spread(np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2), [False, True, False])
    f = GroupFilter(want=3, max_rounds=4)
    f.add(np.array([True, False, False]))
    assert not f.done
    f.add(np.array([True, True, True]))  # one informative group too many: dropped
    assert f.done and not f.short
    assert f.picks() == ([(0, 0), (1, 0), (1, 1)], 0)
    assert f.metrics() == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/uninformative_groups": 2.0,
                           "dynamic_sampling/dropped_groups": 3.0, "dynamic_sampling/filled_groups": 0.0,
                           "dynamic_sampling/short": 0.0}
    with pytest.raises(RuntimeError, match="after the step is complete"):
        f.add(np.array([True, True, True]))
    short = GroupFilter(want=3, max_rounds=2)
    short.add(np.array([False, True, False]))
    with pytest.raises(ValueError, match="3 groups"):
        short.add(np.array([True, False]))
    short.add(np.array([False, False, False]))
    assert short.done and short.short
    assert short.picks() == ([(0, 1), (0, 0), (0, 2)], 2)  # the earliest equal-reward groups fill
    assert short.metrics() == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/uninformative_groups": 5.0,
                               "dynamic_sampling/dropped_groups": 3.0, "dynamic_sampling/filled_groups": 2.0,
                               "dynamic_sampling/short": 1.0}


def test_down_sampling_keeps_the_max_variance_subset():
    """PODS's max-variance rule against a brute force over every subset (random rewards,
    ties, a constant group); the random rule keeps distinct rows of each group."""
    from itertools import combinations

    from grpo.engine.rollout.dynamic_sampling import down_sample

    rng = np.random.default_rng(0)
    n = 8
    groups = [rng.normal(size=n), rng.integers(0, 2, n).astype(float), np.full(n, 0.5),
              np.array([1.0, 0, 0, 0, 0, 0, 0, 0]), rng.integers(0, 3, n) * 0.5]
    rewards = np.concatenate(groups)
    for keep in (2, 3, 4, 7, 8):
        rows = down_sample(rewards, n, keep)
        assert rows.shape == (len(groups) * keep,)
        for g, group in enumerate(groups):
            mine = rows[g * keep:(g + 1) * keep]
            assert np.all(np.diff(mine) > 0) and mine.min() >= g * n and mine.max() < (g + 1) * n
            best = max(np.var(group[list(c)]) for c in combinations(range(n), keep))
            np.testing.assert_allclose(np.var(rewards[mine]), best, rtol=1e-9, atol=1e-12)
    # One right answer among eight: it is kept, with the wrong ones of the earliest rows.
    np.testing.assert_array_equal(down_sample(groups[3], n, 4), [0, 1, 2, 3])
    np.testing.assert_array_equal(down_sample(np.roll(groups[3], 5), n, 3), [0, 1, 5])
    rows = down_sample(rewards, n, 3, rule="random", rng=np.random.default_rng(1))
    again = down_sample(rewards, n, 3, rule="random", rng=np.random.default_rng(1))
    np.testing.assert_array_equal(rows, again)
    for g in range(len(groups)):
        mine = rows[g * 3:(g + 1) * 3]
        assert len(set(mine)) == 3 and all(g * n <= r < (g + 1) * n for r in mine)
    with pytest.raises(ValueError, match="keep must be"):
        down_sample(rewards, n, 9)


def test_random_down_sampling_keeps_the_spread_that_made_a_group_informative():
    """Rewards [1, 0, 0, 0] at keep 2: a uniform subset (the rule before) lost the one
    right answer, and with it every non-zero advantage, in half the draws (3 of the 6
    pairs); the rule now always keeps it, paired with each wrong answer alike. A group
    without a spread still gets a uniform draw; with more than one sample on a side each
    is drawn alike."""
    from grpo.engine.rollout.dynamic_sampling import down_sample

    group = np.array([1.0, 0.0, 0.0, 0.0])
    rng = np.random.default_rng(0)
    uniform = [np.sort(rng.choice(4, size=2, replace=False)) for _ in range(6000)]
    np.testing.assert_allclose(np.mean([0 not in s for s in uniform]), 0.5, atol=0.02)  # the old rule's loss
    draws = [down_sample(group, 4, 2, rule="random", rng=np.random.default_rng(s)) for s in range(3000)]
    assert all(d[0] == 0 for d in draws)  # the right answer is always kept
    np.testing.assert_allclose(np.bincount([d[1] for d in draws], minlength=4)[1:] / 3000, 1 / 3, atol=0.03)
    # Several groups at once, keep 3 of 8: every group with a spread keeps one above and
    # one below its mean; the constant group is drawn uniformly.
    rewards = np.concatenate([np.eye(8)[5], np.full(8, 0.5), np.array([0, 0, 1, 1, 1, 1, 1, 1.0]), np.arange(8.0)])
    for seed in range(200):
        rows = down_sample(rewards, 8, 3, rule="random", rng=np.random.default_rng(seed)).reshape(4, 3)
        for g in (0, 2, 3):
            kept = rewards[rows[g]]
            mean = rewards[g * 8:(g + 1) * 8].mean()
            assert kept.max() > mean > kept.min(), (seed, g, kept)
        assert len(set(rows[1])) == 3


def test_selection_scores_rank_equal_totals_by_the_component_with_a_spread():
    """Under turn credit a group whose totals are equal is ranked by the first scope
    component with a spread, so down-sampling keeps what made it informative; groups
    whose totals differ, and groups equal everywhere, keep their totals."""
    from grpo.engine.rollout.dynamic_sampling import down_sample, selection_scores

    # Group 0: call = [1, 0, 1, 0] on the first turn, prefix = [0, 1, 0, 1] on every turn
    # (equal totals 0.5); group 1 differs in its totals; group 2 is constant.
    first = 0.5 * np.array([1, 0, 1, 0, 1, 0, 0, 0, 1, 1, 1, 1.0])
    every = 0.5 * np.array([0, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0.0])
    totals = first + every
    scores = selection_scores(totals, {"all": every, "first": first}, 4)
    np.testing.assert_array_equal(scores[:4], every[:4])
    np.testing.assert_array_equal(scores[4:], totals[4:])
    np.testing.assert_array_equal(selection_scores(totals, {}, 4), totals)
    for seed in range(50):
        rows = down_sample(scores, 4, 2, rule="random", rng=np.random.default_rng(seed))
        assert np.ptp(every[rows[:2]]) > 0 and np.ptp(totals[rows[2:4]]) > 0
    # max_variance of the scores: one row of each prefix value.
    np.testing.assert_array_equal(down_sample(scores, 4, 2)[:2], [0, 3])


def test_stream_filter_feeds_at_the_rate_seen_keeps_in_finish_order_and_fills_short_steps():
    """The stream's picks against a hand count: the first feed is 2 x want (prior rate
    1/2); later feeds cover the missing groups at the rate seen, less those in flight;
    kept groups are the informative ones in finish order (not feed order); a step full
    leaves the unfinished groups in flight; a short step fills with the uninformative
    groups in finish order once the limit is fed and finished."""
    from grpo.engine.rollout.dynamic_sampling import StreamFilter

    f = StreamFilter(want=3, limit=12)
    assert f.to_feed() == 6
    f.fed = 6
    for g, verdict in [(2, True), (0, False), (5, False), (1, False)]:
        f.add(g, verdict)
    # 1 kept of 4 finished: rate (1 + 1) / (4 + 2) = 1/3, 2 missing -> 6 needed, 2 in flight.
    assert not f.done and f.in_flight == 2 and f.to_feed() == 4
    f.fed = 10
    f.add(4, True)
    f.add(7, True)
    assert f.done and f.to_feed() == 0 and f.in_flight == 4
    assert f.picks() == ([2, 4, 7], 0)
    m = f.metrics()
    assert m["dynamic_sampling/dropped_in_flight"] == 4 and m["dynamic_sampling/dropped_groups"] == 3
    assert m["dynamic_sampling/short"] == 0 and m["dynamic_sampling/rounds"] == 10 / 3

    short = StreamFilter(want=2, limit=3)
    assert short.to_feed() == 3  # capped at the limit
    short.fed = 3
    for g, verdict in [(1, False), (2, True)]:
        short.add(g, verdict)
    assert not short.done and short.to_feed() == 0  # the limit is fed: wait for the last group
    short.add(0, False)
    assert short.done and short.picks() == ([2, 1], 1)
    assert short.metrics()["dynamic_sampling/filled_groups"] == 1 and short.metrics()["dynamic_sampling/short"] == 1
    with pytest.raises(ValueError):
        short.add(3, True)
