"""A third-party package written only against ``grpo``'s public names
(``tests/fixtures/public_plugin``: a task with a tool and an environment of its own, a
loss wrapping the built-in ``jax`` loss, a rollout engine wrapping the built-in
``static`` engine), pip-installed with real entry points, then ``grpo plugins list``,
``grpo run`` (2 steps) and ``grpo plan`` on a config that uses all three."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import FIXTURES, _pip_install_target

pytestmark = pytest.mark.slow

PACKAGE = FIXTURES / "public_plugin" / "grpo_public_plugin"

CONFIG = {
    # The tools' schema in the chat template makes a ~280-token prompt of the tiny tokenizer.
    "model": {"source": "random", "random": {"preset": "tiny", "tool_tokens": True}},
    "rollout": {"engine": "wrapped", "engine_options": {"inner": "static"}, "num_generations": 2,
                "max_prompt_length": 320, "prompt_buckets": [320], "max_new_tokens": 16, "max_turns": 2, "max_turn_tokens": 6,
                "early_stop_chunk": 0},
    "task": {"name": "reverse", "options": {"num_examples": 8}},
    "loss": {"impl": "scaled", "options": {"scale": 1.0}},
    "train": {"steps": 2, "prompts_per_step": 4, "optimizer": {"learning_rate": 1e-3}},
    "eval": {"every_n_steps": 0},
    "checkpoint": {"every_n_steps": 0, "at_end": False},
    "logging": {"progress_bar": False, "plot": False},
}


def test_the_package_imports_only_grpo_s_public_names():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert node.module == "grpo" or not node.module.startswith("grpo."), (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert not [a.name for a in node.names if a.name.startswith("grpo.")], path.name


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return _pip_install_target("public_plugin", tmp_path_factory.mktemp("site_public"))


def _grpo(site: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run([sys.executable, "-m", "grpo.core.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_installed_package_is_listed(site):
    proc = _grpo(site, "plugins", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(proc.stdout)}
    for kind, name in (("task", "reverse"), ("loss", "scaled"), ("engine", "wrapped")):
        row = rows[(kind, name)]
        assert row["status"] == "ok" and row["provider"] == "grpo-public-plugin==0.1.0", row


def test_grpo_run_and_plan_with_the_package_s_task_loss_and_engine(site, tmp_path):
    config = tmp_path / "public.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    run_dir = tmp_path / "run"
    proc = _grpo(site, "run", str(config), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "wrapped engine: the first weights arrived through update_weights" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("loss" in r or "train/loss" in r for r in rows), rows[-1].keys()
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (resolved["task"]["name"], resolved["loss"]["impl"], resolved["rollout"]["engine"]) == (
        "reverse", "scaled", "wrapped")
    # The prompts are the package's environment's opening (its system message), with the
    # tool's schema; the rows are multi-turn rows.
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["turns"] for s in samples)
    prompt = samples[0]["prompt"]
    assert "Reverse words with the echo tool." in prompt and '"name": "echo"' in prompt, prompt

    pytest.importorskip("libtpu")
    plan = _grpo(site, "plan", str(config), "--topology", "v6e:2x2", "--json")
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-3000:]
    report = json.loads(plan.stdout)
    assert report["fits"] is True and report["compiler_error"] is None
    assert {"prefill", "decode", "update"} <= set(report["programs"])
