"""Issue 55: the `math` task (MATH-style \\boxed{} answers) on the shipped sample, strict
and math-verify checks, and `grpo task score --solutions`' agreement report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from grpo.core.cli import cli
from grpo.engine.rollout.scoring import score_completions
from grpo.plugins.tasks import MathOptions, MathTask
from grpo.plugins.tasks._common import UnparseableAnswer

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "data" / "math_sample"


def _opts(**kw):
    return MathOptions.model_validate({"data_files": {"train": str(SAMPLE / "train.jsonl"),
                                                      "test": str(SAMPLE / "test.jsonl")}, **kw})


def test_the_sample_loads_with_its_license_and_answers():
    task = MathTask()
    test = task.load(split="test", options=_opts())
    assert len(test) == 8 and sum(1 for _ in open(SAMPLE / "train.jsonl")) == 16
    assert test[0]["ground_truth"] == "1/2" and "MIT" in (SAMPLE / "LICENSE").read_text()
    # Without an answer column, the solution's last \boxed{} is the ground truth.
    assert task.prepare_example({"problem": "p", "solution": "so \\boxed{\\frac{1}{2}}."},
                                options=_opts())["ground_truth"] == "\\frac{1}{2}"
    with pytest.raises(UnparseableAnswer, match="no 'answer' column and no"):
        task.prepare_example({"problem": "p", "solution": "no box"}, options=_opts(), where="row 3")


def test_strict_rewards_without_math_verify():
    task, opts = MathTask(), _opts(answer_check="strict")
    examples = [{"problem": "p", "ground_truth": "\\frac{1}{2}"}] * 4
    completions = ["so \\boxed{\\dfrac{1}{2}}", "\\boxed{0.5}", "the answer is 1/2", "\\boxed{ \\frac{1}{2} }."]
    s = score_completions(task, opts, examples, completions)
    assert [r["correct"] for r in s.rewards] == [1.0, 0.0, 0.0, 1.0]
    assert [r["boxed"] for r in s.rewards] == [1.0, 1.0, 0.0, 1.0]
    assert s.correct == [True, False, False, True] and s.totals == pytest.approx([1.1, 0.1, 0.0, 1.1])


def test_math_verify_rewards_accept_other_forms_of_the_answer():
    pytest.importorskip("math_verify")
    task = MathTask()
    examples = [{"problem": "p", "ground_truth": "\\frac{1}{2}"}] * 4
    completions = ["so \\boxed{\\dfrac{1}{2}}", "\\boxed{0.5}", "the answer is $1/2$", "\\boxed{0.25}"]
    s = score_completions(task, _opts(), examples, completions)
    assert [r["correct"] for r in s.rewards] == [1.0, 1.0, 1.0, 0.0]


def test_task_score_solutions_reports_where_strict_and_math_verify_disagree():
    """The labelled solutions all score correct under math-verify; strict matching misses
    the four whose answer column is written in another form (1/2 for \\frac{1}{2}, 14
    for 14\\text{ cm}^2, "3, -3" for "-3, 3", 120 for 120^\\circ)."""
    pytest.importorskip("math_verify")
    res = CliRunner().invoke(cli, ["task", "score", "math", "--input", str(SAMPLE / "test.jsonl"), "--solutions"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert all(r["correct"] for r in rows)
    assert [i + 1 for i, r in enumerate(rows) if not r["checks"]["strict"]] == [1, 5, 7, 8]
    assert "answer checks strict and math_verify agree on 4 of 8 completion(s)" in res.stderr
    assert "line 5: strict=wrong, math_verify=correct" in res.stderr


def test_gsm8k_labelled_solutions_score_100_percent_by_both_checks():
    """The shipped GSM8K sample's labelled solutions (its answer texts, `#### N` written as
    the answer tag) are all correct, strictly and by math-verify (answer_check: math_verify)."""
    pytest.importorskip("math_verify")
    sample = ROOT / "data" / "gsm8k_sample" / "train.jsonl"
    res = CliRunner().invoke(cli, ["task", "score", "gsm8k", "--input", str(sample), "--solutions",
                                   "--set", "answer_check=math_verify"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == 32 and all(r["correct"] and r["checks"] == {"strict": True, "math_verify": True} for r in rows)


def test_gsm8k_math_verify_accepts_a_fraction_strict_does_not():
    pytest.importorskip("math_verify")
    from grpo.plugins.tasks import GSM8KOptions, GSM8KTask

    ex = [{"question": "q", "answer": "half\n#### 0.5"}] * 3
    done = ["so <answer>\\frac{1}{2}</answer>", "<answer>1/2</answer>", "<answer>0.5</answer>"]
    strict = score_completions(GSM8KTask(), GSM8KOptions(), ex, done)
    verified = score_completions(GSM8KTask(), GSM8KOptions(answer_check="math_verify"), ex, done)
    assert [r["correct"] for r in strict.rewards] == [0.0, 0.0, 1.0]
    assert [r["correct"] for r in verified.rewards] == [1.0, 1.0, 1.0]


def test_solutions_of_a_task_without_them_is_a_user_error(tmp_path):
    res = CliRunner().invoke(cli, ["task", "score", "arithmetic", "--input", str(SAMPLE / "test.jsonl"), "--solutions"])
    assert res.exit_code == 2 and "has no labelled solutions" in res.output
