"""Config problems in one pass, each naming its field, with "did you mean" for keys
(issue 49, item 8: "config errors come in two passes")."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from conftest import ROOT

from grpo.core.cli import cli
from grpo.core.config import load_config
from grpo.core.errors import ConfigError

QUICKSTART = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())


def _problems(overrides, data=None, env=None):
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART if data is None else data, overrides, env=env or {})
    return err.value.problems


def test_every_kind_of_problem_is_reported_in_one_pass(tmp_path):
    """An unknown key, a bad value, an unknown plugin name, a bad plugin option and two
    checks across fields, all in one `grpo config validate` (exit 2, no traceback). Before,
    the unknown key and the bad value came first, the rest only once they were fixed."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(QUICKSTART))
    sets = ["rollout.tempurature=2", "train.steps=0", "loss.objective=gpso", "task.options.max_operand=x",
            "train.micro_batch_size=3", "train.async.partial_rollouts=true"]
    result = CliRunner().invoke(cli, ["config", "validate", str(path), *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("  - ")]
    expected = [
        "rollout.tempurature: unknown field",
        "train.steps: Input should be greater than or equal to 1",
        "loss.objective: Unknown objective plugin 'gpso'",
        "task.options.max_operand: Input should be a valid integer",
        "train.micro_batch_size=3 must divide the sequences per step",
        "train.async.partial_rollouts=true needs train.async.enabled=true",
    ]
    for start in expected:
        assert sum(line.startswith(f"  - {start}") for line in lines) == 1, (start, result.output)
    assert len(lines) == len(expected), result.output


@pytest.mark.parametrize(
    "override, message",
    [
        ("trian.steps=3", "trian: unknown field; did you mean train?"),
        ("rollout.tempurature=2", "rollout.tempurature: unknown field; did you mean rollout.temperature?"),
        ("train.async.max_stalenes=2", "train.async.max_stalenes: unknown field; did you mean train.async.max_staleness?"),
        # Nothing close at its own level: the field of that name in another section.
        ("train.temperature=2", "train.temperature: unknown field; did you mean rollout.temperature?"),
        # Plugin options: against the plugin's own fields.
        ("task.options.max_operandd=3", "task.options.max_operandd: unknown field; did you mean task.options.max_operand?"),
        ("mesh.options.tpp=1", "mesh.options.tpp: unknown field; did you mean mesh.options.tp?"),
    ],
)
def test_a_mistyped_key_gets_did_you_mean(override, message):
    """Before issue 49 item 8 a mistyped key said only "unknown field"; plugin names
    already had "did you mean"."""
    [problem] = _problems([override])
    assert problem.startswith(message), problem


def test_a_key_with_nothing_close_still_says_where_the_fields_are_listed():
    [problem] = _problems(["zzz=1"])
    assert problem.startswith("zzz: unknown field") and "grpo config schema" in problem


def test_a_default_standing_in_for_a_refused_value_is_never_refused_itself():
    """The checks after the schema see a refused field's default in its place; what they
    find about that default is left out (the user wrote something else)."""
    # prompts_per_step refused; the stand-in 16 would not divide by 3 either: not reported.
    assert _problems(["train.prompts_per_step=x", "train.micro_batch_size=3"]) == [
        "train.prompts_per_step: Input should be a valid integer, unable to parse string as an integer (got 'x')"
    ]
    # model.source refused; its default `hf` needs a model.path the user never had to give.
    [problem] = _problems(["model.source=rand"])
    assert problem.startswith("model.source:") and "model.path" not in problem


def test_an_unset_environment_variable_is_reported_with_the_rest():
    data = {**QUICKSTART, "train": {**QUICKSTART["train"], "steps": "${GRPO_TEST_UNSET}"}}
    problems = _problems(["loss.objective=gpso"], data=data)
    assert problems[0] == "train.steps: environment variable ${GRPO_TEST_UNSET} is not set"
    assert problems[1].startswith("loss.objective: Unknown objective plugin 'gpso'")
    assert len(problems) == 2, problems  # no second problem about the unresolved text itself


def test_truncated_policy_needs_a_loss_that_truncates_and_is_a_no_op_without_top_k_or_top_p(tmp_path):
    """Issue 49 item 5: ``loss.truncated_policy: true`` with top-p and the fused pallas
    kernel (which keeps no logits to filter) is refused by `grpo config validate`, exit 2,
    naming the fields; with the jax loss the trainer's settings carry the rollout's
    truncation; without top-k/top-p it changes nothing (not an error)."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(QUICKSTART))
    sets = ["loss.truncated_policy=true", "rollout.top_p=0.9", "loss.impl=pallas"]
    result = CliRunner().invoke(cli, ["config", "validate", str(path), *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 2 and "Traceback" not in result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("  - ")]
    for field in ("loss.truncated_policy=true", "rollout.top_p=0.9", "loss.impl='pallas'", "loss.impl=jax"):
        assert field in line, line
    assert CliRunner().invoke(cli, ["config", "validate", str(path), "--set", "loss.truncated_policy=true",
                                    "--set", "loss.impl=pallas"]).exit_code == 0
    settings = load_config(QUICKSTART, ["loss.truncated_policy=true", "rollout.top_p=0.9", "rollout.top_k=20"]).loss_settings
    assert (settings.top_k, settings.top_p, settings.truncates) == (20, 0.9, True)
    assert not load_config(QUICKSTART, ["rollout.top_p=0.9"]).loss_settings.truncates  # the default: false
    # No truncation in the rollout: the very settings of truncated_policy=false.
    assert load_config(QUICKSTART, ["loss.truncated_policy=true"]).loss_settings == load_config(QUICKSTART).loss_settings


@pytest.mark.parametrize("sets, expected", [
    # issue 54: replay or router losses without a mixture-of-experts model
    (["model.moe.router_replay=rollout"],
     ["model.moe.router_replay=rollout needs a mixture-of-experts model, but model.random.preset='tiny' is dense"]),
    (["model.moe.router_z_loss=0.001"], ["model.moe.router_z_loss=0.001 needs a mixture-of-experts model"]),
    # ... and in the modes that do not carry the routed experts yet
    (["model.random.preset=tiny-moe", "model.moe.router_replay=rollout", "task.name=lookup", "task.options={}",
      "rollout.engine=continuous"],
     ["model.moe.router_replay=rollout with a multi-turn task (task 'lookup' has tools) needs rollout.engine: static "
      "(rollout.engine='continuous' records the experts of single-turn rows only)"]),
    (["model.random.preset=tiny-moe", "model.moe.load_balancing_loss=0.01", "loss.aggregation=sequence_mean"],
     ["model.moe.load_balancing_loss needs loss.aggregation: token_mean (got 'sequence_mean'"]),
    # issue 54, the expert mesh axis: with a dense model, or not dividing the experts
    (["mesh.expert_parallel=2"],
     ["mesh.expert_parallel=2 needs a mixture-of-experts model, but model.random.preset='tiny' is dense"]),
    (["model.random.preset=tiny-moe", "mesh.expert_parallel=3"],
     ["mesh.expert_parallel=3 does not divide the model's 8 experts"]),
])
def test_moe_options_are_refused_where_they_cannot_work(tmp_path, sets, expected):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(QUICKSTART))
    result = CliRunner().invoke(cli, ["config", "validate", str(path), *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = [line[4:] for line in result.output.splitlines() if line.startswith("  - ")]
    assert len(lines) == len(expected) and all(line.startswith(e) for line, e in zip(lines, expected)), lines


def test_router_replay_needs_an_engine_that_records_routing(tmp_path, monkeypatch):
    """Issue 54: an engine plugin that does not declare ``records_routing`` (a throwaway
    one registered for this test) is refused with router replay, naming rollout.engine."""
    import types

    import grpo
    from grpo.core import plugins

    class Unrouted(grpo.RolloutEnginePlugin):
        name = "unrouted"
        description = "An engine that records no routing (tests)."
        Options = grpo.NoOptions

        def build(self, context, options):
            raise AssertionError("validate builds no engine")

    module = types.ModuleType("unrouted_engine")
    module.register_rollout_engines = grpo.hookimpl(lambda register: register(Unrouted()))
    module.register_rollout_engines.__name__ = "register_rollout_engines"
    loaded = plugins.load_plugins(entry_points=False, extra_modules=[module])
    monkeypatch.setattr(plugins, "get_plugins", lambda: loaded)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(QUICKSTART))
    sets = ["model.random.preset=tiny-moe", "model.moe.router_replay=rollout", "rollout.engine=unrouted"]
    result = CliRunner().invoke(cli, ["config", "validate", str(path), *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert ("model.moe.router_replay=rollout needs an engine that records the routed experts (rollout.engine: static "
            "or continuous; rollout.engine='unrouted' does not)") in " ".join(result.output.split())


def test_expert_axis_must_divide_the_fsdp_axis_of_the_topology(tmp_path):
    """Issue 54: ep=4 on 6 devices (auto: fsdp=6) is refused naming mesh.expert_parallel
    (exit 2); on 8 it passes."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(QUICKSTART))
    sets = ["--set", "model.random.preset=tiny-moe", "--set", "mesh.expert_parallel=4", "--set", "train.prompts_per_step=6"]
    result = CliRunner().invoke(cli, ["config", "validate", str(path), *sets, "--processes", "1", "--local-devices", "6"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "mesh.expert_parallel=4 does not divide the fsdp axis of mesh {'dp': 1, 'fsdp': 6, 'tp': 1}" in result.output
    result = CliRunner().invoke(cli, ["config", "validate", str(path), *sets[:4], "--processes", "1", "--local-devices", "8"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("mode", [
    [],
    ["train.async.enabled=true", "train.async.max_staleness=1"],  # issue 54: the ids ride in the async buffer
    ["rollout.engine=continuous"],  # ... and the continuous engine records them, partial rollouts included
    ["rollout.engine=continuous", "train.async.enabled=true", "train.async.partial_rollouts=true"],
    ["distributed.mode=auto"],  # ... and over several processes, gathered with the rows
    ["task.name=lookup", "task.options={}"],  # ... and the static engine's multi-turn rows
])
def test_moe_options_pass_with_a_mixture_of_experts_model(tmp_path, mode):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(QUICKSTART))
    sets = ["model.random.preset=tiny-moe", "model.moe.router_replay=rollout", "model.moe.load_balancing_loss=0.01",
            *mode]
    result = CliRunner().invoke(cli, ["config", "validate", str(path), *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 0, result.output


def test_reward_scoring_and_process_rewards_are_checked_naming_the_fields(tmp_path):
    """Issue 55: `grpo config validate` refuses overlapped scoring on an engine that does
    not stream (or with partial rollouts, or a task with tools), process_rewards naming no
    reward or without processes, and processes with no reward to run (exit 2, naming each
    field); the continuous engine's overlap is valid."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(QUICKSTART))

    def problems(*sets):
        result = CliRunner().invoke(cli, ["config", "validate", str(path), *[a for s in sets for a in ("--set", s)]])
        assert "Traceback" not in result.output
        return result.exit_code, [line for line in result.output.splitlines() if line.startswith("  - ")]

    code, lines = problems("task.reward_scoring=overlap", "rollout.engine=static", "task.process_rewards=[nope]",
                           "task.reward_processes=2")
    assert code == 2 and len(lines) == 2, lines
    assert lines[0].startswith("  - task.process_rewards: task 'arithmetic' has no reward named 'nope'")
    assert "task.reward_scoring=overlap needs an engine that streams rows" in lines[1] and "'static'" in lines[1]
    code, lines = problems("task.process_rewards=[close]")
    assert code == 2 and lines[0].startswith("  - task.process_rewards=['close'] needs task.reward_processes >= 1")
    code, lines = problems("task.reward_processes=1")
    assert code == 2 and "task.reward_processes=1 runs nothing" in lines[0]
    code, lines = problems("task.reward_scoring=overlap", "rollout.engine=continuous", "train.async.enabled=true",
                           "train.async.partial_rollouts=true")
    assert code == 2 and any("does not combine with train.async.partial_rollouts=true" in line for line in lines), lines
    assert problems("task.reward_scoring=overlap", "rollout.engine=continuous", "task.reward_timeout_s=5",
                    "task.process_rewards=[close]", "task.reward_processes=1")[0] == 0


@pytest.mark.parametrize("sets", [[], ["train.async.enabled=true", "train.async.rollout_devices=4"]])
def test_model_rewards_over_several_processes_are_refused_naming_the_field(sets):
    """Issue 55, item 3: ``task.model_rewards`` have not run over several processes, so
    ``grpo config validate --processes 2`` refuses them (exit 2, naming the field), in a
    synchronous run and in an asynchronous one split by processes alike; one process passes."""
    import json

    judge = [{"kind": "judge", "name": "j", "template": "{prompt}{completion} score:", "parser": "number"}]
    args = ["config", "validate", str(ROOT / "configs" / "quickstart.yaml"), "--set",
            "task.model_rewards=" + json.dumps(judge), *[a for s in sets for a in ("--set", s)]]
    result = CliRunner().invoke(cli, args + ["--processes", "2", "--local-devices", "4"])
    assert result.exit_code == 2, result.output
    assert "task.model_rewards ('j' (judge)) run on one process only so far" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(cli, args + ["--processes", "1", "--local-devices", "8"])
    assert result.exit_code == 0, result.output


def test_partial_rollouts_with_a_multi_turn_task_are_refused_before_start_up():
    """Issue 51 (round 8): partial rollouts with a task that has tools passed `grpo config
    validate` ("ok") and failed at start-up (the partial-rollouts stream refuses the
    multi-turn sampler); now validate names the fields, and the same config on a
    single-turn task still passes."""
    sets = ["train.async.enabled=true", "train.async.partial_rollouts=true", "train.async.max_staleness=1",
            "rollout.engine=continuous"]
    [problem] = _problems(sets + ["task.name=lookup", "task.options={}"])
    assert problem.startswith("train.async.partial_rollouts=true needs single-turn rows: task 'lookup' has tools")
    assert "Set train.async.partial_rollouts=false" in problem
    load_config(QUICKSTART, sets, env={})
