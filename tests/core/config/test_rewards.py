"""``task.model_rewards``: reward models and judges in the config (issue 55). Bad entries
exit 2 naming the field, before anything starts."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from conftest import ROOT

from grpo.core.cli import cli
from grpo.core.config import load_config
from grpo.core.config.rewards import JudgeConfig, RewardModelConfig

QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def _set(entries) -> str:
    return "task.model_rewards=" + json.dumps(entries)


def test_both_kinds_load(tmp_path):
    (tmp_path / "rm").mkdir()
    config = load_config(QUICKSTART, [_set([
        {"kind": "reward_model", "name": "rm", "checkpoint": str(tmp_path / "rm")},
        {"kind": "judge", "name": "judge", "template": "Q: {prompt} A: {completion}. Right?", "parser": "yes_no"},
        {"kind": "reward_model", "name": "hub", "checkpoint": "org/some-reward-model", "weight": 0.5},
    ])])
    rm, judge, hub = config.task.model_rewards
    assert isinstance(rm, RewardModelConfig) and isinstance(judge, JudgeConfig)
    assert (judge.model, judge.greedy, hub.weight, rm.dtype) == ("policy", True, 0.5, "bfloat16")
    assert load_config(QUICKSTART).task.model_rewards == []


@pytest.mark.parametrize("entry, message", [
    ({"kind": "reward_model", "name": "rm", "checkpoint": "./missing-rm"},
     "task.model_rewards[0].reward_model.checkpoint: no directory './missing-rm'"),
    ({"kind": "reward_model", "name": "rm"}, "task.model_rewards[0].reward_model.checkpoint"),
    ({"kind": "judge", "name": "j"}, "task.model_rewards[0].judge.template"),
    ({"kind": "judge", "name": "j", "template": "Is {prompt} right?"},
     "task.model_rewards[0].judge.template: a judge's template must place {completion}"),
    ({"kind": "judge", "name": "j", "template": "{completion}", "parser": "nope"},
     "task.model_rewards[0].judge.parser: unknown parser 'nope'"),
    ({"kind": "judge", "name": "total", "template": "{completion}"}, "'total' is reserved"),
    ({"kind": "judge", "name": "j", "template": "{completion}", "model": "/no/such/judge"},
     "task.model_rewards[0].judge.model: no directory '/no/such/judge'"),
    ({"kind": "oracle", "name": "o"}, "task.model_rewards[0]"),
])
def test_bad_entries_exit_2_naming_the_field(entry, message):
    res = CliRunner().invoke(cli, ["config", "validate", QUICKSTART, "--set", _set([entry])])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output
    assert "Traceback" not in res.output


def test_names_are_unique():
    res = CliRunner().invoke(cli, ["config", "validate", QUICKSTART, "--set", _set(
        [{"kind": "judge", "name": "j", "template": "{completion}"}] * 2)])
    assert res.exit_code == 2 and "'j' is used twice" in res.output, res.output


def test_reward_turns_may_name_a_model_reward():
    config = load_config(QUICKSTART, [_set([{"kind": "judge", "name": "j", "template": "{completion}"}]),
                                      "train.advantage.reward_turns={j: last}"])
    assert config.train.advantage.reward_turns == {"j": "last"}


def test_the_head_is_checked_before_start_up(tmp_path):
    """A causal LM given as a reward model, or a reward model as a judge, is refused by
    ``grpo config validate`` from its config.json alone."""
    causal, classifier = tmp_path / "causal", tmp_path / "classifier"
    for d, arch in ((causal, "Qwen2ForCausalLM"), (classifier, "Qwen2ForSequenceClassification")):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "qwen2"}))
    for entry, message in [
        ({"kind": "reward_model", "name": "rm", "checkpoint": str(causal)},
         "reward_model.checkpoint: '" + str(causal) + "' is a Qwen2ForCausalLM checkpoint; a reward model is"),
        ({"kind": "judge", "name": "j", "template": "{completion}", "model": str(classifier)},
         "judge.model: '" + str(classifier) + "' is a Qwen2ForSequenceClassification checkpoint; a judge"),
    ]:
        res = CliRunner().invoke(cli, ["config", "validate", QUICKSTART, "--set", _set([entry])])
        assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output
    config = load_config(QUICKSTART, [_set([{"kind": "reward_model", "name": "rm", "checkpoint": str(classifier)},
                                            {"kind": "judge", "name": "j", "template": "{completion}",
                                             "model": str(causal)}])])
    assert [r.name for r in config.task.model_rewards] == ["rm", "j"]
