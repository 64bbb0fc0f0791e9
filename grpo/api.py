"""grpo from Python: the machinery of ``grpo run``, ``grpo eval`` and ``grpo export``,
for notebooks and scripts (the CLI commands are thin layers over these functions).

    import grpo

    def exact(completions, prompts=None, answer=None, **kwargs):     # TRL's convention
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    result = grpo.train("configs/quickstart.yaml", overrides={"train.steps": 20},
                        reward_funcs=[exact], train_dataset=[{"prompt": "3+4=", "answer": "7"}, ...])
    result.run_dir, result.metrics["reward/mean"]

- A config is a YAML path, a dict or a loaded :class:`~grpo.core.config.RunConfig`;
  ``overrides`` are ``--set`` overrides, as a dict of dotted keys (``{"train.steps": 10}``)
  or a list of ``"KEY=VALUE"`` strings (the value YAML-parsed), applied the same way.
- ``reward_funcs`` (callables, or ``module:function`` paths) and ``train_dataset`` /
  ``eval_dataset`` (a ``datasets.Dataset``, a list of dicts, or a file path) go through the
  built-in ``custom`` task, exactly as a config naming them by import path would; the
  callables and in-memory datasets are kept in this process under ``session:`` names.
- Bad input raises the :class:`grpo.UserError` the CLI prints (same message).
- Multi-process runs (a TPU pod) run the same script on every process, as ``grpo run``.

Import-light until a function is called: ``import grpo`` does not import JAX.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence


from grpo.core.config import RunConfig
from grpo.core.config import load_config as _load_config
from grpo.core.config import read_yaml
from grpo.core.errors import UserError
from grpo.core.references import register

log = logging.getLogger("grpo")

Overrides = Mapping[str, Any] | Sequence[str] | None


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What :func:`train` returns: where the run is, and how it ended."""

    run_dir: str
    metrics: dict[str, Any]
    """The last step's metrics row (``reward/mean``, ``loss``, ...; docs/reference/metrics.md)."""
    eval: dict[str, Any] | None
    """The last evaluation's metrics (``eval/pass@1``, ...), None without evaluation."""
    summary: dict[str, Any]
    """``summary.json``: steps, the step it resumed from, wall time, counters."""


def _override_strings(overrides: Overrides) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        # JSON is YAML: each value parses back to itself, as `--set` would parse it.
        return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    if isinstance(overrides, str):
        return [overrides]
    return list(overrides)


def _raw(config: str | os.PathLike | Mapping[str, Any] | RunConfig) -> dict[str, Any]:
    if isinstance(config, RunConfig):
        return config.model_dump(mode="json")
    if isinstance(config, Mapping):
        return json.loads(json.dumps(dict(config)))  # a deep copy; overrides must not edit the caller's dict
    return read_yaml(config)


def _dataset_ref(data: Any, name: str) -> str | list[str]:
    if isinstance(data, (str, os.PathLike)):
        return os.fspath(data)
    if hasattr(data, "column_names") or (isinstance(data, Sequence) and all(isinstance(r, Mapping) for r in data)):
        return register(name, data)
    raise UserError(f"{name}: expected a datasets.Dataset, a list of dicts or a file path, got {type(data).__name__}.")


def _with_objects(raw: dict[str, Any], reward_funcs: Any, train_dataset: Any, eval_dataset: Any) -> dict[str, Any]:
    """``raw`` with the Python objects given to :func:`train` in its task section: the
    ``custom`` task's ``rewards`` and ``data_files`` (the task is switched to ``custom``
    when the config names another; then both rewards and a train dataset are needed)."""
    if reward_funcs is None and train_dataset is None and eval_dataset is None:
        return raw
    task = dict(raw.get("task") or {})
    if task.get("name") == "custom":
        options = dict(task.get("options") or {})
    else:
        if reward_funcs is None or train_dataset is None:
            raise UserError(
                f"The config's task is {task.get('name', 'gsm8k')!r}: reward_funcs and train_dataset go through the "
                "`custom` task, so give both (or set task.name=custom in the config and give the rest there)."
            )
        options = {}
    if reward_funcs is not None:
        funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
        options["rewards"] = [f if isinstance(f, str) else register(f"reward_{i}", f) for i, f in enumerate(funcs)]
    files = dict(options.get("data_files") or {})
    splits = raw.get("task") or {}
    if train_dataset is not None:
        files[splits.get("train_split", "train")] = _dataset_ref(train_dataset, "train_dataset")
    if eval_dataset is not None:
        files[splits.get("eval_split", "test")] = _dataset_ref(eval_dataset, "eval_dataset")
    if files:
        options["data_files"] = files
    task.update(name="custom", options=options)
    return dict(raw, task=task)


def load_config(
    config: str | os.PathLike | Mapping[str, Any] | RunConfig,
    overrides: Overrides = None,
    *,
    reward_funcs: Any = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
) -> RunConfig:
    """The validated run config: ``config`` (a YAML path, a dict or a RunConfig) with
    ``overrides`` applied as ``--set`` applies them, and the Python objects of
    :func:`train` in its task. Raises :class:`grpo.UserError` naming each bad field."""
    raw = _with_objects(_raw(config), reward_funcs, train_dataset, eval_dataset)
    return _load_config(raw, _override_strings(overrides))


def run_name(config: RunConfig, config_path: str | None, *, objects: bool = False) -> str:
    """The ``<name>`` of a run's default directory ``runs/<name>-<timestamp>``, which
    ``--resume`` looks among: ``name:``, else the config file's stem, else (a dict config
    without a name) the task and the config's fingerprint (``gsm8k-1a2b3c4d``, see
    :mod:`grpo.core.config.fingerprint`). A Python API run whose reward functions or
    datasets went through the ``custom`` task (``objects``) is named after that task
    (``custom-quickstart``), so it and the config's own runs never share a name."""
    from grpo.core.config.fingerprint import fingerprint

    if config.name:
        base = config.name
    elif config_path:
        base = Path(config_path).stem
    else:
        return f"{config.task.name}-{fingerprint(config)[:8]}"
    prefix = config.task.name + "-"
    return prefix + base if objects and base != config.task.name and not base.startswith(prefix) else base


def _agree(directory: str, step: int) -> tuple[str, int]:
    """Process 0's choice of a run directory, on every process (hosts may see different
    local ``runs/`` folders); unchanged in a single-process run."""
    import jax

    if jax.process_count() == 1:
        return directory, step
    import numpy as np
    from jax.experimental import multihost_utils

    code = np.frombuffer(directory.encode().ljust(4096, b"\0")[:4096], np.uint8)
    code = np.asarray(multihost_utils.broadcast_one_to_all(code))
    step = int(multihost_utils.broadcast_one_to_all(np.int64(step)))
    return bytes(code).rstrip(b"\0").decode(), step


_WORDS = {
    # how a run was picked, how to accept another config, how to start afresh
    True: ("--resume", "--run-dir", "--resume-changed", "Run without --resume for a new run"),
    False: ("resume=True", "run_dir", "resume_changed=True", "Call without resume=True for a new run"),
}


def run_directory(config: RunConfig, config_path: str | None, *, run_dir: str | None, resume: bool,
                  how: str, accept_changed: bool = False, name: str | None = None, cli: bool = True) -> str:
    """Where a run goes: ``run_dir`` when given; with ``resume`` the latest run of this
    config in ``runs/`` that holds a checkpoint: of the same name (:func:`run_name`) and the
    same fingerprint (:mod:`grpo.core.config.fingerprint`). When the latest run of that name
    was made by another config, a :class:`UserError` names the differing fields, unless
    ``accept_changed`` (``--resume-changed``) continues it anyway; with no run of that name,
    a new one. Without ``resume``: a new ``runs/<name>-<timestamp>``, with one line saying
    how to resume when a checkpoint of this config exists (``how``: the command or call)."""
    import jax

    from grpo.engine.runs import identity
    from grpo.engine.trainer import default_run_dir

    resume_word, _, accept_flag, fresh_advice = _WORDS[cli]
    if run_dir and resume:
        raise UserError("--resume and --run-dir: give one (--run-dir DIR alone resumes DIR when it holds a checkpoint).")
    if run_dir:
        return str(run_dir)  # a string, not a Path: pathlib would turn gs://bucket/x into gs:/bucket/x
    name = name or run_name(config, config_path)
    fresh = str(default_run_dir(config, config_path, name=name))
    parent = os.path.dirname(fresh)
    match, newest = identity.matching_runs(parent, name, config)
    pick = match or (newest if resume and accept_changed else None)
    directory, step = _agree(*(pick or ("", -1)))
    main = jax.process_index() == 0
    if resume:
        if directory:
            if main:
                same = " made by this config" if pick == match else ", made by another config"
                print(f"--resume: continuing {directory} (the latest run of {name!r}{same}) from its checkpoint at "
                      f"step {step}", flush=True)
            return directory
        if newest is not None:  # runs of this name, none of this config: say which fields differ
            identity.check_resume(newest[0], config, step=newest[1], accept_changed=False,
                                  how=f"{resume_word} (the latest run of {name!r})", accept_flag=accept_flag,
                                  fresh_advice=fresh_advice)
        if main:
            print(f"--resume: no run of {name!r} with a checkpoint in {parent}/; starting a new run", flush=True)
        return fresh
    if directory and main:
        print(f"A checkpoint of {name!r} exists ({directory}, step {step}); to continue it instead: {how}", flush=True)
    return fresh


def _missing_dirs(directory: str) -> list[str]:
    """``directory`` and those of its parents that do not exist yet, deepest first."""
    missing, here = [], os.path.abspath(directory)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        missing.append(here)
        here = os.path.dirname(here)
    return missing


def _remove_if_empty(created: list[str]) -> None:
    """A run that stopped before writing anything (a config that fails validation against
    the devices, a model that cannot be built) leaves none of the directories it made."""
    for directory in created:
        try:
            os.rmdir(directory)  # only ever removes an empty directory
        except OSError:
            return


def _continue(directory: str, cfg: RunConfig, *, accept_changed: bool, cli: bool, picked: bool) -> RunResult | None:
    """Before a run continues ``directory``'s checkpoint: refuse a config that defines
    another run (unless ``accept_changed``), say what else the resume changes (another
    ``train.steps``), and when the checkpoint already reached ``train.steps``, return the
    run's result without touching a file (None: train)."""
    import jax

    from grpo.engine.runs import identity, rundir

    steps = rundir.checkpoint_steps(directory)
    if not steps:
        return None
    resume_word, dir_word, accept_flag, fresh_advice = _WORDS[cli]
    how = resume_word if picked else dir_word
    advice = fresh_advice if picked else f"Pick another {dir_word} (or none) for a new run"
    cont = identity.check_resume(directory, cfg, step=steps[-1], accept_changed=accept_changed, how=how,
                                 accept_flag=accept_flag, fresh_advice=advice)
    main = jax.process_index() == 0
    if steps[-1] >= cfg.train.steps:
        if main:
            print(f"Nothing to do: {directory} holds a checkpoint at step {steps[-1]} and train.steps is "
                  f"{cfg.train.steps}; no file was changed. To train further, set a larger train.steps "
                  f"(--set train.steps=N).", flush=True)
        base = rundir.path(directory) / "summary.json"
        summary = json.loads(base.read_text()) if base.exists() else {"steps": steps[-1]}
        return RunResult(run_dir=directory, metrics=dict(summary.get("final") or {}), eval=summary.get("eval"),
                         summary=summary)
    notice = cont.notice(cfg)
    if notice and main:
        print(notice, flush=True)
    return None


def train(
    config: str | os.PathLike | Mapping[str, Any] | RunConfig,
    *,
    overrides: Overrides = None,
    reward_funcs: Any = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    run_dir: str | os.PathLike | None = None,
    resume: bool = False,
    resume_changed: bool = False,
    _cli: bool = False,
) -> RunResult:
    """Train (``grpo run``): returns the run directory and the final metrics.

    ``run_dir`` resumes when it holds a checkpoint; ``resume=True`` continues the latest
    run of this config in ``runs/`` (same name, same fingerprint: see :func:`run_name` and
    :mod:`grpo.core.config.fingerprint`). Continuing a checkpoint made by a config that
    defines another run (model, task, data, seed, algorithm) raises :class:`grpo.UserError`
    naming the fields, unless ``resume_changed=True``, which continues it and records the
    new config beside the old one (``config.step-N.yaml``). A checkpoint already at
    ``train.steps`` returns its result and changes no file. A signal (SIGTERM, Ctrl-C)
    saves a checkpoint and raises :class:`grpo.engine.trainer.Interrupted` (its ``run_dir``
    says where). ``_cli``: called by ``grpo run`` (its messages name CLI flags)."""
    from grpo.engine.parallel import distributed
    from grpo.engine.runs import rundir
    from grpo.engine.trainer import Interrupted, Trainer

    config_path = None if isinstance(config, (Mapping, RunConfig)) else os.fspath(config)
    cfg = load_config(config, overrides, reward_funcs=reward_funcs, train_dataset=train_dataset,
                      eval_dataset=eval_dataset)
    # The distributed runtime must start before anything asks JAX about devices.
    distributed.initialize(cfg.distributed)
    sets = "".join(f" --set {shlex.quote(o)}" for o in _override_strings(overrides))
    how = "grpo.train(..., resume=True)"
    if _cli and config_path:
        how = f"grpo run {shlex.quote(config_path)} --resume{sets}"
    objects = any(x is not None for x in (reward_funcs, train_dataset, eval_dataset))
    directory = run_directory(cfg, config_path, run_dir=None if run_dir is None else os.fspath(run_dir),
                              resume=resume, how=how, accept_changed=resume_changed,
                              name=run_name(cfg, config_path, objects=objects), cli=_cli)
    created = [] if rundir.is_remote(directory) else _missing_dirs(directory)
    try:
        # Unreachable bucket or missing credentials: a one-paragraph error now, before the
        # run directory is read (its checkpoints, its config) and before anything compiles.
        rundir.probe(directory)
        done = _continue(directory, cfg, accept_changed=resume_changed, cli=_cli, picked=run_dir is None)
        if done is not None:
            return done
        trainer = Trainer(cfg, directory)
        summary = trainer.run()
    except Interrupted as stop:
        stop.run_dir, stop.is_main = directory, trainer.is_main
        raise
    except BaseException:
        _remove_if_empty(created)
        raise
    return RunResult(run_dir=directory, metrics=dict(summary.get("final") or {}), eval=summary.get("eval"),
                     summary=summary)


def _saved_config(run_dir: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
    """The config that trained ``run_dir`` up to ``step`` (the latest one by default)."""
    from grpo.engine.runs import identity, rundir

    if not rundir.readable_run_dir(run_dir, need="config.yaml"):
        raise UserError(f"{os.fspath(run_dir)} is not a grpo run directory (no config.yaml).")
    return identity.latest_config(run_dir, step)[1]


def evaluate(
    run_dir: str | os.PathLike,
    *,
    step: int | None = None,
    overrides: Overrides = None,
    reward_funcs: Any = None,
    eval_dataset: Any = None,
) -> dict[str, Any]:
    """Evaluate a run's checkpoint (``grpo eval``): the run's own config and eval settings
    (``overrides`` may change ``eval.*``, e.g. ``{"eval.greedy": False, "eval.k": 8}``),
    its latest checkpoint or ``step``. Returns the metrics an evaluation during training logs (``eval/pass@1``, ...).
    A run trained from Python callables needs them again (``reward_funcs``, ``eval_dataset``)."""
    from grpo.engine.parallel import distributed
    from grpo.engine.runs import rundir
    from grpo.engine.trainer import Trainer

    raw = _with_objects(_saved_config(run_dir, step), reward_funcs, None, eval_dataset)
    cfg = _load_config(raw, _override_strings(overrides))
    distributed.initialize(cfg.distributed)
    steps = rundir.checkpoint_steps(run_dir)
    if not steps:
        raise UserError(f"{os.fspath(run_dir)} holds no checkpoint to evaluate.")
    if step is not None and step not in steps:
        raise UserError(f"{os.fspath(run_dir)} has no checkpoint at step {step} (it has: {', '.join(map(str, steps))}).")
    trainer = Trainer(cfg, run_dir)
    try:
        state, meta = trainer.checkpointer.restore(trainer._state(), steps[-1] if step is None else step)
        trainer.params, trainer.opt_state = state["params"], state["opt_state"]
        trainer.step = int(meta["step"])
        trainer.evaluator.prepare()
        return trainer.evaluate()
    finally:
        trainer.checkpointer.close()


def export(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: int | None = None,
           adapter: bool = False) -> Path:
    """Write a run's trained policy as a Hugging Face directory (``grpo export``); LoRA
    runs: merged weights, or with ``adapter=True`` the adapters alone (PEFT)."""
    from grpo.engine.runs.export import export_run

    return export_run(run_dir, out_dir, step=step, adapter=adapter)


def configure_logging() -> None:
    """grpo's progress at INFO on stderr, other libraries' from WARNING up (what the CLI does)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("grpo").setLevel(logging.INFO)


__all__ = ["RunResult", "configure_logging", "evaluate", "export", "load_config", "run_directory", "run_name", "train"]
