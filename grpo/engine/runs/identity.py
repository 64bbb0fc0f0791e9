"""Which run a config continues: the configs a run directory records, its fingerprint, and
the checks ``--resume`` and ``--run-dir`` make before continuing a checkpoint.

A run directory keeps every config that trained part of it and never overwrites one:

- ``config.yaml``: the config that started it (step 0);
- ``config.step-N.yaml``: the config a resume at step ``N`` continued with, written only
  when it differs from the one before (another ``train.steps``, cadence, or, accepted with
  ``--resume-changed``, a field that defines the run);
- ``identity.json``: the fingerprint of the latest config
  (:func:`grpo.core.config.fingerprint.fingerprint`, which says which fields count), its
  task and the file it was computed from.

A run's identity is recomputed from its latest config file, read through the current
schema, so a grpo upgrade that adds a field with its default does not orphan a run;
``identity.json`` is the record for people and tools.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import yaml

from grpo.core.config.fingerprint import describe, differences, fingerprint
from grpo.core.errors import UserError
from grpo.engine.runs import rundir

CONFIG = "config.yaml"
IDENTITY = "identity.json"
_STEP_FILE = re.compile(r"^config\.step-(\d+)\.yaml$")

MODEL_FIELDS = "model.source, model.path, model.architecture, model.random (preset, overrides) and model.lora"
"""What decides the shapes of a checkpoint's arrays, named when a checkpoint does not fit."""


def step_file(step: int) -> str:
    return f"config.step-{step}.yaml"


def config_files(run_dir: str | os.PathLike) -> list[tuple[int, str]]:
    """``(first step, file name)`` of each config ``run_dir`` records, in training order."""
    base = rundir.path(run_dir)
    try:
        names = [p.name for p in base.iterdir()] if base.exists() else []
    except FileNotFoundError:
        names = []
    files = [(0, CONFIG)] if CONFIG in names else []
    files += sorted((int(m.group(1)), n) for n in names if (m := _STEP_FILE.match(n)))
    return files


def latest_config(run_dir: str | os.PathLike, step: int | None = None) -> tuple[str, dict[str, Any]] | None:
    """``(file name, config as written)`` of the config that trained ``run_dir`` up to its
    checkpoint at ``step`` (a resume at N trains steps N+1 on), or the latest one: what
    ``grpo eval`` and ``grpo export`` read."""
    files = [(first, name) for first, name in config_files(run_dir) if step is None or first < step or first == 0]
    if not files:
        return None
    name = files[-1][1]
    return name, yaml.safe_load(rundir.read_text(rundir.path(run_dir) / name)) or {}


def recorded(run_dir: str | os.PathLike) -> tuple[str, dict[str, Any]] | None:
    """``(file name, config as resolved now)`` of the latest config ``run_dir`` records."""
    found = latest_config(run_dir)
    return None if found is None else (found[0], resolved(found[1]))


def resolved(raw: dict[str, Any]) -> dict[str, Any]:
    """A recorded config as the current schema resolves it (defaults of fields added since
    filled in); as recorded when it no longer validates (say, a ``session:`` reward of a
    Python process that has ended), which then differs in the fields that changed."""
    from pydantic import ValidationError

    from grpo.core.config import RunConfig, load_config

    try:
        return load_config(raw).model_dump(mode="json")
    except (UserError, ValidationError, ValueError, TypeError):
        pass
    try:
        return RunConfig.model_validate(raw).model_dump(mode="json")
    except (ValidationError, ValueError, TypeError):
        return raw


def run_fingerprint(run_dir: str | os.PathLike) -> str | None:
    found = recorded(run_dir)
    return None if found is None else fingerprint(found[1])


def matching_runs(parent: str, name: str, config: Any) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    """``(newest run of name with config's fingerprint, newest run of name)`` under
    ``parent``, each ``(directory, checkpoint step)`` or None; only runs with a checkpoint."""
    runs = [(os.path.join(parent, d.name), step) for d, step in rundir.runs_of(parent, name)]
    want = fingerprint(config)
    match = next(((d, s) for d, s in runs if run_fingerprint(d) == want), None)
    return match, (runs[0] if runs else None)


@dataclasses.dataclass(frozen=True)
class Continuation:
    """What resuming ``directory`` at ``step`` with a config changes: the fields that
    define the run (``changed``, accepted) and the others (``other``: steps, cadences)."""

    directory: str
    step: int
    recorded_as: str
    changed: list[tuple[str, Any, Any]]
    other: list[tuple[str, Any, Any]]

    def notice(self, config: Any) -> str | None:
        """One paragraph on what the resume changes; None when it changes nothing."""
        if not self.changed and not self.other:
            return None
        parts = []
        if self.changed:
            parts.append(f"under a config that defines another run ({describe(self.changed)})")
        if self.other:
            parts.append(f"with other settings: {describe(self.other)}")
        text = f"Resuming {self.directory} at step {self.step} " + " and ".join(parts) + "."
        steps = [d for d in self.other if d[0] == "train.steps"]
        schedule = config.train.optimizer.schedule
        if steps and schedule != "constant":
            text += (f" The {schedule} learning-rate schedule spans train.steps, so from step {self.step} on it "
                     f"follows the new length.")
        return text + (f" This config will be recorded as {step_file(self.step)}; {self.recorded_as}, which trained "
                       "the earlier steps, stays as it was.")


def check_resume(directory: str, config: Any, *, step: int, accept_changed: bool, how: str,
                 accept_flag: str, fresh_advice: str) -> Continuation:
    """Raise :class:`UserError` when ``config`` defines another run than the one whose
    checkpoint at ``step`` is in ``directory``, naming the differing fields (unless
    ``accept_changed``); else what the resume changes. ``how`` says how ``directory`` was
    picked, ``accept_flag`` and ``fresh_advice`` how to accept it or to start afresh."""
    found = recorded(directory)
    if found is None:  # a checkpoint without a config (made before grpo wrote one): nothing to compare
        return Continuation(directory, step, CONFIG, [], [])
    name, old = found
    new = config.model_dump(mode="json")
    changed = differences(old, new, identity=True)
    if changed and not accept_changed:
        raise UserError(
            f"{how}: {directory} holds a checkpoint (step {step}) of a run made by another config: "
            f"{describe(changed)} {'differs' if len(changed) == 1 else 'differ'} from its {name}. These fields define a run (grpo.core.config.fingerprint "
            f"lists the ones that do not), so continuing its weights under them would mix two runs. "
            f"{fresh_advice}, or pass {accept_flag} to continue it anyway (the new config is then recorded as "
            f"{step_file(step)} beside the {name} that trained its earlier steps)."
        )
    return Continuation(directory, step, name, changed, differences(old, new, identity=False))


def record(run_dir: str | os.PathLike, config: Any, *, step: int | None) -> str | None:
    """Record ``config`` in ``run_dir``: as ``config.yaml`` for a new run (``step`` None),
    as ``config.step-N.yaml`` for a resume at ``step`` N when it differs from the latest
    recorded one; never overwrites what trained earlier steps. Returns the file written."""
    base = rundir.path(run_dir)
    if step is None or not config_files(run_dir):
        name = CONFIG
    else:
        found = recorded(run_dir)
        if found is not None and not differences(found[1], config, identity=None):
            return None
        name = step_file(step)
    rundir.write_text(base / name, config.to_yaml())
    info = {"fingerprint": fingerprint(config), "task": config.task.name, "config": name,
            "fields": "grpo.core.config.fingerprint: every field but NOT_IDENTITY"}
    rundir.write_text(base / IDENTITY, json.dumps(info, indent=2) + "\n")
    return name


def incompatible_checkpoint(run_dir: str | os.PathLike, config: Any, step: int, err: BaseException) -> UserError:
    """The error for a checkpoint whose arrays do not fit ``config``'s model (Orbax's
    ``Requested shape ... is not compatible with the stored shape ...``)."""
    from grpo.engine.runs.checkpoint import CheckpointMismatch

    # Orbax's first sentence says what differs; the rest suggests its own padding options.
    detail = str(err) if isinstance(err, CheckpointMismatch) else (
        (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0].rstrip(":."))
    detail = detail if len(detail) <= 300 else detail[:300] + " ..."
    found = recorded(run_dir)
    diffs = [] if found is None else differences(found[1], config, identity=None)
    diffs = [d for d in diffs if d[0].startswith("model.")]
    if diffs:
        why = f"this config's model differs from the run's {found[0]}: {describe(diffs)}"
    else:
        why = ("this config's model fields equal the run's recorded config, so the checkpoint was written by "
               "another model than the directory records (a run resumed under another model before grpo "
               "recorded each config)")
    return UserError(
        f"The checkpoint at step {step} in {os.fspath(run_dir)} does not fit this config's model ({detail}). "
        f"A checkpoint's shapes come from {MODEL_FIELDS}; {why}. Resume with the model that made the run, or start "
        "a new run (without --resume, or with another --run-dir)."
    )


def is_shape_mismatch(err: BaseException) -> bool:
    """Whether an Orbax restore failed because stored arrays do not fit the requested tree."""
    from grpo.engine.runs.checkpoint import CheckpointMismatch

    if isinstance(err, CheckpointMismatch):
        return True
    text = str(err).lower()
    return isinstance(err, (ValueError, KeyError, TypeError)) and (
        "shape" in text or "tree structure" in text or "do not match" in text or "not compatible" in text
    )


__all__ = [
    "CONFIG",
    "IDENTITY",
    "Continuation",
    "check_resume",
    "config_files",
    "incompatible_checkpoint",
    "is_shape_mismatch",
    "latest_config",
    "matching_runs",
    "record",
    "recorded",
    "resolved",
    "run_fingerprint",
    "step_file",
]
