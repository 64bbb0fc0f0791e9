"""The plan's ``compile`` section (issue 50: `grpo plan` reports the programs and shapes a
run compiles and the TPU compiler's time for them). No libtpu needed: the results are
given, and the shape counts come from the config's schedule and buckets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo.core.config import load_config
from grpo.engine.planning.compiled import ProgramResult, compile_report, run_shapes
from grpo.engine.planning.report import format_compile

QUICK = {"rollout": {"max_prompt_length": 16, "max_new_tokens": 2}, "task": {"name": "arithmetic"}}


def _programs(**sets):
    config = load_config(QUICK, [f"{k}={v}" for k, v in sets.items()])
    # bins of 18 tokens (16 + 2); a step schedules at 1 or 2 bins per device per micro-batch
    return SimpleNamespace(config=config, packing=config.train.packing.enabled,
                           schedule_shapes=lambda: {1: [(4, 1)], 2: [(2, 2), (1, 2)]})


def test_run_shapes_count_packed_layouts_head_widths_and_prompt_buckets():
    names = ["prefill", "decode", "row_sums", "pack", "unpack", "update", "eval_prefill", "eval_decode"]
    got = run_shapes(_programs(), names)
    # per 1: 18 slots, head widths 8, 16, 18; per 2: 36 slots, 8, 16, 24, 32, 36 (units of 8).
    assert got == {"prefill": 1, "decode": 1, "row_sums": 1, "pack": 2, "unpack": 2, "update": 3 + 5,
                   "eval_prefill": 1, "eval_decode": 1}
    bucketed = run_shapes(_programs(**{"rollout.prompt_buckets": "[8,16]"}), names)
    assert {n: bucketed[n] for n in ("prefill", "decode", "eval_prefill", "eval_decode")} == dict.fromkeys(
        ("prefill", "decode", "eval_prefill", "eval_decode"), 2)
    assert run_shapes(_programs(**{"train.packing.enabled": "false"}), ["update", "pack"]) == {"update": 1, "pack": 1}


def test_compile_report_sums_what_was_compiled_and_estimates_every_shape():
    def result(name, lower, wall, cpu, error=None):
        return ProgramResult(name, None if error else {}, {}, error, (), lower_s=lower, compile_s=wall,
                             compile_cpu_s=cpu)

    results = [result("prefill", 0.5, 2.0, 1.5), result("update", 1.0, 4.0, 3.0),
               result("decode", 0.25, None, None, error="RESOURCE_EXHAUSTED")]  # failed while lowering
    rep = compile_report(results, {"prefill": 2, "update": 8})
    assert rep["programs"] == 3 and rep["shapes"] == 2 + 8 + 1
    assert rep["lower_s"] == pytest.approx(1.75)
    assert rep["compile_s"] == pytest.approx(6.0) and rep["compile_cpu_s"] == pytest.approx(4.5)
    assert rep["run_compile_cpu_s"] == pytest.approx(2 * 1.5 + 8 * 3.0)
    assert rep["by_program"]["update"] == {"shapes": 8, "lower_s": 1.0, "compile_s": 4.0, "compile_cpu_s": 3.0}
    line = format_compile(rep, "v6e-8")
    assert line.startswith("compiles: 3 programs, 11 shapes a run can compile; the TPU compiler (libtpu) took 4.5 s")
    assert "about 27 s of CPU for all 11 shapes" in line
