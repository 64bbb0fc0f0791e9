"""Packing: the host plan (first-fit decreasing, rounding, no split) and the packed arrays
against a plain per-row loop over the padded batch."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from grpo.engine.training.packing import (
    HEAD_BUCKETS,
    balance_bins,
    bin_count_sizes,
    first_fit_decreasing,
    from_head,
    head_width,
    head_widths,
    max_bins_per_device,
    micro_capacity,
    micro_schedule,
    per_grid,
    pack_batch,
    plan_packing,
    round_bins,
    schedule_packing,
    schedule_shapes,
    to_head,
    unpack_logprobs,
)


def _opt_bins(lengths, cap):
    """The optimal bin count by brute force (tiny inputs only)."""
    n = len(lengths)
    for k in range(1, n + 1):
        for assign in itertools.product(range(k), repeat=n):
            loads = [0] * k
            for ln, b in zip(lengths, assign):
                loads[b] += ln
            if max(loads) <= cap:
                return k
    return n


def test_ffd_no_split_and_bounds():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 7 if trial < 60 else 60))
        cap = int(rng.integers(8, 40))
        lengths = rng.integers(1, cap + 1, size=n)
        bins = first_fit_decreasing(lengths, bin_length=cap)
        members = sorted(i for b in bins for i in b)
        assert members == list(range(n))  # every sequence exactly once: never split
        assert all(sum(int(lengths[i]) for i in b) <= cap for b in bins)
        assert len(bins) >= -(-int(lengths.sum()) // cap)  # the volume lower bound
        if n <= 6:
            assert len(bins) <= 11 / 9 * _opt_bins(lengths.tolist(), cap) + 6 / 9
        # FFD is deterministic: a permutation of equal lengths gives the same bin loads.
        again = first_fit_decreasing(lengths.copy(), bin_length=cap)
        assert again == bins


def test_ffd_refuses_an_oversized_sequence():
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing(np.array([5, 11]), bin_length=10)


def test_rounding_and_compile_bound():
    assert round_bins(0, unit=4) == 4
    assert round_bins(5, unit=4) == 8
    assert bin_count_sizes(rows=16, unit=4) == (4, 8, 12, 16)
    rng = np.random.default_rng(1)
    for _ in range(50):
        lengths = rng.integers(1, 33, size=16)
        plan = plan_packing(lengths, bin_length=32, unit=4)
        assert plan.bins in bin_count_sizes(rows=16, unit=4)


def _brute_schedule(bins, devices, max_per):
    """Every (m, per) with m x devices x per >= bins, the smallest total, then fewest m."""
    pairs = [(m, p) for m in range(1, bins + 1) for p in range(1, max_per + 1) if m * devices * p >= bins]
    return min(pairs, key=lambda mp: (mp[0] * mp[1], mp[0]))


def test_micro_schedule_against_brute_force():
    assert micro_schedule(56, devices=8, max_per=4) == (7, 1)  # 56 bins, not 2 x 4 x 8 = 64
    assert micro_schedule(61, devices=8, max_per=4) == (2, 4)  # 64: ties go to fewer micro-batches
    for devices in (1, 2, 8):
        for max_per in (1, 3, 4, 16):
            for bins in range(1, 70):
                assert micro_schedule(bins, devices=devices, max_per=max_per) == _brute_schedule(
                    bins, devices, max_per), (bins, devices, max_per)


def test_shape_grids_and_their_schedules():
    """Issue 50 (coarse buckets): the bins-per-device grids list their widths; a schedule
    on a grid rounds the exact schedule's width up to the grid's next one, with the
    micro-batches that width needs: never more than the exact schedule's, and enough."""
    assert per_grid(4, "exact") == (1, 2, 3, 4)
    assert per_grid(12, "pow2") == (1, 2, 4, 8, 12) and per_grid(8, "pow2") == (1, 2, 4, 8)
    assert per_grid(5, "widest") == (5,)
    with pytest.raises(ValueError, match="bins-per-device grid"):
        per_grid(4, "odd")
    assert micro_schedule(24, devices=8, max_per=4) == (1, 3)
    assert micro_schedule(24, devices=8, max_per=4, pers=(1, 2, 4)) == (1, 4)  # 3 -> 4: 8 padding bins
    assert micro_schedule(24, devices=8, max_per=4, pers=(4,)) == (1, 4)
    for devices in (1, 8):
        for max_per in (1, 5, 16):
            for grid in ("exact", "pow2", "widest"):
                pers = per_grid(max_per, grid)
                for bins in range(1, 70):
                    m0, per0 = micro_schedule(bins, devices=devices, max_per=max_per)
                    m, per = micro_schedule(bins, devices=devices, max_per=max_per, pers=pers)
                    assert per == min(p for p in pers if p >= per0) and m <= m0
                    assert m * devices * per >= bins and (m - 1) * devices * per < bins
    assert schedule_shapes(rows=128, devices=8, max_per=4, pers=(4,)) == {4: [(1, 4), (2, 4), (3, 4), (4, 4)]}


def test_head_buckets():
    """Issue 50: ``head_buckets`` head widths per bin width, each a multiple of
    ``slots / buckets`` in 8s; one bucket is every slot."""
    assert head_widths(slots=96, buckets=1) == (96,)
    assert head_widths(slots=96, buckets=2) == (48, 96)
    assert head_widths(slots=96, buckets=4) == (24, 48, 72, 96)
    assert head_widths(slots=96) == head_widths(slots=96, buckets=HEAD_BUCKETS)
    for buckets in (1, 2, 4, 8):
        for count in range(97):
            k = head_width(count, slots=96, buckets=buckets)
            assert count <= k <= 96 and k in head_widths(slots=96, buckets=buckets)


def test_memory_limit_and_compile_bound():
    # The v6e-8 recipe: 32 rows of 1,280 a micro-batch over 8 chips, bins of 1,280 -> 4.
    assert max_bins_per_device(micro_batch_size=32, devices=8, sequence_length=1280, bin_length=1280) == 4
    assert max_bins_per_device(micro_batch_size=8, devices=8, sequence_length=1280, bin_length=2000) == 1
    shapes = schedule_shapes(rows=128, devices=8, max_per=4)
    assert sorted(shapes) == [1, 2, 3, 4]  # one compiled shape per width
    assert sorted(mp for pairs in shapes.values() for mp in pairs) == sorted(
        {_brute_schedule(b, 8, 4) for b in range(1, 129)})
    for per, pairs in shapes.items():  # every schedule fits the layout of its width
        assert all(m <= micro_capacity(rows=128, devices=8, per=per) for m, _ in pairs)


def test_scheduled_layout():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 33, size=40)
    flat = plan_packing(lengths, bin_length=32)
    plan = schedule_packing(lengths, bin_length=32, devices=4, max_per=2, rows=48)
    m, per = plan.micro_batches, plan.per
    assert (m, per) == micro_schedule(flat.used, devices=4, max_per=2)
    assert plan.row.shape == (micro_capacity(rows=48, devices=4, per=per), 4 * per, 32)
    # The same bins in micro-batch order, padding bins after them, nothing past micro-batch m.
    np.testing.assert_array_equal(plan.segment_ids.reshape(-1, 32)[: flat.used], flat.segment_ids)
    assert not plan.segment_ids.reshape(-1, 32)[flat.used:].any()
    assert plan.bins == m * 4 * per and plan.efficiency == pytest.approx(lengths.sum() / (plan.bins * 32))
    assert plan.segment_ids[m - 1].any()  # the last scheduled micro-batch is not empty


def test_plan_segments_and_positions():
    lengths = np.array([3, 5, 2, 4])
    plan = plan_packing(lengths, bin_length=8, unit=3)
    assert plan.bins == 3 and plan.used == 2  # {5, 3} and {4, 2}, one bin of padding
    assert plan.real_tokens == 14 and plan.efficiency == pytest.approx(14 / 24)
    np.testing.assert_array_equal(plan.segment_ids[0], [1, 1, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(plan.row[0], [1] * 5 + [0] * 3)
    np.testing.assert_array_equal(plan.positions[0], [0, 1, 2, 3, 4, 0, 1, 2])
    np.testing.assert_array_equal(plan.segment_ids[1], [1, 1, 1, 1, 2, 2, 0, 0])
    np.testing.assert_array_equal(plan.positions[1], [0, 1, 2, 3, 0, 1, 0, 0])
    np.testing.assert_array_equal(plan.segment_ids[2], 0)


def _padded_batch(rng, b=6, lp=4, n=5):
    """Left-padded prompts, completions with a mask prefix, per-token arrays."""
    plen = rng.integers(1, lp + 1, size=b)
    clen = rng.integers(1, n + 1, size=b)
    pm = (np.arange(lp)[None] >= lp - plen[:, None]).astype(np.int32)
    cm = (np.arange(n)[None] < clen[:, None]).astype(np.int32)
    pt = np.where(pm > 0, rng.integers(1, 50, size=(b, lp)), 0).astype(np.int32)
    ct = np.where(cm > 0, rng.integers(1, 50, size=(b, n)), 0).astype(np.int32)
    return pt, pm, ct, cm


def test_pack_batch_against_a_row_loop():
    rng = np.random.default_rng(2)
    pt, pm, ct, cm = _padded_batch(rng)
    b, n = ct.shape
    loss_mask = cm * rng.integers(0, 2, size=cm.shape)  # multi-turn: some tokens not trained
    old = rng.normal(size=cm.shape).astype(np.float32)
    adv = rng.normal(size=b).astype(np.float32)
    keys = rng.integers(0, 2**31, size=(b, 2)).astype(np.uint32)
    lengths = pm.sum(1) + cm.sum(1)
    plan = plan_packing(lengths, bin_length=int(lengths.max()) + 3, unit=2)
    packed, place = pack_batch(
        prompt_tokens=pt, prompt_mask=pm, tokens=ct, mask=cm, row=plan.row, index=plan.index,
        segment_ids=plan.segment_ids, loss_mask=loss_mask, advantages=adv, old_logprobs=old, dropout_keys=keys,
    )
    seq_of = {}  # row -> (bin, start)
    for bn in range(plan.bins):
        for s in range(1, plan.segment_ids[bn].max() + 1):
            slots = np.nonzero(plan.segment_ids[bn] == s)[0]
            assert np.all(np.diff(slots) == 1)  # contiguous
            seq_of[int(plan.row[bn, slots[0]])] = (bn, int(slots[0]))
    assert sorted(seq_of) == list(range(b))
    for r, (bn, start) in seq_of.items():
        seq = np.concatenate([pt[r][pm[r] > 0], ct[r][cm[r] > 0]])
        p = int(pm[r].sum())
        sl = slice(start, start + len(seq))
        np.testing.assert_array_equal(np.asarray(packed.tokens[bn, sl]), seq)
        np.testing.assert_array_equal(np.asarray(packed.positions[bn, sl]), np.arange(len(seq)))
        np.testing.assert_array_equal(np.asarray(packed.targets[bn, sl])[:-1], seq[1:])
        # The slot before completion token j predicts it: mask, old log-probs there.
        c = int(cm[r].sum())
        pred = slice(start + p - 1, start + p - 1 + c)
        np.testing.assert_array_equal(np.asarray(packed.mask[bn, pred]), loss_mask[r, :c])
        np.testing.assert_array_equal(np.asarray(packed.trained[bn, pred]), cm[r, :c])
        np.testing.assert_allclose(np.asarray(packed.old_logprobs[bn, pred]), old[r, :c])
        assert np.asarray(packed.mask[bn, sl]).sum() == loss_mask[r].sum()  # nothing else trained
        np.testing.assert_allclose(np.asarray(packed.advantages[bn, sl]), adv[r])
        np.testing.assert_array_equal(np.asarray(packed.dropout_keys[bn, sl]), np.broadcast_to(keys[r], (len(seq), 2)))
    pad = plan.segment_ids == 0
    assert not np.asarray(packed.mask)[pad].any() and not np.asarray(packed.advantages)[pad].any()
    # Unpacking the packed old log-probs gives the row layout back (0 off the completion).
    back = unpack_logprobs(packed.old_logprobs, place, rows=b, length=n)
    np.testing.assert_allclose(np.asarray(back), np.where(cm > 0, old, 0.0))


def test_head_layout_against_a_loop_over_the_bins():
    """The head layout: each device's bins of a micro-batch one row, holding exactly the
    slots that predict a completion token (in order; the plan's width covers the fullest
    row), their sequences renumbered 1.. per row; gathering and scattering back is exact."""
    rng = np.random.default_rng(5)
    pt, pm, ct, cm = _padded_batch(rng, b=10, lp=4, n=6)
    comp = cm.sum(1)
    lengths = pm.sum(1) + comp
    L = int(lengths.max()) + 2
    plan = schedule_packing(lengths, bin_length=L, devices=2, max_per=2, rows=12, completions=comp)
    old = rng.normal(size=cm.shape).astype(np.float32)
    pack = jax.jit(pack_batch, static_argnames=("head_rows", "head"))  # one compile, not an op at a time
    packed, _ = pack(prompt_tokens=pt, prompt_mask=pm, tokens=ct, mask=cm, row=plan.row, index=plan.index,
                     segment_ids=plan.segment_ids, old_logprobs=old, head_rows=2, head=plan.head)
    cap, w, _ = plan.row.shape
    per = w // 2
    index, segments = np.asarray(packed.head_index), np.asarray(packed.head_segments)
    assert index.shape == segments.shape == (cap, 2, plan.head)
    fullest = 0
    for i, d in itertools.product(range(cap), range(2)):
        want_index, want_seg = [], []
        for k in range(per):
            bn = d * per + k
            for s in range(1, plan.segment_ids[i, bn].max() + 1):
                start = int(np.nonzero(plan.segment_ids[i, bn] == s)[0][0])
                r = int(plan.row[i, bn, start])
                p, c = int(pm[r].sum()), int(comp[r])
                want_index += [k * L + start + p - 1 + j for j in range(c)]
                want_seg += [len(set(want_seg)) + 1] * c
        fullest = max(fullest, len(want_index))
        n = len(want_index)
        np.testing.assert_array_equal(index[i, d, :n], want_index)
        assert (index[i, d, n:] == per * L).all()  # past the count: out of range
        np.testing.assert_array_equal(segments[i, d], want_seg + [0] * (plan.head - n))
    assert fullest <= plan.head == head_width(fullest, slots=per * L) < per * L
    # Gathered and scattered back: the per-token array itself (it is 0 off the predicting slots).
    back = jax.jit(lambda x, i: from_head(to_head(x, i), i, bins=w, length=L))(packed.old_logprobs[0],
                                                                               packed.head_index[0])
    np.testing.assert_array_equal(np.asarray(back), np.asarray(packed.old_logprobs[0]))
    assert np.asarray(back).any()


def test_head_widths_bound_the_compiles():
    for slots in (8, 22, 1280, 16 * 1280, 1000):
        widths = head_widths(slots=slots)
        assert len(widths) <= HEAD_BUCKETS and max(widths) == slots
        for count in (0, 1, slots // 3, slots - 1, slots):
            k = head_width(count, slots=slots)
            assert k in widths and count <= k <= slots and (k % 8 == 0 or k == slots)
            assert k - count < -(-slots // HEAD_BUCKETS) + 8  # at most an eighth of the slots (in 8s) wasted


def test_balance_bins_deals_the_completions_evenly():
    """Every bin one slot, at most ``per`` a group, and the fullest group within the
    greedy bound (the mean + the largest bin), against first-fit order's (the long bins
    first: here all in group 0)."""
    counts = np.array([900, 800, 700, 600, 100, 90, 80, 70, 60])
    where = balance_bins(counts, groups=3, per=4)
    assert sorted(where) == sorted(set(where)) and where.max() < 12
    load = np.bincount(where // 4, weights=counts, minlength=3)
    assert np.bincount(where // 4, minlength=3).max() <= 4
    assert load.max() <= counts.sum() / 3 + counts.max()
    assert load.max() == 1300  # the optimum: two of the four long bins share a group, 600 + 700 the least
    assert np.bincount(np.arange(9) // 4, weights=counts).max() == 3000  # first-fit order
