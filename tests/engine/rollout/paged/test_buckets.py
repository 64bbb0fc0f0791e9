"""The continuous engine's decode buckets (issue 50): every bucket the scheduler can
select is listed, and with ``train.compile.ahead: all`` a session compiles them all before
its first chunk, so a later rollout compiles no decode."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from grpo.engine.schedule import compiles


def test_decode_buckets_are_every_power_of_two_of_slots_and_pages():
    from grpo.engine.rollout.paged.buckets import decode_buckets

    # 2 parts of 8 slots, tables at most 5 pages: n in 8, 4, 2, 1 a part, W in 5, 4, 2, 1.
    got = decode_buckets(slots=16, shards=2, max_pages=5)
    assert got == [(2 * n, w) for n in (8, 4, 2, 1) for w in (5, 4, 2, 1)]
    assert decode_buckets(slots=1, shards=1, max_pages=1) == [(1, 1)]
    # What the scheduler selects is on the list (n: live slots of the fullest part, padded).
    from grpo.engine.rollout.paged.pages import PageAllocator
    from grpo.engine.rollout.paged.scheduler import Scheduler

    rng = np.random.default_rng(0)
    alloc = PageAllocator(pages=64, page_size=4, slots=16, max_pages=5, shards=2)
    plen = rng.integers(1, 8, size=40)
    sched = Scheduler(alloc, prompt_len=plen, cap=12, chunk=3)
    from grpo.engine.rollout.paged.core import EngineCore, SimulatedRunner

    trace: list = []
    EngineCore(sched, SimulatedRunner(sched, prompt_len=plen, completions=rng.integers(1, 13, size=40), trace=trace),
               rows=40).run()
    taken = {(len(e["idx"]), e["width"]) for e in trace if "idx" in e}
    assert len(taken) > 3 and taken <= set(got)


@pytest.mark.slow
def test_a_continuous_rollout_compiles_no_decode_after_its_first_session():
    """Issue 50: the continuous engine's decode compiles per (live slots, live pages)
    bucket; with ``train.compile.ahead: all`` its first session compiles every bucket
    (:func:`decode_buckets`) before its first chunk, so a later rollout whose rows drain
    differently (new buckets) compiles nothing. Before, each new bucket compiled mid-rollout."""
    from grpo.engine.bench.engines import engine_config
    from grpo.engine.bench.rollout import _build, _random_prompts, _sampler_state, bench_config

    settings = dict(model_path=None, preset="tiny", dtype="float32", batch=16, generations=2, prompt_len=16,
                    new_tokens=8, early_stop=True, early_stop_chunk=32, kv_segment=256, style="legacy",
                    mesh_policy="auto", mesh_shape=None, temperature=1.0, top_k=0, top_p=1.0, seed=0)
    from grpo.core.config import load_config

    raw = bench_config(**settings).model_dump()
    raw["train"]["compile"]["ahead"] = "all"  # a run's default (the bench compiles nothing ahead)
    config = engine_config(load_config(raw), "continuous", {"chunk": 2})
    built = _build(config, settings)
    sampler = built.programs.sampler()
    params, _, _ = _sampler_state(built, settings, 1)
    tokens, mask = _random_prompts(built.arch, built.eos, batch=16, generations=2, prompt_len=16, seed=0)
    key = jax.random.key(0)
    sampler.generate(params, tokens, mask, key, stop_at=np.ones(16, np.int64))  # every row done in one chunk
    first = sampler.last_stats["chunks"]
    before = compiles()
    sampler.generate(params, tokens, mask, key, stop_at=np.arange(16) % 8 + 1)  # rows drain: new buckets
    assert sampler.last_stats["chunks"] > first
    assert compiles() == before


def test_admissions_are_every_padded_rows_and_prompts_a_prefill_can_take():
    """Issue 50: the (admitted rows, distinct prompts) a prefill pads to, each a power of
    two at most the slots (rows) and the rows (prompts): 3 prompts x 2 samples over 4
    slots admit 1-4 rows of 1-3 prompts."""
    from grpo.engine.rollout.paged.buckets import admissions

    assert admissions(slots=4, rows=6, prompts=3) == [(4, 4), (4, 2), (4, 1), (2, 2), (2, 1), (1, 1)]
    assert admissions(slots=8, rows=2, prompts=1) == [(2, 1), (1, 1)]


@pytest.mark.slow
def test_a_continuous_rollout_at_a_width_compiled_ahead_compiles_nothing():
    """Issue 50: the continuous engine's programs at one prompt width, listed by the run's
    schedule (:func:`~grpo.engine.schedule.rollout_shapes` through the engine's
    ``shape_lowerings``: ``start``, ``prefill`` at every admission size, every decode
    bucket) and compiled ahead on abstract weights, are the executables its rollout at
    that width runs: a rollout of 4 rows over 2 slots (a second admission as rows finish)
    compiles nothing. Before, every program of a new prompt width compiled mid-run."""
    from grpo.core.config import load_config
    from grpo.engine.bench.engines import engine_config
    from grpo.engine.bench.rollout import _build, _random_prompts, _sampler_state, bench_config
    from grpo.engine.schedule import _abstract, compile_ahead, rollout_shapes

    settings = dict(model_path=None, preset="tiny", dtype="float32", batch=4, generations=2, prompt_len=16,
                    new_tokens=4, early_stop=True, early_stop_chunk=32, kv_segment=256, style="legacy",
                    mesh_policy="auto", mesh_shape=None, temperature=1.0, top_k=0, top_p=1.0, seed=0)
    raw = bench_config(**settings).model_dump()
    raw["train"]["compile"]["ahead"] = "all"
    config = engine_config(load_config(raw), "continuous", {"chunk": 2, "slots": 2})
    built = _build(config, settings)
    sampler = built.programs.sampler()
    params, _, _ = _sampler_state(built, settings, 1)
    key = jax.random.key(0)
    shapes = rollout_shapes(built.programs, sampler, weights=jax.tree.map(_abstract, params), prompts=2,
                            widths=(16,), key=key, glue=False)
    assert [s.program for s in shapes].count("prefill") == 3  # (2, 2), (2, 1), (1, 1)
    assert compile_ahead(shapes)["failed"] == 0
    tokens, mask = _random_prompts(built.arch, built.eos, batch=4, generations=2, prompt_len=16, seed=0)
    before = compiles()
    sampler.generate(params, tokens, mask, key)
    assert sampler.last_stats["chunks"] > 1
    assert compiles() == before
