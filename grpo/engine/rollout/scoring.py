"""Scoring completions with a task's named reward functions (task-independent).

A reward function that raises, or returns something that is not a number (or an
infinity), scores 0 for that completion and is counted in :attr:`Scores.errors` (with the
first message in :attr:`Scores.first_errors`, its row in :attr:`Scores.first_error_rows`)
— a buggy reward must show up in the metrics and the run's log; the trainer stops a run
only when a function fails on every completion of a step.

``None`` or NaN means "not applicable to this completion" (TRL's convention: it adds the
functions' rewards with ``nansum``): 0 in that reward and in the total, counted in
:attr:`Scores.not_applicable`, never as an error.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping, Sequence

import numpy as np
from pydantic import BaseModel

from grpo.core.contracts import TaskPlugin

TOTAL = "total"
"""The weighted total's name in metrics (``reward/total/mean``); no reward may use it."""

OVERLONG = "overlong"
"""The name of the overlong-shaping penalty (``task.overlong``) among a step's rewards."""


@dataclasses.dataclass(frozen=True)
class Scores:
    """Rewards of a batch of completions.

    - ``rewards[i]``: reward name -> value for completion i (every name, errors as 0.0);
    - ``totals[i]``: the weighted sum of ``rewards[i]``;
    - ``correct[i]``: ``task.is_correct(rewards[i])``;
    - ``errors``: reward name -> how many completions its function failed on;
    - ``first_errors``: reward name -> the first failure (``"ValueError: ..."``);
      ``first_error_rows``: reward name -> the completion it failed on first;
    - ``failed[i]``: the names that failed on completion i;
    - ``not_applicable``: reward name -> how many completions it returned None or NaN
      for (scored 0, not an error); ``inapplicable[i]``: those names of completion i.
    """

    names: tuple[str, ...]
    weights: dict[str, float]
    rewards: list[dict[str, float]]
    totals: list[float]
    correct: list[bool]
    errors: dict[str, int]
    first_errors: dict[str, str]
    failed: list[tuple[str, ...]]
    first_error_rows: dict[str, int] = dataclasses.field(default_factory=dict)
    not_applicable: dict[str, int] = dataclasses.field(default_factory=dict)
    inapplicable: list[tuple[str, ...]] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.totals)

    def means(self) -> dict[str, float]:
        """Mean of each reward and of the total (0.0 for an empty batch)."""
        n = max(len(self.totals), 1)
        out = {name: sum(r[name] for r in self.rewards) / n for name in self.names}
        out[TOTAL] = sum(self.totals) / n
        return out

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """``{prefix}/<name>/mean``, ``{prefix}/<name>/errors`` per reward, ``{prefix}/total/mean``,
        ``{prefix}/total/std`` and ``{prefix}/accuracy`` (fraction judged correct);
        ``{prefix}/<name>/not_applicable`` for a reward that returned None or NaN."""
        out: dict[str, float] = {}
        for name, mean in self.means().items():
            out[f"{prefix}/{name}/mean"] = mean
        for name in self.names:
            out[f"{prefix}/{name}/errors"] = float(self.errors[name])
            if self.not_applicable.get(name):
                out[f"{prefix}/{name}/not_applicable"] = float(self.not_applicable[name])
        n = len(self.totals)
        mean = out[f"{prefix}/{TOTAL}/mean"]
        out[f"{prefix}/{TOTAL}/std"] = math.sqrt(sum((t - mean) ** 2 for t in self.totals) / n) if n else 0.0
        out[f"{prefix}/accuracy"] = sum(self.correct) / n if n else 0.0
        return out


def _as_reward(value: Any) -> float | None:
    """A reward function's value as a float; None for "not applicable" (None or NaN)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        # numpy/JAX scalars are numbers.Real or have __float__; anything else is a bug.
        if hasattr(value, "__float__") and getattr(value, "shape", ()) == ():
            value = float(value)
        else:
            raise TypeError(f"returned {type(value).__name__} {value!r:.60}, not a number")
    value = float(value)
    if math.isnan(value):
        return None
    if not math.isfinite(value):
        raise ValueError(f"returned {value}, not a finite number")
    return value


def overlong_penalty(lengths: np.ndarray, *, max_new_tokens: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO's soft overlong punishment of completions of ``lengths`` tokens [b]:
    ``min(-(L - (max_new_tokens - buffer)) / buffer * factor, 0)`` [b] float32, so 0 up to
    ``max_new_tokens - buffer`` tokens and ``-factor`` at the cap. Host-side NumPy: it is
    added to the task's rewards before they leave the host."""
    if not 0 < buffer < max_new_tokens:
        raise ValueError(f"buffer={buffer} must be in (0, max_new_tokens={max_new_tokens})")
    excess = np.asarray(lengths, np.float64) - (max_new_tokens - buffer)
    return np.minimum(-excess / buffer * factor, 0.0).astype(np.float32)


def reward_weights(task: TaskPlugin, options: BaseModel, functions: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The weight of each of ``task``'s rewards in the total (1.0 for those its
    ``reward_weights`` leaves out); ValueError for a weight naming no reward."""
    functions = task.reward_functions(options=options) if functions is None else functions
    weights = dict(task.reward_weights(options=options))
    stray = sorted(set(weights) - set(functions))
    if stray:
        raise ValueError(f"task {task.name!r} gives weights for rewards it does not define: {stray}")
    return {name: float(weights.get(name, 1.0)) for name in functions}


def run_reward_weights(config: Any, task: TaskPlugin, options: BaseModel) -> dict[str, float]:
    """The weight of every reward a run logs in ``reward/mean``: the task's
    (:func:`reward_weights`) and, with ``task.overlong``, the length penalty's (1)."""
    weights = reward_weights(task, options)
    if config.task.overlong.buffer:
        weights[OVERLONG] = 1.0
    return weights


def score_completions(
    task: TaskPlugin,
    options: BaseModel,
    examples: Sequence[Mapping[str, Any]],
    completions: Sequence[str],
) -> Scores:
    """Score ``completions[i]`` against ``examples[i]`` with every reward of ``task``.

    The trainer passes each example once per generation (a GRPO group is consecutive
    rows). Never raises because a reward function failed; raises ValueError for
    mismatched inputs or a task whose weights name a reward it does not have.
    """
    if len(examples) != len(completions):
        raise ValueError(f"{len(examples)} examples but {len(completions)} completions; pass one example per completion")
    functions = task.reward_functions(options=options)
    if TOTAL in functions:
        raise ValueError(f"task {task.name!r} defines a reward named {TOTAL!r}, which is reserved for the weighted total")
    weights = reward_weights(task, options, functions)
    names = tuple(functions)
    errors = {name: 0 for name in names}
    first_errors: dict[str, str] = {}
    first_rows: dict[str, int] = {}
    not_applicable = {name: 0 for name in names}
    inapplicable: list[tuple[str, ...]] = []
    rewards: list[dict[str, float]] = []
    totals: list[float] = []
    correct: list[bool] = []
    failed: list[tuple[str, ...]] = []
    for row, (example, completion) in enumerate(zip(examples, completions)):
        if not isinstance(completion, str):
            raise ValueError(f"completions must be strings, got {type(completion).__name__}")
        values: dict[str, float] = {}
        bad: list[str] = []
        skipped: list[str] = []
        for name, fn in functions.items():
            try:
                value = _as_reward(fn(completion, example))
            except Exception as err:  # noqa: BLE001 - a failing reward scores 0 and is counted
                values[name] = 0.0
                errors[name] += 1
                bad.append(name)
                if name not in first_errors:
                    first_errors[name] = f"{type(err).__name__}: {err}"
                    first_rows[name] = row
                continue
            if value is None:  # not applicable: 0, as TRL's nansum adds it
                not_applicable[name] += 1
                skipped.append(name)
            values[name] = 0.0 if value is None else value
        rewards.append(values)
        totals.append(sum(weights[n] * values[n] for n in names))
        correct.append(bool(task.is_correct(values, options=options)))
        failed.append(tuple(bad))
        inapplicable.append(tuple(skipped))
    return Scores(
        names=names,
        weights=weights,
        rewards=rewards,
        totals=totals,
        correct=correct,
        errors=errors,
        first_errors=first_errors,
        failed=failed,
        first_error_rows=first_rows,
        not_applicable=not_applicable,
        inapplicable=inapplicable,
    )
