"""Scoring completions with a task's named reward functions (task-independent).

A reward function that raises, or returns something that is not a finite number, scores
0 for that completion and is counted in :attr:`Scores.errors` (with the first message in
:attr:`Scores.first_errors`) — a buggy reward must show up in the metrics, never stop a
run hours in.
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
    - ``failed[i]``: the names that failed on completion i.
    """

    names: tuple[str, ...]
    weights: dict[str, float]
    rewards: list[dict[str, float]]
    totals: list[float]
    correct: list[bool]
    errors: dict[str, int]
    first_errors: dict[str, str]
    failed: list[tuple[str, ...]]

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
        ``{prefix}/total/std`` and ``{prefix}/accuracy`` (fraction judged correct)."""
        out: dict[str, float] = {}
        for name, mean in self.means().items():
            out[f"{prefix}/{name}/mean"] = mean
        for name in self.names:
            out[f"{prefix}/{name}/errors"] = float(self.errors[name])
        n = len(self.totals)
        mean = out[f"{prefix}/{TOTAL}/mean"]
        out[f"{prefix}/{TOTAL}/std"] = math.sqrt(sum((t - mean) ** 2 for t in self.totals) / n) if n else 0.0
        out[f"{prefix}/accuracy"] = sum(self.correct) / n if n else 0.0
        return out


def _as_reward(value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        # numpy/JAX scalars are numbers.Real or have __float__; anything else is a bug.
        if hasattr(value, "__float__") and getattr(value, "shape", ()) == ():
            value = float(value)
        else:
            raise TypeError(f"returned {type(value).__name__} {value!r:.60}, not a number")
    value = float(value)
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
    rewards: list[dict[str, float]] = []
    totals: list[float] = []
    correct: list[bool] = []
    failed: list[tuple[str, ...]] = []
    for example, completion in zip(examples, completions):
        if not isinstance(completion, str):
            raise ValueError(f"completions must be strings, got {type(completion).__name__}")
        values: dict[str, float] = {}
        bad: list[str] = []
        for name, fn in functions.items():
            try:
                values[name] = _as_reward(fn(completion, example))
            except Exception as err:  # noqa: BLE001 - a failing reward scores 0 and is counted
                values[name] = 0.0
                errors[name] += 1
                bad.append(name)
                first_errors.setdefault(name, f"{type(err).__name__}: {err}")
        rewards.append(values)
        totals.append(sum(weights[n] * values[n] for n in names))
        correct.append(bool(task.is_correct(values, options=options)))
        failed.append(tuple(bad))
    return Scores(
        names=names,
        weights=weights,
        rewards=rewards,
        totals=totals,
        correct=correct,
        errors=errors,
        first_errors=first_errors,
        failed=failed,
    )
