"""The SkyPilot task files in configs/launch/: SkyPilot's own parser accepts them, the
secret stays out of the files, and the command they run is a `grpo run` that the CLI
parses and whose recipe `grpo config validate` accepts for the slice's topology."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from grpo.core.cli import cli

ROOT = Path(__file__).parent.parent
LAUNCH = ROOT / "configs" / "launch"
# accelerator -> (processes, local devices): a v6e-8 is one host with 8 chips; a v6e-16
# is 4 hosts x 4 chips (jax.process_count() == 4 there).
TOPOLOGY = {"tpu-v6e-8": (1, 8), "tpu-v6e-16": (4, 4)}
TASKS = sorted(LAUNCH.glob("skypilot_*.yaml"))


def test_there_is_a_task_per_slice():
    accels = {yaml.safe_load(p.read_text())["resources"]["accelerators"] for p in TASKS}
    assert accels == set(TOPOLOGY)


def _skypilot_parse(paths: list[Path]) -> dict:
    """SkyPilot's parser: in-process when `sky` imports, else in the interpreter named by
    SKYPILOT_PYTHON (a separate virtualenv: SkyPilot pins click<8.2)."""
    args = [str(p.relative_to(ROOT)) for p in paths]
    if importlib.util.find_spec("sky") is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        try:
            from _skypilot_parse import parse
        finally:
            sys.path.pop(0)
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            return {a: parse(a) for a in args}
        finally:
            os.chdir(cwd)
    python = os.environ.get("SKYPILOT_PYTHON")
    if not python:
        pytest.skip("SkyPilot is not installed here (it pins click<8.2, so it is not in [dev]); "
                    "set SKYPILOT_PYTHON to a virtualenv's python with `pip install skypilot pyyaml`")
    out = subprocess.run([python, str(Path(__file__).parent / "_skypilot_parse.py"), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_skypilot_parses_the_task_files_offline():
    parsed = _skypilot_parse(TASKS)
    for path, task in parsed.items():
        accel = yaml.safe_load((ROOT / path).read_text())["resources"]["accelerators"]
        assert task["accelerators"] == {accel: 1}, path
        assert task["cloud"] == "GCP" and task["use_spot"] is True, path
        assert task["accelerator_args"]["runtime_version"].startswith("v2-alpha-tpuv6e"), path
        # Managed-job recovery brings up a new slice after a preemption; grpo resumes.
        assert task["job_recovery"]["strategy"] and task["job_recovery"]["max_restarts_on_errors"] >= 1, path
        assert task["num_nodes"] == 1, path  # one slice; SkyPilot runs the commands on each of its hosts
        assert task["secret_names"] == ["WANDB_API_KEY"] and "WANDB_API_KEY" not in task["envs"], path
        assert task["refused_without_values"] and "RUN_DIR" in task["refused_without_values"][0], path
        assert task["envs"]["GRPO_PIP_SPEC"] == ".[tpu]" and "$GRPO_PIP_SPEC" in task["setup"], path


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.name)
def test_the_task_runs_a_grpo_command_the_cli_and_config_accept(path):
    text = path.read_text()
    task = yaml.safe_load(text)
    # The secret is a name to fill at launch, never a value in the file.
    assert task["secrets"] == {"WANDB_API_KEY": None}
    assert "WANDB_API_KEY=" not in text and task["envs"]["RUN_DIR"] is None
    lines = [ln for ln in task["run"].splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert len(lines) == 1, task["run"]
    env = {**task["envs"], "RUN_DIR": "gs://bucket/runs/x"}
    argv = [env.get(a[1:], a) if a.startswith("$") else a for a in shlex.split(lines[0])]
    assert argv[:2] == ["grpo", "run"], argv
    # The CLI's own parser takes these arguments.
    from grpo.engine.cli import run

    ctx = run.make_context("grpo run", argv[2:])
    assert ctx.params["run_dir"] == "gs://bucket/runs/x"
    recipe = ROOT / ctx.params["config_path"]
    assert recipe.is_file(), recipe
    processes, local = TOPOLOGY[task["resources"]["accelerators"]]
    result = CliRunner().invoke(cli, ["config", "validate", str(recipe), "--processes", str(processes),
                                      "--local-devices", str(local)])
    assert result.exit_code == 0, result.output
    recipe_cfg = yaml.safe_load(recipe.read_text())
    if processes > 1:  # every host must join, found from the TPU VM metadata
        assert recipe_cfg["distributed"]["mode"] == "auto"
        assert recipe_cfg["distributed"]["require_process_count"] == processes
