"""Plugin core: hook specs, built-ins, third-party entry points, failure isolation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
from click.testing import CliRunner

from grpo import MeshLayout, MeshPolicy, NoOptions, Topology, hookimpl
from grpo.core import hookspecs
from grpo.core.cli import cli
from grpo.core.errors import PluginError
from grpo.core.plugins import DEFAULT_PLUGINS, load_plugins

HOOKS = ("register_mesh_policies", "register_rollout_styles", "register_losses", "register_objectives", "register_tasks",
         "register_models", "register_attention", "register_rollout_engines")


def _module(name, **attrs):
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def _list_json(env=None):
    result = CliRunner().invoke(cli, ["plugins", "list", "--json"], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_hook_names_are_public_api():
    for name in HOOKS:
        assert callable(getattr(hookspecs, name))
    assert [m for m in DEFAULT_PLUGINS] == [
        "grpo.plugins.mesh", "grpo.plugins.rollout", "grpo.plugins.losses", "grpo.plugins.objectives",
        "grpo.plugins.tasks", "grpo.plugins.models", "grpo.plugins.attention", "grpo.plugins.engines",
    ]


def test_builtins_registered_through_hooks():
    loaded = load_plugins(entry_points=False)
    assert {"auto", "host_local", "explicit"} <= set(loaded.registry("mesh").names())
    assert {"legacy", "maxtext"} <= set(loaded.registry("rollout").names())
    assert {"ppo_clip", "gspo", "cispo", "sapo"} <= set(loaded.registry("objective").names())
    assert {"qwen2", "qwen3", "llama"} <= set(loaded.registry("model").names())
    assert {"xla", "splash", "pallas_gpu"} <= set(loaded.registry("attention").names())
    assert {"static", "continuous"} == set(loaded.registry("engine").names())
    assert all(e.provider == "built-in" for e in loaded.entries())
    assert loaded.failed == []
    # Builtins are plain plugin modules in pluggy, like third-party ones.
    assert set(DEFAULT_PLUGINS) <= {name for name, _ in loaded.manager.list_name_plugin()}


def test_unknown_name_lists_choices():
    loaded = load_plugins(entry_points=False)
    with pytest.raises(PluginError) as err:
        loaded.get("mesh", "autoo")
    msg = str(err.value)
    assert "autoo" in msg and "auto, explicit, host_local" in msg and "Did you mean 'auto'" in msg


def test_extra_module_and_duplicate_name():
    class Twin(MeshPolicy):
        name = "auto"
        Options = NoOptions

        def resolve(self, topology, options):
            return MeshLayout(dp=1, fsdp=topology.device_count, tp=1)

    @hookimpl
    def register_mesh_policies(register):
        register(Twin())

    Mod = _module("twin_plugin", register_mesh_policies=register_mesh_policies)

    loaded = load_plugins(entry_points=False, extra_modules=[Mod])
    [failed] = loaded.failed
    assert failed.kind == "mesh" and "built-in" in failed.error and "twin_plugin" in failed.error
    with pytest.raises(PluginError, match="Duplicate mesh plugin name 'auto'.*built-in.*twin_plugin"):
        loaded.get("mesh", "auto")
    with pytest.raises(PluginError, match="GRPO_STRICT_PLUGINS"):
        load_plugins(entry_points=False, extra_modules=[Mod], strict=True)


def test_register_rejects_non_plugins():
    @hookimpl
    def register_rollout_styles(register):
        register(object())

    Mod = _module("bad_objects", register_rollout_styles=register_rollout_styles)

    loaded = load_plugins(entry_points=False, extra_modules=[Mod])
    [failed] = loaded.failed
    assert failed.kind == "rollout" and "invalid name" in failed.error


def test_third_party_package_listed_with_distribution(example_plugin):
    rows = _list_json()
    ring = [r for r in rows if r["name"] == "ring"]
    assert ring == [
        {
            "kind": "mesh",
            "name": "ring",
            "provider": "grpo-example-plugin==0.3.1",
            "status": "ok",
            "description": "Every device on one axis (example third-party policy).",
        }
    ]
    # The third-party policy works end to end through the CLI.
    result = CliRunner().invoke(
        cli, ["mesh", "preview", "--policy", "ring", "--processes", "2", "--local-devices", "4", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["shape"] == {"dp": 1, "fsdp": 1, "tp": 8}


def test_third_party_plugin_options_validated(example_plugin):
    result = CliRunner().invoke(
        cli, ["mesh", "preview", "--policy", "ring", "--option", "revers=true", "--processes", "1", "--local-devices", "8"]
    )
    assert result.exit_code == 2
    assert "options.revers" in result.output and "Traceback" not in result.output


def test_allow_and_deny_lists(example_plugin):
    names = {r["name"] for r in _list_json(env={"GRPO_DISABLE_PLUGINS": "example"})}
    assert "ring" not in names and "auto" in names
    names = {r["name"] for r in _list_json(env={"GRPO_LOAD_PLUGINS": "grpo-example-plugin"})}
    assert "ring" in names
    names = {r["name"] for r in _list_json(env={"GRPO_LOAD_PLUGINS": ""})}
    assert "ring" not in names


def test_broken_package_listed_as_failed(broken_plugin):
    rows = _list_json(env={"GRPO_STRICT_PLUGINS": None})
    failed = {r["name"]: r for r in rows if r["status"] == "failed"}
    assert set(failed) == {"broken_import", "broken_hook", "duplicate", "typo_hook"}
    for row in failed.values():
        assert row["provider"] == "grpo-broken-plugin==0.0.1"
    assert failed["broken_import"]["kind"] is None
    assert "ModuleNotFoundError" in failed["broken_import"]["error"]
    assert failed["broken_hook"]["kind"] == "loss" and "this hook always fails" in failed["broken_hook"]["error"]
    assert failed["duplicate"]["kind"] == "mesh" and "built-in" in failed["duplicate"]["error"]
    assert "register_loss" in failed["typo_hook"]["error"]
    # The rest of the CLI still works.
    ok = [r for r in rows if r["status"] == "ok"]
    assert {"host_local", "legacy"} <= {r["name"] for r in ok}
    result = CliRunner().invoke(cli, ["plugins", "list"])
    assert result.exit_code == 0 and "failed: ModuleNotFoundError" in result.output
    result = CliRunner().invoke(cli, ["mesh", "preview", "--policy", "host_local", "--processes", "2", "--local-devices", "4"])
    assert result.exit_code == 0, result.output


def test_strict_mode_is_fatal(broken_plugin):
    result = CliRunner().invoke(cli, ["plugins", "list"], env={"GRPO_STRICT_PLUGINS": "1"})
    assert result.exit_code == 2
    assert "GRPO_STRICT_PLUGINS" in result.output and "Traceback" not in result.output


def test_real_console_script_sees_entry_points(example_plugin_dir):
    """A real subprocess with the plugin on PYTHONPATH: what a user's shell sees."""
    env = dict(os.environ, PYTHONPATH=str(example_plugin_dir))
    out = subprocess.run(
        [sys.executable, "-m", "grpo.core.cli", "plugins", "list", "--json"],
        env=env, capture_output=True, text=True, check=True,
    )
    rows = json.loads(out.stdout)
    assert any(r["name"] == "ring" and r["provider"] == "grpo-example-plugin==0.3.1" for r in rows)
    # The listing never imports JAX (plugins list must stay fast).
    probe = subprocess.run(
        [sys.executable, "-c",
         "import sys; from grpo.core.plugins import load_plugins; load_plugins(); print('jax' in sys.modules)"],
        env=env, capture_output=True, text=True, check=True,
    )
    assert probe.stdout.strip() == "False"


def test_topology_defaults():
    t = Topology(process_count=4, local_device_count=4)
    assert t.device_count == 16 and t.uniform and t.devices_per_process == (4, 4, 4, 4)


def test_a_third_party_attention_kernel_is_chosen_by_name():
    from grpo.core.config import ModelConfig, attention_plugin
    from grpo.core.contracts import AttentionPlugin

    class Chunked(AttentionPlugin):
        name = "chunked"
        platforms = ("cpu", "gpu", "tpu")

        def build(self, options, *, platform):
            from grpo.kernels.attention import reference_attention

            return reference_attention

    @hookimpl
    def register_attention(register):
        register(Chunked())

    loaded = load_plugins(entry_points=False, extra_modules=[_module("chunked_attention", register_attention=register_attention)])
    name, plugin, _ = attention_plugin(ModelConfig(source="random", attention="chunked"), "tpu", loaded)
    assert name == "chunked" and isinstance(plugin, Chunked)
    with pytest.raises(PluginError, match="chunked"):  # the choices listed for a typo
        loaded.get("attention", "chunkd")


def test_a_third_party_rollout_engine_is_listed_validated_and_built(example_plugin, tmp_path):
    """rollout.engine names an engine plugin: listed with its distribution, its options
    validated under rollout.engine_options, a typo or a multi-turn task refused naming the
    field, and the program builder's sampler is the one the plugin builds."""
    import jax
    from flax import nnx

    from grpo.core.config import ConfigError, load_config, select_plugins
    from grpo.engine.parallel.mesh import build_mesh
    from grpo.engine.programs import build_programs
    from grpo.models.loading import build_model

    rows = [r for r in _list_json() if r["kind"] == "engine"]
    assert {(r["name"], r["provider"]) for r in rows} == {
        ("static", "built-in"), ("continuous", "built-in"), ("replay", "grpo-example-plugin==0.3.1")}
    base = {"model": {"source": "random", "random": {"preset": "tiny"}, "param_dtype": "float32",
                      "compute_dtype": "float32"},
            "rollout": {"engine": "replay", "engine_options": {"label": "mine"}, "max_new_tokens": 8,
                        "max_prompt_length": 8, "num_generations": 2},
            "train": {"prompts_per_step": 2}}
    for patch, text in (({"engine": "replya"}, "rollout.engine: Unknown engine plugin 'replya'"),
                        ({"engine_options": {"lable": "x"}}, "rollout.engine_options.lable")):
        with pytest.raises(ConfigError) as err:
            select_plugins(load_config({**base, "rollout": {**base["rollout"], **patch}}))
        assert text in str(err.value)
    config = load_config(base)
    layout = MeshLayout(dp=1, fsdp=jax.device_count(), tp=1)
    mesh = build_mesh(layout)
    graphdef, state = nnx.split(build_model(config.model, mesh, seed=0))
    programs = build_programs(config, mesh=mesh, layout=layout, graphdef=graphdef, eos_ids=(1,), pad_id=0, state=state)
    sampler = programs.sampler()
    assert sampler.label == "mine" and type(sampler).__name__ == "Sampler"
    assert sampler.prepare == programs.prepare_weights  # the builder gives it the run's weight preparation
    assert (sampler.sampling.max_new_tokens, sampler.sampling.num_generations, sampler.sampling.eos_ids) == (8, 2, (1,))
    assert programs.sampler(greedy=True).sampling.greedy  # one build per (greedy, k)
    problems = programs.plugins["engine"].plugin.check(multi_turn=True, options=programs.plugins["engine"].options)
    assert problems and "rollout.engine='replay'" in problems[0]
