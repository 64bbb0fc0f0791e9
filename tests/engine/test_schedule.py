"""The run's shape schedule (issue 50, "Compile once"): the packed passes' shapes listed
from the config, compiled ahead of step 1 so that no step compiles, and a compile outside
the list warned of and counted."""

from __future__ import annotations

import logging
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo.engine.schedule import (ProgramShape, ShapeWatch, compile_ahead, compiles, prompt_lengths, shape_list,
                                  submission_order)
from grpo.engine.training.packing import per_grid, schedule_packing, schedule_shapes


def _programs(*, rows, max_per, grid, buckets, bin_length):
    """The slice of RunPrograms that shape_list reads."""
    pers = per_grid(max_per, grid)
    return types.SimpleNamespace(
        shape_grid=(pers, buckets), config=types.SimpleNamespace(bin_length=bin_length),
        schedule_shapes=lambda: schedule_shapes(rows=rows, devices=2, max_per=max_per, pers=pers),
    )


@pytest.mark.parametrize("grid, buckets", [("exact", 8), ("pow2", 4), ("pow2", 1), ("widest", 1)])
def test_shape_list_holds_every_plan_a_step_makes(grid, buckets):
    """Every (per, K) a step's plan takes, over many length draws, is on the list; the
    list's length is the compile bound of each packed pass."""
    rows, length, max_per = 32, 40, 8
    progs = _programs(rows=rows, max_per=max_per, grid=grid, buckets=buckets, bin_length=length)
    listed = set(shape_list(progs))
    assert len(listed) <= len(per_grid(max_per, grid)) * buckets
    seen = set()
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, rows + 1))
        prompts = rng.integers(1, 9, size=n)
        completions = rng.integers(1, 32, size=n) * (rng.random(n) < rng.random())  # some very short
        completions = np.maximum(completions, 1)
        plan = schedule_packing(prompts + completions, bin_length=length, devices=2, max_per=max_per, rows=rows,
                                completions=completions, pers=progs.shape_grid[0], head_buckets=buckets)
        seen.add((plan.per, plan.head))
    assert seen <= listed
    if grid == "widest" and buckets == 1:
        assert listed == {(max_per, max_per * length)}  # one shape: what the CPU default compiles


def test_compiled_ahead_executable_is_the_one_a_call_runs():
    """A program compiled ahead on abstract arguments (the shardings a call gives it) is
    not compiled again when called on concrete ones: jit's cache holds it."""
    sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    fn = jax.jit(lambda x, m: jax.lax.fori_loop(0, m, lambda i, c: c + x[i].sum(), 0.0))
    lines = []
    shapes = [ProgramShape("f", f"rows={r}", lambda r=r: fn.lower(
        jax.ShapeDtypeStruct((r, 4), jnp.float32, sharding=sh), jax.ShapeDtypeStruct((), jnp.int32, sharding=sh)))
        for r in (2, 3)]
    stats = compile_ahead(shapes, workers=2, progress=lines.append)
    assert stats["programs"] == 2 and stats["failed"] == 0 and lines[0] == "compiling 2 programs: 0/2" and lines[-1] == "compiling 2 programs: 2/2"
    xs = [jax.device_put(np.ones((r, 4), np.float32), sh) for r in (2, 3)]
    m = jax.device_put(np.int32(2), sh)
    before = compiles()
    assert [float(fn(x, m)) for x in xs] == [8.0, 8.0]
    assert compiles() == before
    fn(jax.device_put(np.ones((5, 4), np.float32), sh), m)  # not compiled ahead
    assert compiles() == before + 1


def test_a_shape_that_fails_to_compile_ahead_is_logged_not_fatal(caplog):
    def broken():
        raise ValueError("no such layout\nsecond line")

    ok = jax.jit(lambda x: x + 1)
    shapes = [ProgramShape("packed", "per=3 K=8", broken),
              ProgramShape("f", "x", lambda: ok.lower(jax.ShapeDtypeStruct((2,), jnp.float32)))]
    with caplog.at_level(logging.WARNING, logger="grpo.engine.schedule"):
        stats = compile_ahead(shapes, progress=lambda _: None)
    assert stats["programs"] == 2 and stats["failed"] == 1
    [record] = caplog.records
    assert "packed (per=3 K=8) ahead failed" in record.getMessage() and "no such layout" in record.getMessage()


def test_out_of_list_shape_warns_and_counts(caplog):
    """Once armed, a watched program that compiles (a shape not compiled ahead) logs a
    warning naming the program and the shape, and is counted once per compile."""
    watch = ShapeWatch()
    fn = watch.wrap("update", jax.jit(lambda x: x * 2))
    x2, x3 = np.ones((2, 7), np.float32), np.ones((3, 7), np.float32)
    fn(x2)  # step 1: compiles, unwatched
    watch.armed = True
    with caplog.at_level(logging.WARNING, logger="grpo.engine.schedule"):
        fn(x2)
        assert watch.out_of_list == 0 and not caplog.records
        fn(x3)
    assert watch.take() == 1 and watch.take() == 0 and watch.total == 1
    [record] = caplog.records
    assert "compiled update" in record.getMessage() and "float32[3, 7]" in record.getMessage()
    assert fn.lower(x3).compile() is not None  # the program's own attributes pass through


@pytest.mark.slow
def test_step_widths_are_the_widths_the_run_s_steps_take():
    """Issue 50: the prompt widths listed ahead for a run without dynamic sampling are
    exactly those its steps' batches take (each step's prompts from the data order, the
    bucket of the longest; checked step by step, across an epoch boundary and from a
    resumed position), which for a short run are fewer than every bucket the split's
    prompts reach: nothing compiles ahead that no step runs."""
    from grpo.engine.rollout.prompts import bucket_for, position_indices
    from grpo.engine.schedule import reachable_widths, step_widths

    rng = np.random.default_rng(0)
    token_ids = [[1] * int(n) for n in rng.integers(3, 40, size=50)]
    token_ids[7] = [1] * 64  # one long prompt: the 64 bucket, reached only by the step holding it
    buckets = [8, 16, 32, 64]
    for position, steps, prompts in ((0, 3, 4), (40, 9, 3), (13, 1, 8), (0, 30, 5)):
        want = set()
        for s in range(steps):
            idx = position_indices(50, start=position + s * prompts, count=prompts, seed=3)
            want.add(bucket_for(max(len(token_ids[i]) for i in idx), buckets))
        got = step_widths(token_ids, buckets, position=position, steps=steps, prompts=prompts, seed=3)
        assert got == tuple(sorted(want)), (position, steps, prompts)
    assert reachable_widths(token_ids, buckets) == (8, 16, 32, 64)
    short = step_widths(token_ids, buckets, position=0, steps=2, prompts=4, seed=3)
    assert len(short) < 4 and step_widths(token_ids, buckets, position=0, steps=0, prompts=4, seed=3) == ()


def test_length_varying_run_compiles_nothing_after_step_1(tmp_path):
    """Issue 50: a run whose completions vary in length (a random policy's, stopped at its
    chance EOS), its packed shapes compiled ahead (two head widths here), compiles nothing
    after step 1 though its steps take every listed shape: step 1 its own plan's, step 2
    the same plan at the wider head width (the shapes a longer step takes). Its prompts
    straddle two prompt buckets (12-14 tokens over buckets 13 and 16): step 1's batch is
    13 wide, step 2's 16, so the rollout's prefill and decode and the glue's ``to_train``
    at width 16, compiled ahead from the train split's prompts, are what step 2 runs
    (before, they compiled in step 2: 3 compiles)."""
    from _runs import _config

    from grpo.engine.trainer import Trainer

    cfg = _config(**{"train.steps": 3, "train.packing.bins_per_device": "widest", "train.packing.head_buckets": 2,
                     "train.compile.ahead": "all", "task.options.max_operand": 12, "rollout.prompt_buckets": [13, 16],
                     "rollout.max_prompt_length": 16})
    trainer = Trainer(cfg, tmp_path / "run")
    listed = shape_list(trainer.programs)
    # (per, K): the widest per, its head on every slot and on about half of them
    assert len(listed) == 2 and listed[0][1] == listed[0][0] * cfg.bin_length > listed[1][1] and listed[1][0] == listed[0][0]
    counts, taken, seen = [], [], [0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _d, **_k: seen.__setitem__(0, seen[0] + 1) if event.endswith("backend_compile_duration") else None)
    step, plan_of = trainer.train_step, trainer.programs.pack_plan

    def counted_step():
        before = seen[0]
        row = step()
        counts.append(seen[0] - before)
        return row

    def plan_then_widen(batch):
        plan = plan_of(batch)
        if len(taken) == 1:  # step 2: the widest head
            plan = plan._replace(head=listed[0][1])
        taken.append((plan.per, plan.head))
        return plan

    widths, build = [], trainer.collector.sampler.sample

    def sample(params, tokens, *args):
        widths.append(tokens.shape[1])
        return build(params, tokens, *args)

    ahead = trainer._train_widths()  # the packed chains' widths: both buckets, each a step's
    assert ahead == (13, 16) == prompt_lengths(trainer.programs)
    trainer.train_step, trainer.programs.pack_plan = counted_step, plan_then_widen
    trainer.collector.sampler.sample = sample
    summary = trainer.run()
    assert widths[:2] == [13, 16]  # step 2 reaches the second bucket
    # the packed chains at both buckets; prefill, decode and to_train at both widths
    assert summary["compiled_ahead"]["programs"] == len(listed) * len(ahead) + 2 * 3
    assert counts[0] > 0 and counts[1:] == [0, 0]
    assert set(taken) == set(listed), taken
    assert trainer.programs.watch.total == 0


def test_the_schedule_lists_every_shape_for_every_prompt_bucket_and_first_only_the_widest(tmp_path, monkeypatch):
    """``all``: a chain per (per, K) of the grid and prompt width (``pack`` takes the
    padded batch, as wide as the step's bucket): every bucket, or the widths given;
    ``first``: the widest shape at the widest width only (the most memory a step needs).
    Listing compiles nothing."""
    from _runs import _config

    from grpo.engine import schedule
    from grpo.engine.schedule import packed_shapes
    from grpo.engine.trainer import Trainer

    cfg = _config(**{"rollout.max_prompt_length": 40, "train.packing.bins_per_device": "pow2",
                     "train.packing.head_buckets": 2, "train.steps": 2})
    trainer = Trainer(cfg, tmp_path / "run")
    progs = trainer.programs
    before = compiles()
    state = dict(params=trainer.params, opt_state=trainer.opt_state, frozen=trainer.frozen)
    every, first = packed_shapes(progs, **state), packed_shapes(progs, **state, first=True)
    assert compiles() == before
    buckets = prompt_lengths(progs)
    assert buckets == (16, 32, 40)
    pairs = shape_list(progs)
    assert len(pairs) > 2 and pairs[0] == max(pairs)
    assert [s.shape for s in every] == [f"per={p} K={k} prompt={lp}" for p, k in pairs for lp in buckets]
    assert {s.program for s in every} == {"packed"}
    assert [s.shape for s in first] == [f"per={pairs[0][0]} K={pairs[0][1]} prompt=40"]
    # Issue 50: at the widths the run's steps take, no other (the trainer's list, taken here
    # without compiling it): its packed chains, the first ahead of the rollout's programs.
    narrow = packed_shapes(progs, **state, widths=(16,))
    assert [s.shape for s in narrow] == [f"per={p} K={k} prompt=16" for p, k in pairs]
    assert [s.shape for s in packed_shapes(progs, **state, widths=(16, 32), first=True)] == [
        f"per={pairs[0][0]} K={pairs[0][1]} prompt=32"]
    widths = trainer._train_widths()
    assert 0 < len(widths) < len(buckets)  # the tiny run's steps never take the widest buckets
    monkeypatch.setattr(schedule, "start_compile", lambda shapes, **_: shapes)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    listed = trainer.compile_ahead()
    packed = [s for s in listed if s.program == "packed"]
    assert [s.shape for s in packed] == [f"per={p} K={k} prompt={lp}" for p, k in pairs for lp in widths]
    assert listed[0] is packed[0] and listed[1].program != "packed"
    assert compiles() == before


def test_submission_order_starts_the_longest_compile_first():
    """Issue 50: on two workers or more the first packed chain (the update's compile, the
    longest) goes first, then the rollout's programs (step 1 rolls out once they are
    compiled), then the other chains; on one worker the rollout's first."""
    rollout = [ProgramShape(n, "", None) for n in ("prefill", "decode", "to_train")]
    packed = [ProgramShape("packed", f"per={p}", None) for p in (4, 2)]
    names = lambda shapes: [s.program + s.shape for s in shapes]  # noqa: E731
    assert names(submission_order(rollout, packed, workers=2)) == [
        "packedper=4", "prefill", "decode", "to_train", "packedper=2"]
    assert submission_order(rollout, packed, workers=1) == rollout + packed
    assert submission_order(rollout, [], workers=4) == rollout and submission_order([], packed) == packed


@pytest.mark.slow  # ~40 s: a two-step tiny run and its plan's listing (nothing compiled for the TPU)
def test_a_quantized_run_lists_its_quantize_program_and_compiles_nothing_out_of_list(tmp_path):
    """Issue 53, item 6: the once-per-sync quantize program (int8 weights and head) is one
    of the run's listed programs: the training engine's watched (``compile/out_of_list``
    0 on every step, though every step quantizes anew), evaluation's as ``eval_quantize``,
    and ``grpo plan`` lists exactly the programs the run ran, these two included."""
    pytest.importorskip("libtpu")
    from _runs import _config
    from grpo.engine.planning.plan import Planner
    from grpo.engine.runs.metrics import read_metrics
    from grpo.engine.schedule import Watched
    from grpo.engine.trainer import Trainer

    config = _config(**{"train.steps": 3, "rollout.quantization": {"weights": "int8", "head": "int8"},
                        "eval": {"every_n_steps": 1, "num_examples": 4, "batch_size": 4}})
    trainer = Trainer(config, tmp_path)
    trainer.run()
    assert isinstance(trainer.programs.sampler().quantize_jit, Watched)
    assert [row["compile/out_of_list"] for row in read_metrics(tmp_path)] == [0.0, 0.0, 0.0]
    ran = {name for name, fns in trainer.programs.jitted().items() if any(f._cache_size() for f in fns)}
    planner = Planner("v6e-8")
    listed = {name for name, *_ in planner.programs_to_compile(planner.subject(config))}
    assert ran == listed and {"quantize", "eval_quantize"} <= ran
