"""Run config: every shipped config validates; bad configs exit 2 naming the field."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from conftest import ROOT

from grpo.core.cli import cli
from grpo.core.config import RunConfig, load_config, resolve_layout
from grpo.core.contracts import Topology
from grpo.core.errors import ConfigError, UserError

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

BASE = {
    "model": {"source": "random", "random": {"preset": "tiny"}},
    "rollout": {"num_generations": 4, "max_new_tokens": 8},
    "task": {"name": "arithmetic"},
    "train": {"steps": 4, "prompts_per_step": 4},
}


def _write(tmp_path, data, name="c.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def _merge(base, patch):
    out = json.loads(json.dumps(base))
    for key, value in patch.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _validate(*args):
    return CliRunner().invoke(cli, ["config", "validate", *args])


def test_configs_exist():
    assert any(p.name == "quickstart.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_validates(path):
    result = _validate(str(path))
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "ok"


def test_base_is_valid_and_show_fills_defaults(tmp_path):
    path = _write(tmp_path, BASE)
    assert _validate(path).exit_code == 0
    shown = CliRunner().invoke(cli, ["config", "show", path, "--set", "train.steps=7"])
    assert shown.exit_code == 0, shown.output
    data = yaml.safe_load(shown.output)
    assert data["train"]["steps"] == 7
    assert data["loss"]["epsilon_high"] == 0.2  # a default, filled in
    assert data["mesh"] == {"policy": "auto", "options": {"tp": 1}, "expert_parallel": 1}  # plugin option defaults too
    # The shown config is itself a valid config that loads to the same thing.
    again = load_config(_write(tmp_path, shown.output, "again.yaml"))
    assert again == load_config(path, ["train.steps=7"])


BAD = [
    # (patch or raw text, field path expected in the message, extra text expected)
    ({"trian": {"steps": 3}}, "trian", "unknown field"),
    ({"train.steps": 0}, "train.steps", "greater than or equal to 1"),
    ({"train.steps": "ten"}, "train.steps", "'ten'"),
    ({"mesh.policy": "nope"}, "mesh.policy", "auto, explicit, host_local"),
    ({"mesh.policy": "explicit", "mesh.options": {"shape": "1,-1,-1"}}, "mesh.options.shape", "more than one -1"),
    ({"mesh.policy": "explicit", "mesh.options": {"shap": "1,-1,1"}}, "mesh.options.shap", "unknown field"),
    ({"loss.impl": "torch"}, "loss.impl", "Available:"),
    ({"rollout.style": "maxtex"}, "rollout.style", "Did you mean 'maxtext'"),
    ({"rollout.num_generations": 1}, "rollout.num_generations", "greater than or equal to 2"),
    ({"train.micro_batch_size": 3}, "train.micro_batch_size", "= 16"),
    ({"rollout.temperature": 0}, "rollout.temperature", "greater than 0"),
    ({"rollout.top_p": 1.5}, "rollout.top_p", "less than or equal to 1"),
    ({"model.source": "hf"}, "model.path", "required"),
    ({"distributed.mode": "explicit"}, "distributed.coordinator_address", "not set"),
    ({"distributed.mode": "explicit", "distributed.coordinator_address": "h:1", "distributed.num_processes": 2,
      "distributed.process_id": 2}, "distributed.process_id", "must be <"),
    ({"eval.k": 4}, "eval.greedy", "eval.k=1"),
    ({"loss.aggregation": "mean"}, "loss.aggregation", "'token_mean', 'sequence_mean' or 'constant'"),
    ({"rollout.prompt_buckets": [64, 32]}, "rollout.prompt_buckets", "ascending"),
    ({"train.optimizer": {"name": "sgd"}}, "train.optimizer.name", "'adamw' or 'lion'"),
    ({"logging.wandb": {"mode": "on"}}, "logging.wandb.mode", "'disabled', 'offline' or 'online'"),
    ({"rollout.options": {"x": 1}}, "rollout.options.x", "unknown field"),
    ({"checkpoint.keep": 0}, "checkpoint.keep", "greater than or equal to 1"),
    ({"train.dynamic_sampling": {"enabled": True, "max_rounds": 0}}, "train.dynamic_sampling.max_rounds",
     "greater than or equal to 1"),
    ({"task.overlong": {"buffer": 8}}, "task.overlong.buffer=8", "must be < rollout.max_new_tokens=8"),
    ({"train.down_sampling": {"keep": 16}}, "train.down_sampling.keep=16", "at most rollout.num_generations"),
    ({"train.down_sampling": {"keep": 1}}, "train.down_sampling.keep", "greater than or equal to 2"),
    ({"train.down_sampling": {"keep": 2, "rule": "best"}}, "train.down_sampling.rule", "'max_variance' or 'random'"),
    ({"train.down_sampling": {"keep": 2}, "train.micro_batch_size": 3}, "train.micro_batch_size=3",
     "train.down_sampling.keep (2)"),
    ({"rollout.engine": "paged"}, "rollout.engine", "Unknown engine plugin 'paged'. Available: "),
    ({"rollout.continuous": {"chunk": 0}}, "rollout.continuous.chunk", "greater than or equal to 1"),
    ({"rollout.continuous": {"page_size": 0}}, "rollout.continuous.page_size", "greater than or equal to 1"),
    ({"rollout.continuous": {"slots": -1}}, "rollout.continuous.slots", "greater than or equal to 0"),
    ({"rollout.continuous": {"slots": "many"}}, "rollout.continuous.slots", "must be auto or an integer"),  # issue 49 item 7
    ({"rollout.continuous": {"attention": "cuda"}}, "rollout.continuous.attention", "'auto'"),
    ({"rollout.engine": "continuous", "rollout.continuous": {"pool_pages": 1, "page_size": 4}},
     "rollout.continuous.pool_pages=1", "cannot hold one row"),
]


@pytest.mark.parametrize("patch, field, text", BAD, ids=[b[1] for b in BAD])
def test_bad_configs_exit_2(tmp_path, patch, field, text):
    result = _validate(_write(tmp_path, _merge(BASE, patch)))
    assert result.exit_code == 2, result.output
    assert field in result.output and text in result.output, result.output
    assert "Traceback" not in result.output


def test_every_problem_reported_at_once(tmp_path):
    result = _validate(_write(tmp_path, _merge(BASE, {"train.steps": 0, "rollout.top_k": -1, "bogus": 1})))
    assert result.exit_code == 2
    for field in ("train.steps", "rollout.top_k", "bogus"):
        assert field in result.output


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: [unclosed", "not valid YAML at line 1"),
        ("", "is empty"),
        ("- a\n- b\n", "must be a mapping"),
        ("model: {source: random}\ntask: ${GRPO_TEST_MISSING_VAR}\n", "GRPO_TEST_MISSING_VAR"),
    ],
)
def test_bad_files(tmp_path, text, message):
    result = _validate(_write(tmp_path, text))
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_missing_file_and_directory(tmp_path):
    result = _validate(str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2 and "does not exist" in result.output
    result = _validate(str(tmp_path))
    assert result.exit_code == 2 and "is a directory" in result.output


def test_env_interpolation_and_overrides(tmp_path, monkeypatch):
    data = _merge(BASE, {"train.steps": "${GRPO_TEST_STEPS}", "name": "run-${GRPO_TEST_NAME}"})
    path = _write(tmp_path, data)
    monkeypatch.setenv("GRPO_TEST_STEPS", "12")
    monkeypatch.setenv("GRPO_TEST_NAME", "a")
    cfg = load_config(path)
    assert cfg.train.steps == 12 and cfg.name == "run-a"
    cfg = load_config(path, ["train.steps=5", "train.optimizer.learning_rate=1e-3", "rollout.prompt_buckets=[8, 16]", "rollout.max_prompt_length=16"])
    assert cfg.train.steps == 5 and cfg.train.optimizer.learning_rate == 1e-3 and cfg.rollout.prompt_buckets == [8, 16]
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        load_config(path, ["train.steps"])
    with pytest.raises(UserError, match=r"train.steps holds a value \(int\), not a section"):
        load_config(path, ["train.steps.x=1"])


def test_set_errors_through_cli(tmp_path):
    path = _write(tmp_path, BASE)
    result = _validate(path, "--set", "train.prompts_per_step=3", "--set", "train.micro_batch_size=8")
    assert result.exit_code == 2 and "train.micro_batch_size=8" in result.output


def test_topology_checks(tmp_path):
    maxtext = _write(tmp_path, _merge(BASE, {"rollout.style": "maxtext"}), "m.yaml")
    # maxtext on auto across 2 hosts: dp=1 != 2 processes.
    result = _validate(maxtext, "--processes", "2", "--local-devices", "4")
    assert result.exit_code == 2 and "dp == process count" in result.output and "host_local" in result.output
    ok = _validate(maxtext, "--set", "mesh.policy=host_local", "--processes", "2", "--local-devices", "4")
    assert ok.exit_code == 0, ok.output
    # 16 sequences cannot split over 3 devices.
    result = _validate(_write(tmp_path, BASE), "--processes", "1", "--local-devices", "3")
    assert result.exit_code == 2 and "16 sequences" in result.output
    cfg = load_config(_merge(BASE, {"train.micro_batch_size": 4}))
    with pytest.raises(ConfigError, match="micro-batch of 4 sequences"):
        resolve_layout(cfg, Topology(process_count=1, local_device_count=8))
    layout = resolve_layout(cfg, Topology(process_count=1, local_device_count=4))
    assert layout.shape == {"dp": 1, "fsdp": 4, "tp": 1}


def test_schema_command():
    result = CliRunner().invoke(cli, ["config", "schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["title"] == "RunConfig" and "train" in schema["properties"]


def test_every_field_has_a_description():
    def walk(model, prefix):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, RunConfig.__mro__[1]):
                walk(ann, f"{prefix}{name}.")

    walk(RunConfig, "")


def test_set_switching_a_plugin_drops_the_files_options_for_the_old_one(caplog):
    """``--set rollout.style=legacy`` on a recipe with serving options: those options are
    dropped with one note naming them; options given in the same command stay and are
    validated strictly against the new plugin; an unchanged name drops nothing."""
    import logging

    recipe = ROOT / "configs/gsm8k_qwen25_3b_v6e8.yaml"
    with caplog.at_level(logging.WARNING, logger="grpo.config"):
        cfg = load_config(recipe, ["rollout.style=legacy"])
    assert cfg.rollout.style == "legacy" and cfg.rollout.options == {}
    [note] = [r.getMessage() for r in caplog.records]
    assert "rollout.style=legacy" in note and "'serving'" in note and "(tensor_parallel)" in note
    caplog.clear()
    with pytest.raises(ConfigError, match="rollout.options.tensor_parallel: unknown field"):
        load_config(recipe, ["rollout.options.tensor_parallel=2", "rollout.style=legacy"])
    assert load_config(recipe, ["rollout.style=serving"]).rollout.options["tensor_parallel"] == 4
    data = {"model": {"source": "random", "random": {"preset": "tiny"}, "attention": "splash",
                      "attention_options": {"block_q": 256}}}
    # Attention options for splash, switched to pallas_gpu with one of its own options.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo.config"):
        cfg = load_config(data, ["model.attention=pallas_gpu", "model.attention_options.block_k=32"])
    assert cfg.model.attention_options == {"block_k": 32}
    [note] = [r.getMessage() for r in caplog.records]
    assert "model.attention_options" in note and "(block_q)" in note and "block_k given with --set stay" in note
    # The file leaves the name at its default: switching from it drops that default's options.
    mesh = {"mesh": {"options": {"shape": "1,-1,1"}}, "model": {"source": "random", "random": {"preset": "tiny"}}}
    assert load_config(mesh, ["mesh.policy=host_local"]).mesh.policy == "host_local"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_show_progress_and_quickstarts_evaluate_as_documented(path):
    """A newcomer sees the steps go by; the quickstarts evaluate every 50 steps, the
    cadence their headers and the README quote their curves at."""
    cfg = load_config(path)
    assert cfg.logging.progress_bar
    if path.name.startswith("quickstart"):
        assert cfg.eval.every_n_steps == 50 and "every 50" in path.read_text()


def test_packing_bin_length_shorter_than_a_sequence_is_refused():
    from grpo.core.config import RunConfig, cross_field_problems

    cfg = RunConfig.model_validate({"rollout": {"max_prompt_length": 64, "max_new_tokens": 32},
                                    "train": {"packing": {"bin_length": 95}}})
    assert cfg.bin_length == 95
    [problem] = [p for p in cross_field_problems(cfg) if "packing" in p]
    assert "train.packing.bin_length=95" in problem and "96" in problem
    assert RunConfig.model_validate({"rollout": {"max_prompt_length": 64, "max_new_tokens": 32}}).bin_length == 96


def test_validate_refuses_the_split_the_run_refuses_with_its_message():
    """Issue 51: `grpo config validate --processes 4 --local-devices 4` on the v6e-16
    recipe split 8 + 8 with partial rollouts and the continuous engine printed ``ok`` and
    the run refused it at start-up on the pod. Validate runs the run's own check
    (grpo.engine.parallel.split.check_split, which the run calls on its real devices) and
    prints the same message; partial rollouts now run over processes, so 8 + 8 is ok
    with them as without, and 12 + 4 (a rollout mesh its batch does not fit) is refused
    with the run's message."""
    from grpo.engine.parallel.split import check_split, topology_devices

    recipe = str(ROOT / "configs" / "gsm8k_qwen25_3b_v6e16.yaml")
    extra = ["--set", "train.async.partial_rollouts=true", "--set", "rollout.engine=continuous"]
    for k, code in ((8, 0), (12, 2)):
        sets = ["--set", "train.async.enabled=true", "--set", f"train.async.rollout_devices={k}"]
        result = _validate(recipe, "--processes", "4", "--local-devices", "4", *sets, *extra)
        assert result.exit_code == code, result.output
        if code:
            with pytest.raises(ConfigError) as err:
                check_split(load_config(recipe, [a for a in sets + extra if a != "--set"]), topology_devices(4, 4))
            assert str(err.value) in result.output and "gives a rollout mesh of 12 devices" in result.output
        else:
            assert result.output.strip() == "ok", result.output
    ok = _validate(recipe, "--processes", "4", "--local-devices", "4", "--set", "train.async.enabled=true", "--set",
                   "train.async.rollout_devices=8")
    assert ok.exit_code == 0 and ok.output.strip() == "ok", ok.output
    # A process on both sides (6 of 4 x 4): the run's message too.
    result = _validate(recipe, "--processes", "4", "--local-devices", "4", "--set", "train.async.enabled=true",
                       "--set", "train.async.rollout_devices=6")
    assert result.exit_code == 2 and "does not split this run's 16 devices (of 4 processes) by whole processes" \
        in result.output
