"""The Python API against the CLI, on one set of runs (module-scoped, tiny steps):

1. ``grpo run`` of the quickstart with a TRL-style reward function by import path and a
   jsonl of prompts (the ``custom`` task), 2 steps;
2. ``grpo run --resume`` of the same config to step 3: it finds that run and continues it;
3. ``grpo.train`` of the same quickstart for 3 straight steps with the same reward as a
   Python callable and the same rows as an in-memory list of dicts.

(3) equals (1)+(2) bit for bit: the metrics of every step and the trained parameters.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import grpo
from grpo.core.cli import cli
from grpo.engine.runs import rundir
from grpo.engine.runs.metrics import read_metrics

# Three runs of the quickstart (15 s of set-up): the full tier (the fast one's budget).
pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
SMALL = {"eval.every_n_steps": 0, "checkpoint.every_n_steps": 0, "logging.progress_bar": False, "logging.plot": False}
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10 - a)]

# A reward function written for TRL's GRPOTrainer, unchanged.
REWARD_MODULE = '''
def exact(completions, prompts, answer, **kwargs):
    """1 when the completion is the sum (TRL's convention: lists in, a list out)."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]
'''


def exact(completions, prompts, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def _sets(overrides):
    return [x for k, v in overrides.items() for x in ("--set", f"{k}={json.dumps(v)}")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    old = os.getcwd()
    os.chdir(root)
    try:
        (root / "trl_rewards.py").write_text(textwrap.dedent(REWARD_MODULE))
        (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
        config = yaml.safe_load(QUICKSTART.read_text())
        config["task"] = {"name": "custom", "options": {"rewards": ["trl_rewards:exact"],
                                                        "data_files": {"train": "sums.jsonl"}}}
        (root / "quickstart.yaml").write_text(yaml.safe_dump(config))
        first = CliRunner().invoke(cli, ["run", "quickstart.yaml", *_sets(dict(SMALL, **{"train.steps": 2}))])
        assert first.exit_code == 0, first.output
        second = CliRunner().invoke(cli, ["run", "quickstart.yaml", "--resume", *_sets(dict(SMALL, **{"train.steps": 3}))])
        assert second.exit_code == 0, second.output
        api = grpo.train(QUICKSTART, overrides=dict(SMALL, **{"train.steps": 3}), reward_funcs=[exact],
                         train_dataset=ROWS, run_dir=root / "api")
        yield {"root": root, "first": first.output, "second": second.output, "api": api}
    finally:
        os.chdir(old)


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "compile/"))} for r in rows]


def _params(run_dir, step):
    import orbax.checkpoint as ocp

    return ocp.PyTreeCheckpointer().restore(str(rundir.path(run_dir) / "checkpoints" / str(step) / "params"))


def test_resume_finds_the_latest_run_and_says_so(runs):
    (cli_dir,) = [p for p in (runs["root"] / "runs").iterdir()]
    assert cli_dir.name.startswith("quickstart-")
    assert "Starting fresh" in runs["first"]
    assert f"--resume: continuing {os.path.join('runs', cli_dir.name)}" in runs["second"]
    assert "from its checkpoint at step 2" in runs["second"]
    assert rundir.checkpoint_steps(cli_dir) == [3]


def test_a_run_says_what_it_compiled(runs):
    """Issue 50: ``grpo run`` ends with its compiles and where its persistent cache is (the
    suite's own cache here: JAX_COMPILATION_CACHE_DIR, set by tests/conftest.py)."""
    import re

    cache = re.escape(os.environ["JAX_COMPILATION_CACHE_DIR"])
    for out in (runs["first"], runs["second"]):
        assert re.search(rf"^Compiled \d+ programs in [\d.]+ s \(\d+ loaded from the cache in {cache}\)$", out, re.M), out


def test_api_equals_cli_and_resume_is_bitwise(runs):
    api = runs["api"]
    (cli_dir,) = list((runs["root"] / "runs").iterdir())
    assert api.run_dir == str(runs["root"] / "api") and api.summary["steps"] == 3
    cli_rows, api_rows = _strip(read_metrics(cli_dir)), _strip(read_metrics(api.run_dir))
    assert [r["step"] for r in api_rows] == [1, 2, 3]
    assert cli_rows == api_rows  # steps 1-2 from the first CLI run, 3 from the resumed one
    assert _strip([api.metrics]) == api_rows[-1:]
    assert "reward/exact/mean" in api.metrics
    a, b = _params(cli_dir, 3), _params(api.run_dir, 3)
    import jax

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_checkpoint_of_the_config_prints_how_to_resume(runs, capsys):
    """Without --resume, a new run of a config that has a checkpoint says how to continue it
    (checked on the directory choice alone: nothing trains)."""
    os.chdir(runs["root"])
    cfg = grpo.load_config("quickstart.yaml")
    directory = grpo.api.run_directory(cfg, "quickstart.yaml", run_dir=None, resume=False, how="grpo run X --resume")
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "to continue it instead: grpo run X --resume" in out and "step 3" in out
    assert Path(directory).name.startswith("quickstart-") and not Path(directory).exists()
    with pytest.raises(grpo.UserError, match="--resume and --run-dir"):
        grpo.api.run_directory(cfg, "quickstart.yaml", run_dir="x", resume=True, how="")


def test_the_api_raises_the_cli_s_user_errors(runs, tmp_path):
    bad = {"train.prompts_per_step": 0}
    with pytest.raises(grpo.UserError) as err:
        grpo.load_config(QUICKSTART, bad)
    result = CliRunner().invoke(cli, ["config", "validate", str(QUICKSTART), *_sets(bad)])
    assert result.exit_code == 2 and str(err.value) in result.output
    with pytest.raises(grpo.UserError, match="reward_funcs and train_dataset"):
        grpo.load_config(QUICKSTART, reward_funcs=[exact])
    with pytest.raises(grpo.UserError, match="train_dataset: expected"):
        grpo.load_config(QUICKSTART, reward_funcs=[exact], train_dataset=42)


def test_grpo_eval_and_grpo_evaluate_agree_on_the_same_checkpoint(runs):
    """`grpo eval` of the CLI run and `grpo.evaluate` of the API run (bitwise the same
    parameters, the same 8 eval rows from a file and from memory) report the same numbers,
    for the latest checkpoint (step 3)."""
    os.chdir(runs["root"])
    (cli_dir,) = list((runs["root"] / "runs").iterdir())
    evals = {"eval.num_examples": 8, "eval.batch_size": 8}
    result = CliRunner().invoke(cli, ["eval", str(cli_dir), "--json", *_sets(evals),
                                      "--set", "task.options.data_files.test=sums.jsonl"])
    assert result.exit_code == 0, result.output
    by_cli = json.loads(result.output[result.output.index("{"):])
    by_api = grpo.evaluate(runs["api"].run_dir, overrides=evals, reward_funcs=[exact], eval_dataset=ROWS)
    assert by_cli["step"] == by_api["step"] == 3 and by_cli["eval/num_prompts"] == 8
    assert _strip([by_cli]) == _strip([by_api])
    with pytest.raises(grpo.UserError, match="no checkpoint at step 1"):
        grpo.evaluate(cli_dir, step=1)
