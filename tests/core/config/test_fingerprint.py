"""A run's identity (issue 49, item 1 "Run identity for --resume"): which config fields
define a run (its fingerprint) and which only extend, observe or lay it out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.core.config import load_config
from grpo.core.config.fingerprint import NOT_IDENTITY, describe, differences, fingerprint, flatten, identity_fields

QUICKSTART = Path(__file__).parents[3] / "configs" / "quickstart.yaml"


def _cfg(**sets):
    return load_config(QUICKSTART, [f"{k}={json.dumps(v)}" for k, v in sets.items()])


def test_every_excluded_path_is_a_config_field():
    """A renamed field must not silently drop out of the exclusion list (and so become part
    of the identity, or worse, leave a stale name here)."""
    fields = flatten(_cfg(**{"loss.mismatch": {"level": "token"}}).model_dump(mode="json"))
    for path in NOT_IDENTITY:
        assert any(k == path or k.startswith(path + ".") for k in fields), path


@pytest.mark.parametrize("field, value", [
    ("train.steps", 2000), ("name", "other"), ("eval.every_n_steps", 7), ("checkpoint.every_n_steps", 3),
    ("logging.every_n_steps", 5), ("logging.plot", False), ("mesh.policy", "host_local"),
    ("rollout.engine", "continuous"), ("rollout.kv_segment", 64), ("train.micro_batch_size", 64),
    ("train.packing.enabled", False), ("model.remat", "full"), ("task.eval_split", "train"),
])
def test_extending_or_observing_a_run_keeps_its_fingerprint(field, value):
    assert fingerprint(_cfg(**{field: value})) == fingerprint(_cfg())


@pytest.mark.parametrize("field, value", [
    ("model.random.overrides.hidden_size", 32), ("model.param_dtype", "bfloat16"), ("train.seed", 1),
    ("train.optimizer.learning_rate", 1e-3), ("task.name", "gsm8k"), ("task.options.max_operand", 8),
    ("rollout.top_p", 0.9), ("rollout.num_generations", 8), ("rollout.max_new_tokens", 4),
    ("loss.objective", "gspo"), ("loss.beta", 0.04), ("train.prompts_per_step", 16),
    ("train.advantage.scale", "none"), ("train.ppo_epochs", 2),
])
def test_what_defines_a_run_changes_its_fingerprint(field, value):
    assert fingerprint(_cfg(**{field: value})) != fingerprint(_cfg())


def test_a_field_added_later_counts_as_identity():
    """The list excludes; everything else (a field a later version adds) defines the run."""
    raw = _cfg().model_dump(mode="json")
    raw["loss"]["new_knob"] = 1
    assert "loss.new_knob" in identity_fields(raw) and fingerprint(raw) != fingerprint(_cfg())


def test_differences_name_each_field_with_both_values():
    old, new = _cfg(), _cfg(**{"train.seed": 3, "train.steps": 10, "model.random.overrides.hidden_size": 32})
    changed = differences(old, new)
    assert [k for k, _, _ in changed] == ["model.random.overrides.hidden_size", "train.seed"]
    assert describe(changed) == "model.random.overrides.hidden_size ('<unset>' -> 32), train.seed (0 -> 3)"
    assert differences(old, new, identity=False) == [("train.steps", 800, 10)]
