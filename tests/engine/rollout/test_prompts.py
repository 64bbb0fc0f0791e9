"""Prompt order and batches: epochs without replacement, positions that continue the step
order, length buckets and left padding across processes."""

from __future__ import annotations

import numpy as np

from grpo.engine.rollout.prompts import (
    PromptSet,
    bucket_for,
    build_batch,
    default_buckets,
    position_indices,
    process_slice,
    step_indices,
)


def test_step_indices_epochs_without_replacement():
    n, p = 10, 4
    seen = np.concatenate([step_indices(n, step=s, prompts_per_step=p, seed=3) for s in range(5)])  # 20 = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert not np.array_equal(seen[:10], seen[10:])  # a fresh permutation each epoch
    again = np.concatenate([step_indices(n, step=s, prompts_per_step=p, seed=3) for s in range(5)])
    np.testing.assert_array_equal(seen, again)  # a function of (seed, step) only: resumable
    other = np.concatenate([step_indices(n, step=s, prompts_per_step=p, seed=4) for s in range(5)])
    assert not np.array_equal(seen, other)


def test_position_indices_continue_the_step_order():
    """Dynamic sampling draws from a position, not a step: any split of the positions
    gives the order the steps give."""
    n, p = 10, 4
    by_step = np.concatenate([step_indices(n, step=s, prompts_per_step=p, seed=3) for s in range(5)])
    by_position = np.concatenate([position_indices(n, start=a, count=b - a, seed=3)
                                  for a, b in [(0, 3), (3, 11), (11, 12), (12, 20)]])
    np.testing.assert_array_equal(by_step, by_position)


def test_buckets_and_left_padding():
    assert default_buckets(256) == [16, 32, 64, 128, 256]
    assert default_buckets(8) == [8]
    assert bucket_for(17, [16, 32]) == 32
    ps = PromptSet(examples=[{"i": i} for i in range(4)], token_ids=[[5], [6, 7, 8], [9, 9], [1, 2, 3, 4, 5]])
    idx = np.array([0, 1, 2, 3])
    b0 = build_batch(ps, idx, local=process_slice(4, 0, 2), buckets=[4, 8], pad_id=0)
    b1 = build_batch(ps, idx, local=process_slice(4, 1, 2), buckets=[4, 8], pad_id=0)
    # Both processes pad to the bucket of the longest prompt of the global batch (5 -> 8).
    assert b0.tokens.shape == b1.tokens.shape == (2, 8)
    np.testing.assert_array_equal(b0.tokens[1], [0, 0, 0, 0, 0, 6, 7, 8])
    np.testing.assert_array_equal(b0.mask[1], [0, 0, 0, 0, 0, 1, 1, 1])
    assert [e["i"] for e in b1.examples] == [2, 3]
