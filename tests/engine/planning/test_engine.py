"""The continuous engine's plan figures (grpo/engine/planning/engine.py): pure arithmetic
against hand counts, no compile."""

from __future__ import annotations

import types

import numpy as np
import pytest

from grpo.engine.planning.engine import (ChipRoof, decode_roof, largest_pool, mean_live_tokens, pool_rows,
                                         schedule_seconds, static_decode_seconds, steady_state)

# A toy chip: 1 FLOP/s of compute would dominate nothing; bytes at 1 byte/s.
BYTES_ONLY = dict(weight_bytes=100.0, row_flops=0.0, token_flops=0.0, row_bytes=0.0, token_bytes=2.0, peak=1.0,
                  bw=1.0)


def test_a_chunk_reads_each_slots_pages_and_the_slowest_part_sets_the_step():
    """Two parts of 2 slots, chunk 3, pages of 4 tokens. Part 0: lengths 3 and 8, live 3 and
    1 steps; part 1: lengths 1 and 0 (a free slot), live 2 and 0 steps."""
    roof = ChipRoof(**BYTES_ONLY)
    trace = [{"prefill": 3},
             {"idx": np.array([0, 1, 2, 3]), "width": 3, "lengths": np.array([3, 8, 1, 0]),
              "advance": np.array([3, 1, 2, 0])}]
    out = schedule_seconds(trace=trace, decode=roof, prefill=ChipRoof(**{**BYTES_ONLY, "token_bytes": 0.0}),
                           chunk=3, page_size=4, shards=2, slots=4)
    # Step t attends over length + min(t, advance) + 1 tokens, in whole pages, <= 3 pages.
    # part 0: t0: 4 -> 4, 9 -> 12 (16); t1: 5 -> 8, 10 -> 12 (20); t2: 6 -> 8, 10 -> 12 (20)
    # part 1: t0: 2 -> 4, 1 -> 4 (8);  t1: 3 -> 4, 1 -> 4 (8);   t2: 3 -> 4, 1 -> 4 (8)
    assert out["decode_s"] == pytest.approx(3 * 100 + 2 * (16 + 20 + 20))
    assert out["decode_steps"] == 3
    # The prefill batch of 3 rows is padded to 4, 2 a part: the weights once.
    assert out["prefill_s"] == pytest.approx(100.0)


def test_the_table_width_caps_what_a_slot_reads():
    roof = ChipRoof(**BYTES_ONLY)
    trace = [{"idx": np.array([0]), "width": 1, "lengths": np.array([30]), "advance": np.array([1])}]
    out = schedule_seconds(trace=trace, decode=roof, prefill=roof, chunk=1, page_size=4, shards=1, slots=1)
    assert out["decode_s"] == pytest.approx(100 + 2 * 4)


def test_static_decode_reads_every_rows_segment_until_the_longest_stops():
    roof = ChipRoof(**BYTES_ONLY)
    # Segments (0, 4), (4, 8): 6 steps = 4 at cache 10 + 4, 2 at 10 + 8; 3 rows a chip.
    s = static_decode_seconds(segments=((0, 4), (4, 8)), steps=6, rows_per_chip=3, prompt_length=10, decode=roof)
    assert s == pytest.approx(4 * (100 + 2 * 3 * 14) + 2 * (100 + 2 * 3 * 18))


def test_decode_roof_counts_as_the_plans_decode_step():
    """The same FLOPs and bytes as costs.decode_step_cost for rows at a uniform length."""
    from grpo.engine.planning.costs import decode_step_cost

    dims = types.SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, num_hidden_layers=3, vocab_size=1000)
    roof = decode_roof(dims, weight_bytes=5e6, itemsize=2, tp=2, kv_split=2, peak=1e12, bw=1e9)
    ref = decode_step_cost(dims, rows=8, slots=100, weight_bytes=5e6, itemsize=2, tp=2, kv_split=2)
    assert 8 * roof.row_flops + 800 * roof.token_flops == pytest.approx(ref.flops)
    assert roof.seconds(8, 800) == pytest.approx(max(ref.flops / 1e12, ref.bytes / 1e9))


def test_pool_rows_and_the_largest_pool():
    # 1000 bytes a chip at 10 bytes a page = 100 pages; rows of 5+6 and 5+14 tokens in
    # pages of 4: 3 and 5 pages, mean 4 -> 25 rows a part, 2 parts.
    assert pool_rows(cache_bytes=1000, page_bytes=10, page_size=4, prompts=np.array([5, 5]),
                     completions=np.array([6, 14]), shards=2) == pytest.approx(50)
    # Pool 200 bytes in 20 pages; the programs holding it peak at 900 and 950 of 1000.
    assert largest_pool(hbm=1000, pool_bytes=200, pool_pages=20, peaks=[900, 950]) == {
        "pool_pages": 25, "pool_bytes": 250, "page_bytes": 10}


def test_steady_state_is_a_step_over_its_slots_plus_the_amortised_prefill():
    # Rows of prompt 10 and completions 2 and 4: a live slot's mean length is
    # (2 (10 + 1.5) + 4 (10 + 2.5)) / 6 = 12.1667, + 1.5 for pages of 4.
    p, c = np.array([10, 10]), np.array([2, 4])
    live = mean_live_tokens(prompts=p, completions=c, page_size=4)
    assert live == pytest.approx((2 * 11.5 + 4 * 12.5) / 6 + 1.5)
    dec = ChipRoof(**BYTES_ONLY)
    pre = ChipRoof(**{**BYTES_ONLY, "token_bytes": 0.0, "row_bytes": 20.0})
    st = steady_state(slots=8, shards=2, decode=dec, prefill=pre, prompts=p, completions=c, page_size=4,
                      prefill_rows=2)
    step = 100 + 2 * 4 * live  # 4 slots a part
    pre_row = (100 + 2 * 20) / 2
    per_token = step / 4 + pre_row / 3  # one part's seconds per valid token (mean completion 3)
    assert st["step_s"] == pytest.approx(step)
    assert st["valid_tokens_per_s"] == pytest.approx(2 / per_token)
    assert st["s_per_valid_token"] == pytest.approx(per_token / 2)
    assert st["decode_s_per_valid_token"] == pytest.approx(step / 8)


def test_a_prefill_runs_each_shared_prompt_once():
    """Issue 49 item 7: the continuous engine prefills a group's samples admitted together
    with one forward pass (shared prompts), so the plan counts its FLOPs once per distinct
    prompt, while every row's keys and values are still written into its own pages."""
    pre = ChipRoof(weight_bytes=100.0, row_flops=10.0, token_flops=0.0, row_bytes=3.0, token_bytes=0.0, peak=1.0,
                   bw=1.0)
    one_prompt = [{"prefill": 8, "prompts": 1}]
    out = schedule_seconds(trace=one_prompt, decode=pre, prefill=pre, chunk=1, page_size=4, shards=1, slots=8)
    assert out["prefill_s"] == pytest.approx(max(1 * 10.0, 100.0 + 8 * 3.0))  # bytes: 124, not 8 forwards (80)
    compute = ChipRoof(**{**pre.__dict__, "weight_bytes": 0.0, "row_bytes": 0.0})
    # 5 rows of 3 prompts: padded to 8 rows and 4 prompts, 2 parts -> 2 prompts a part.
    out = schedule_seconds(trace=[{"prefill": 5, "prompts": 3}], decode=compute, prefill=compute, chunk=1,
                           page_size=4, shards=2, slots=8)
    assert out["prefill_s"] == pytest.approx(2 * 10.0)
    # An entry without "prompts" (another engine's trace) is one prompt a row, as before.
    out = schedule_seconds(trace=[{"prefill": 5}], decode=compute, prefill=compute, chunk=1, page_size=4, shards=2,
                           slots=8)
    assert out["prefill_s"] == pytest.approx(4 * 10.0)


def test_the_simulated_engine_counts_the_prompts_each_admission_shares():
    """The schedule's trace names the distinct prompts of each admission (groups of K rows)."""
    from grpo.engine.rollout.paged.core import EngineCore, SimulatedRunner
    from grpo.engine.rollout.paged.pages import PageAllocator
    from grpo.engine.rollout.paged.scheduler import Scheduler

    rows, k = 12, 4
    plen, comp = np.full(rows, 4), np.array([3, 5, 2, 9, 1, 1, 4, 6, 2, 2, 2, 8])
    alloc = PageAllocator(pages=64, page_size=4, slots=8, max_pages=4)
    sched = Scheduler(alloc, prompt_len=plen, cap=9, chunk=2)
    trace: list = []
    core = EngineCore(sched, SimulatedRunner(sched, prompt_len=plen, completions=comp, trace=trace,
                                             groups=np.arange(rows) // k), rows=rows)
    core.run()
    admissions = [e for e in trace if "prefill" in e]
    assert admissions[0] == {"prefill": 8, "prompts": 2}  # rows 0-7: prompts 0 and 1
    assert sum(e["prefill"] for e in admissions) == rows
    for e in admissions[1:]:  # later rows 8-11 (prompt 2) come in as slots free
        assert e["prompts"] == 1
