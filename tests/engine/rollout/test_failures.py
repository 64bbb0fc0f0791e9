"""Reward failures that speak (issue 49 item 8): each function's first failure is logged
once and written to the run directory; a function that fails on every row of a step stops
the run with a UserError; not-applicable counts become metrics."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from _glossary import assert_glossary

from grpo.core.errors import UserError
from grpo.engine.rollout.failures import RewardFailures


def test_first_failure_logged_once_and_written(caplog):
    rows = []
    failures = RewardFailures(rows.append, where="RUN/reward_errors.jsonl")
    names = ["exact", "shape"]
    first = {"shape": (3, "TypeError: returned str '1.0'")}
    with caplog.at_level(logging.WARNING, logger="grpo.rewards"):
        # counts: not applicable [exact, shape], rows scored [exact, shape], timeouts [exact, shape]
        metrics = failures.observe(1, names, np.array([0, 2]), np.array([1, 0, 8, 8, 0, 1]), first)
        failures.observe(2, names, np.array([0, 5]), np.array([0, 0, 8, 8, 0, 0]), {"shape": (0, "TypeError: again")})
    # issue 55: a step's failures by kind (2 failures of shape: 1 timed out, 1 raised)
    assert metrics == {"reward/exact/not_applicable": 1.0, "reward/shape/errors": 1.0, "reward/shape/timeouts": 1.0}
    assert rows == [{"step": 1, "reward": "shape", "row": 3, "error": "TypeError: returned str '1.0'"}]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "reward function 'shape' failed at step 1, row 3: TypeError: returned str" in warnings[0]


def test_a_function_failing_on_every_row_of_a_step_stops_the_run():
    rows = []
    failures = RewardFailures(rows.append, where="RUN/reward_errors.jsonl")
    first = {"exact": (0, "TypeError: 'numpy.ndarray' is not a list")}
    with pytest.raises(UserError) as err:
        failures.observe(4, ["exact", "length"], np.array([8, 0]), np.array([0, 0, 8, 8]), first)
    message = str(err.value)
    assert message.startswith("reward function 'exact' failed on every completion of step 4 (8 of 8)")
    assert "the first (row 0): TypeError: 'numpy.ndarray' is not a list" in message
    assert "RUN/reward_errors.jsonl" in message and "\n" not in message
    assert rows and rows[0]["reward"] == "exact"  # written before the run stops


def test_every_row_failing_by_errors_and_timeouts_together_stops_the_run():
    """Issue 55: a function that never computed a value on a step (some rows raised, the
    rest timed out) stops the run, saying how many timed out; one that failed on some rows
    only does not, and a record saved before timeouts were counted (2 * functions) reads."""
    failures = RewardFailures(None)
    with pytest.raises(UserError, match=r"\(8 of 8, 3 of them past task.reward_timeout_s\)"):
        failures.observe(1, ["slow"], np.array([8]), np.array([0, 8, 3]), {"slow": (0, "RewardTimeout: late")})
    assert failures.observe(2, ["slow"], np.array([7]), np.array([0, 8, 7]), None) == {"reward/slow/timeouts": 7.0}
    assert failures.observe(3, ["slow"], np.array([7]), np.array([0, 8]), None) == {"reward/slow/errors": 7.0}


def test_a_judges_parse_failures_count_on_their_own():
    """Issue 55, item 2: a judge's rows without a value (its parser could not read the
    reply) are ``reward/<judge>/parse_failures``, not ``not_applicable`` (a reward model's
    stay there); a judge unreadable on every row does not stop the run (not an error)."""
    failures = RewardFailures(None, judges=["judge"])
    # counts: not applicable [rm, judge], rows scored [rm, judge], timeouts [rm, judge]
    metrics = failures.observe(1, ["rm", "judge"], np.array([2, 0]), np.array([2, 8, 8, 8, 1, 0]), None)
    assert metrics == {"reward/rm/not_applicable": 2.0, "reward/judge/parse_failures": 8.0, "reward/rm/errors": 1.0,
                       "reward/rm/timeouts": 1.0}
    assert_glossary(metrics, "Reward failures")  # issue 52: what the trainer adds to the step's row


def test_no_counts_recorded_reports_failures_without_stopping():
    """A step record saved before the counts existed (an async buffer) still reports."""
    rows = []
    assert RewardFailures(rows.append).observe(1, ["r"], np.array([8]), None, {"r": (0, "E: x")}) == {}
    assert rows == [{"step": 1, "reward": "r", "row": 0, "error": "E: x"}]


FAILING_REWARDS = '''
import numpy as np

def shape(completions, **kwargs):
    return np.asarray([min(len(c), 4) / 4 for c in completions])

def broken(completions, prompts, answer, **kwargs):
    return {"reward": 1.0}  # a mapping: not one number per completion
'''


@pytest.mark.slow
def test_grpo_run_stops_with_exit_2_when_a_reward_fails_on_every_completion(tmp_path, monkeypatch):
    """The newcomer's case: before, the run printed OK with reward_errors=256 and no
    exception text anywhere; now the first failure is logged and kept in the run directory,
    and a function failing on every completion of a step exits 2 with that message, before
    that step's update (the stop used to come after it: one optimizer step on zero rewards)."""
    import json

    import yaml
    from click.testing import CliRunner

    from grpo.core.cli import cli
    from grpo.engine.trainer import Trainer
    from tests._runs import TINY

    updates = []
    optimize = Trainer.optimize
    monkeypatch.setattr(Trainer, "optimize", lambda self, ub: updates.append(self.step) or optimize(self, ub))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_rewards.py").write_text(FAILING_REWARDS)
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n"
                                                 for a in range(8)))
    config = dict(TINY, task={"name": "custom", "options": {"rewards": ["my_rewards:shape", "my_rewards:broken"],
                                                            "data_files": {"train": "sums.jsonl"}}})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(cli, ["run", "c.yaml", "--run-dir", "run"])
    assert result.exit_code == 2, result.output
    assert updates == []  # nothing trained on the failed step
    assert "Traceback" not in result.output
    assert "reward function 'broken' failed on every completion of step 1 (16 of 16)" in result.output
    assert "task.options.rewards[1] (broken) returned dict" in result.output
    logged = [json.loads(line) for line in (tmp_path / "run" / "reward_errors.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward"], r["row"]) for r in logged] == [(1, "broken", 0)]
    assert "returned dict" in logged[0]["error"]
