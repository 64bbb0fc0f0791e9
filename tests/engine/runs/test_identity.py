"""Which run a config continues (issue 49, item 1 "Run identity for --resume", and the
resume items of item 8): ``--resume`` and ``--run-dir`` continue only a run whose
fingerprint matches, a mismatch exits 2 naming the fields, ``--resume-changed`` records the
new config beside the old one, a checkpoint that does not fit the model is a message, and a
resume with nothing left to do changes no file.

Host-only: the run directories are made by hand (a recorded config and a checkpoint
folder), and every command here stops before a model is built. One slow test trains.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import grpo
from grpo.core.cli import cli
from grpo.core.config import load_config
from grpo.engine.cli import resume_command
from grpo.engine.runs import identity, rundir

QUICKSTART = Path(__file__).parents[3] / "configs" / "quickstart.yaml"
OTHER_MODEL = "model.random.overrides.hidden_size=32"


def _cfg(*sets):
    return load_config(QUICKSTART, list(sets))


def _run(parent: Path, cfg, *, step: int, stamp: str = "20260101-000000", name: str = "quickstart") -> Path:
    """A run directory as a run leaves it: its config recorded, a finished checkpoint at
    ``step`` (Orbax names a complete step's folder by its number), a summary."""
    d = parent / f"{name}-{stamp}"
    (d / "checkpoints" / str(step)).mkdir(parents=True)
    identity.record(d, cfg, step=None)
    (d / "summary.json").write_text(json.dumps({"steps": step, "final": {"reward/mean": 0.5}, "eval": None}))
    return d


def _snapshot(d: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.read_bytes()) for p in d.rglob("*") if p.is_file()}


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(QUICKSTART, tmp_path / "quickstart.yaml")
    other = yaml.safe_load(QUICKSTART.read_text())
    other["model"]["random"]["overrides"]["hidden_size"] = 32
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(dict(other, name="quickstart")))  # a copy that kept the name
    return tmp_path


def test_resume_of_another_config_with_the_same_name_exits_2_and_touches_nothing(here):
    """The issue's goal: `grpo run B.yaml --resume` after a run of A.yaml with the same name
    and another model exits 2 naming the differing field, without a traceback, and writes
    nothing into A's run (the old code continued A's run, then Orbax raised a traceback)."""
    a = _run(here / "runs", _cfg(), step=3)
    before = _snapshot(a)
    result = CliRunner().invoke(cli, ["run", "b.yaml", "--resume"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "model.random.overrides.hidden_size ('<unset>' -> 32)" in result.output
    assert str(Path("runs") / a.name) in result.output and "--resume-changed" in result.output
    assert _snapshot(a) == before and sorted(p.name for p in (here / "runs").iterdir()) == [a.name]


def test_run_dir_of_another_config_exits_2_too(here):
    """--run-dir DIR on a checkpoint made by another config is the same refusal, in --run-dir's words."""
    a = _run(here / "runs", _cfg(), step=3)
    before = _snapshot(a)
    result = CliRunner().invoke(cli, ["run", "quickstart.yaml", "--run-dir", str(a), "--set", "train.seed=5"])
    assert result.exit_code == 2 and "train.seed (0 -> 5)" in result.output, result.output
    assert f"--run-dir: {a} holds a checkpoint (step 3)" in result.output and "Pick another --run-dir" in result.output
    assert _snapshot(a) == before


def test_resume_picks_the_newest_run_of_the_same_fingerprint(here):
    """Among runs of one name, --resume skips a newer one made by another config."""
    mine = _run(here / "runs", _cfg(), step=3, stamp="20260101-000000")
    _run(here / "runs", _cfg(OTHER_MODEL), step=5, stamp="20260102-000000")
    cfg = _cfg("train.steps=900", "logging.every_n_steps=10")  # extends and observes: the same run
    assert grpo.api.run_directory(cfg, "quickstart.yaml", run_dir=None, resume=True, how="") == os.path.join(
        "runs", mine.name)


def test_resume_changed_continues_the_newest_and_records_the_new_config_beside_the_old(here):
    a = _run(here / "runs", _cfg(), step=3)
    old = (a / "config.yaml").read_bytes()
    cfg = _cfg("train.seed=7", "train.steps=900")
    directory = grpo.api.run_directory(cfg, "quickstart.yaml", run_dir=None, resume=True, how="", accept_changed=True)
    assert directory == os.path.join("runs", a.name)
    cont = identity.check_resume(directory, cfg, step=3, accept_changed=True, how="--resume", accept_flag="",
                                 fresh_advice="")
    assert cont.changed == [("train.seed", 0, 7)] and cont.other == [("train.steps", 800, 900)]
    assert "train.steps (800 -> 900)" in cont.notice(cfg) and "config.step-3.yaml" in cont.notice(cfg)
    assert identity.record(a, cfg, step=3) == "config.step-3.yaml"
    assert (a / "config.yaml").read_bytes() == old  # what trained steps 1-3 stays
    assert yaml.safe_load((a / "config.step-3.yaml").read_text())["train"]["seed"] == 7
    assert json.loads((a / "identity.json").read_text())["fingerprint"] == grpo.core.config.fingerprint.fingerprint(cfg)
    # The run is now this config's: a plain --resume of it finds it; eval/export read what trained each step.
    assert grpo.api.run_directory(cfg, "quickstart.yaml", run_dir=None, resume=True, how="") == directory
    assert identity.latest_config(a, 3)[0] == "config.yaml" and identity.latest_config(a)[0] == "config.step-3.yaml"


def test_a_resume_with_the_same_config_records_nothing_new(here):
    a = _run(here / "runs", _cfg(), step=3)
    before = _snapshot(a)
    assert identity.record(a, _cfg(), step=3) is None
    assert _snapshot(a) == before


def test_a_resume_with_nothing_left_to_do_changes_no_file(here):
    """Item 8: the old code rewrote summary.json with "final": {} and "eval": null, and
    config.yaml with the new steps."""
    a = _run(here / "runs", _cfg(), step=800)
    before = _snapshot(a)
    result = CliRunner().invoke(cli, ["run", "quickstart.yaml", "--run-dir", str(a)])
    assert result.exit_code == 0, result.output
    assert "Nothing to do" in result.output and "no file was changed" in result.output
    assert "Done: 800 steps" in result.output and "0.5000" in result.output
    assert _snapshot(a) == before


def test_the_resume_hint_repeats_the_set_flags():
    """Item 8: the hint printed after Ctrl-C dropped --set train.steps=2000, so following it
    resumed a shorter run."""
    assert resume_command("configs/quickstart.yaml", "runs/inttest", ["train.steps=2000", "rollout.top_p=0.9"]) == (
        "grpo run configs/quickstart.yaml --run-dir runs/inttest --set train.steps=2000 --set rollout.top_p=0.9")


def _zero(completions, **kwargs):
    return [0.0] * len(completions)


def test_dict_configs_and_python_runs_get_names_of_their_own(here):
    """Item 1: a dict config without a name was "run"; item 8: grpo.train(quickstart.yaml,
    reward_funcs=...) shared the quickstart's name, so a CLI --resume found its runs."""
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw.pop("name")
    a, b = grpo.load_config(raw), grpo.load_config(raw, {"train.seed": 1})
    assert grpo.api.run_name(a, None).startswith("arithmetic-")
    assert grpo.api.run_name(a, None) != grpo.api.run_name(b, None)
    assert grpo.api.run_name(a, None) == grpo.api.run_name(grpo.load_config(raw, {"train.steps": 5}), None)
    custom = grpo.load_config(QUICKSTART, reward_funcs=[_zero], train_dataset=[{"prompt": "1+1=", "answer": "2"}])
    assert grpo.api.run_name(custom, str(QUICKSTART), objects=True) == "custom-quickstart"
    assert grpo.api.run_name(_cfg(), str(QUICKSTART)) == "quickstart"


def test_python_resume_speaks_python(here, capsys):
    """From Python the advice names grpo.train's arguments, not CLI flags (item 8)."""
    _run(here / "runs", _cfg(), step=3)
    with pytest.raises(grpo.UserError, match=r"resume_changed=True") as err:
        grpo.train("b.yaml", resume=True)
    assert "--resume" not in str(err.value)
    grpo.api.run_directory(_cfg(), "quickstart.yaml", run_dir=None, resume=False, how="grpo.train(..., resume=True)")
    assert "to continue it instead: grpo.train(..., resume=True)" in capsys.readouterr().out


def test_a_checkpoint_that_does_not_fit_the_model_is_a_message_naming_the_model_fields(tmp_path):
    """Orbax's raw `ValueError: Requested shape ... is not compatible with the stored shape`
    (raised mid-restore, with pages of errors from its other reads after it) becomes a check
    of the stored shapes before any read, and a UserError naming the model fields that
    differ from the run's config."""
    import jax.numpy as jnp

    from grpo.engine.runs.checkpoint import Checkpointer, CheckpointMismatch

    identity.record(tmp_path, _cfg(), step=None)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=1)
    ckpt.save(3, {"params": {"w": jnp.zeros((4, 8)), "b": jnp.zeros(8)}}, {"step": 3})
    with pytest.raises(CheckpointMismatch, match=r"^params\.w: stored \(4, 8\), requested \(4, 4\)$") as raw:
        ckpt.restore({"params": {"w": jnp.zeros((4, 4)), "b": jnp.zeros(8)}}, 3)
    state, meta = ckpt.restore({"params": {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}}, 3)  # fits: restores
    assert float(state["params"]["w"].sum()) == 0.0 and meta["step"] == 3
    ckpt.close()
    err = identity.incompatible_checkpoint(tmp_path, _cfg(OTHER_MODEL), 3, raw.value)
    text = str(err)
    assert isinstance(err, grpo.UserError) and "\n" not in text
    assert "params.w: stored (4, 8), requested (4, 4)" in text
    assert "model.random.overrides.hidden_size ('<unset>' -> 32)" in text
    orbax = ValueError("Requested shape: (4, 4) is not compatible with the stored shape: (4, 8). Truncating/padding "
                       "is disabled. To enable it, set `strict=False` in `ArrayRestoreArgs` ...")
    assert identity.is_shape_mismatch(orbax) and not identity.is_shape_mismatch(ValueError("disk full"))
    text = str(identity.incompatible_checkpoint(tmp_path, _cfg(), 3, orbax))
    assert "stored shape: (4, 8))" in text and "strict=False" not in text and "equal the run's recorded" in text


@pytest.mark.slow
def test_resume_changed_onto_another_model_size_exits_2_without_a_traceback(tmp_path, monkeypatch):
    """End to end (the issue's reproduction): a 1-step run of the tiny quickstart, then the
    same run directory with another hidden size accepted by --resume-changed: Orbax's shape
    error comes out as exit 2 naming the model field, and no new config is recorded."""
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    small = ["--set", "train.steps=1", "--set", "eval.every_n_steps=0", "--set", "logging.progress_bar=false",
             "--set", "logging.plot=false", "--set", "train.prompts_per_step=4", "--set", "rollout.num_generations=2"]
    grpo_run = [sys.executable, "-m", "grpo.core.cli", "run", str(QUICKSTART), "--run-dir", "r", *small]
    first = subprocess.run(grpo_run, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    second = subprocess.run([*grpo_run, "--set", "train.steps=2", "--set", OTHER_MODEL, "--resume-changed"],
                            capture_output=True, text=True)
    out = second.stdout + second.stderr
    assert second.returncode == 2, out
    assert "Traceback" not in out and "model.random.overrides.hidden_size ('<unset>' -> 32)" in out
    assert "does not fit this config's model (params." in out and "Exception ignored" not in out
    assert identity.config_files(tmp_path / "r") == [(0, "config.yaml")]
