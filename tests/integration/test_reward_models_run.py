"""GRPO against a reward model raises its score, with a judge beside it (issue 55: reward
model and judge end to end on the quickstart)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ROOT

from grpo.core.config import load_config
from grpo.engine.runs.metrics import read_metrics
from grpo.engine.trainer import Trainer
from tests._reward_models import preferring_checkpoint


@pytest.mark.slow
def test_grpo_raises_the_reward_model_score(tmp_path):
    """The quickstart's prompts, the task's own rewards weighted 0, a reward model that
    prefers completions ending in "7": its mean score rises within 12 steps. The policy's
    initial weights judge every completion beside it (weight 0: logged, not trained on);
    the tiny random judge's replies are mostly unreadable, and each parse failure is
    counted on its own in ``reward/judge/parse_failures`` (issue 55, item 2), not in
    ``not_applicable``."""
    rm = preferring_checkpoint("7")
    rewards = [
        {"kind": "reward_model", "name": "rm", "checkpoint": str(rm), "dtype": "float32",
         "template": "{prompt}{completion}", "micro_batch": 64, "max_length": 32},
        {"kind": "judge", "name": "judge", "weight": 0.0, "template": "{prompt}{completion} score:",
         "parser": "number", "max_new_tokens": 2, "max_prompt_length": 32, "micro_batch": 64},
    ]
    config = load_config(str(ROOT / "configs" / "quickstart.yaml"), [
        "train.steps=12", "rollout.num_generations=8", "train.optimizer.learning_rate=5e-3",
        "task.options.reward_weights={correct: 0, prefix: 0}", "task.model_rewards=" + json.dumps(rewards),
        "eval.every_n_steps=0", "checkpoint.every_n_steps=0", "checkpoint.at_end=false",
        "logging.progress_bar=false", "logging.plot=false",
    ])
    trainer = Trainer(config, tmp_path)
    trainer.run()
    rows = read_metrics(trainer.run_dir)
    rm_mean = np.asarray([r["reward/rm/mean"] for r in rows])
    assert len(rows) == 12
    assert rm_mean[-3:].mean() > rm_mean[:3].mean() + 0.3, rm_mean
    np.testing.assert_allclose([r["reward/mean"] for r in rows], rm_mean, atol=1e-5)  # the only weighted reward
    judge = trainer.collector.model_rewards.rewards([]).scorers[1]
    failures = sum(r.get("reward/judge/parse_failures", 0) for r in rows)
    assert failures == judge.failures > 0 and not any("reward/judge/not_applicable" in r for r in rows)
    assert all("reward/judge/mean" in r for r in rows)
