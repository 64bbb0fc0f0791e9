"""Scoring completions with a task's named reward functions (task-independent).

A reward function is per-completion (``fn(completion, example)``, called once a row) or
batched (:func:`grpo.batched_reward`: ``fn(completions, prompts, **columns)``, called
once a step's rows or once a group's, TRL's convention). :class:`RewardScorer` calls
them through a :class:`~grpo.engine.rollout.reward_pool.RewardPool` (inline, on
threads or in processes, each call within ``task.reward_timeout_s``), can start a batch
of rows and collect it later (:meth:`RewardScorer.start`, :meth:`RewardScorer.collect`:
a group scored while the rest of the step decodes), and assembles the rows in row order,
so the scores do not depend on which call finished first.

A reward function that raises, or returns something that is not a number (or an
infinity), or a batched one that returns the wrong number of values, scores 0 for those
completions and is counted in :attr:`Scores.errors` (with the first message in
:attr:`Scores.first_errors`, its row in :attr:`Scores.first_error_rows`); a call past
its timeout likewise, counted in :attr:`Scores.timeouts` — a buggy reward must show up in
the metrics and the run's log; the trainer stops a run only when a function fails (errors
and timeouts together) on every completion of a step.

``None`` or NaN means "not applicable to this completion" (TRL's convention: it adds the
functions' rewards with ``nansum``): 0 in that reward and in the total, counted in
:attr:`Scores.not_applicable`, never as an error.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import numbers
from typing import Any, Mapping, Sequence

import numpy as np
from pydantic import BaseModel

from grpo.core.contracts import TaskPlugin, reward_batch
from grpo.engine.rollout.reward_pool import RemoteError, RewardPool, RewardTimeout, call_batched, invoke

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
      for (scored 0, not an error); ``inapplicable[i]``: those names of completion i;
    - ``timeouts``: reward name -> how many completions its call ran past
      ``task.reward_timeout_s`` for (scored 0, not in ``errors``); ``timed_out[i]``: those
      names of completion i.
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
    timeouts: dict[str, int] = dataclasses.field(default_factory=dict)
    timed_out: list[tuple[str, ...]] = dataclasses.field(default_factory=list)

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
        ``{prefix}/<name>/not_applicable`` for a reward that returned None or NaN, and
        ``{prefix}/<name>/timeouts`` for one whose calls ran past their timeout."""
        out: dict[str, float] = {}
        for name, mean in self.means().items():
            out[f"{prefix}/{name}/mean"] = mean
        for name in self.names:
            out[f"{prefix}/{name}/errors"] = float(self.errors[name])
            if self.not_applicable.get(name):
                out[f"{prefix}/{name}/not_applicable"] = float(self.not_applicable[name])
            if self.timeouts.get(name):
                out[f"{prefix}/{name}/timeouts"] = float(self.timeouts[name])
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


def _message(err: BaseException) -> str:
    return str(err) if isinstance(err, RemoteError) else f"{type(err).__name__}: {err}"


# --------------------------------------------------------------------------- the scorer


@dataclasses.dataclass
class _Call:
    name: str
    kind: str  # "one" or "batch"
    rows: list[int]  # indices into the part's rows
    future: concurrent.futures.Future
    retry: bool  # a failed step-batched call is retried row by row


@dataclasses.dataclass
class Pending:
    """Rows handed to :meth:`RewardScorer.start` whose calls may still run: ``rows``
    (their indices in the step's batch), examples and completions, and the calls."""

    rows: list[int]
    examples: list[Mapping[str, Any]]
    completions: list[str]
    calls: list[_Call]


class RewardScorer:
    """A task's reward functions, called as each declares (per completion, per step or
    per group: :func:`grpo.batched_reward`) on a :class:`RewardPool` (``timeout_s``,
    ``threads``, ``processes`` for the rewards named in ``process_rewards``; none of
    them, nor ``background``: every call inline, on the calling thread, so :meth:`start`
    returns once they are done). ``group_size``: the rows of a group (None: a group is a
    run of consecutive rows with equal examples). ValueError for a
    task whose weights name a reward it does not have, or a reward named ``total``."""

    def __init__(self, task: TaskPlugin, options: BaseModel, *, timeout_s: float | None = None, threads: int = 1,
                 processes: int = 0, process_rewards: Sequence[str] = (), group_size: int | None = None,
                 background: bool = False):
        self.task, self.options, self.group_size = task, options, group_size
        self.functions = dict(task.reward_functions(options=options))
        if TOTAL in self.functions:
            raise ValueError(f"task {task.name!r} defines a reward named {TOTAL!r}, which is reserved for the weighted "
                             "total")
        self.weights = reward_weights(task, options, self.functions)
        self.names = tuple(self.functions)
        self.batch = {name: reward_batch(fn) for name, fn in self.functions.items()}
        self.calls: dict[str, int] = {name: 0 for name in self.names}  # calls made, by reward (retries included)
        process_rewards = tuple(n for n in process_rewards if n in self.functions)
        self.pool: RewardPool | None = None
        if background or timeout_s is not None or threads > 1 or (processes and process_rewards):
            spec = (task.name, options.model_dump()) if process_rewards else None
            self.pool = RewardPool(timeout_s=timeout_s, threads=threads, processes=processes,
                                   process_lanes=process_rewards, spec=spec)

    @classmethod
    def for_run(cls, config: Any, task: TaskPlugin, options: BaseModel, *, group_size: int | None = None
                ) -> "RewardScorer":
        """The scorer of a run's config (``task.reward_timeout_s``, ``reward_threads``,
        ``reward_processes``, ``process_rewards``; ``reward_scoring: overlap`` calls on
        workers even without those, so a group's calls run while the rest decodes)."""
        t = config.task
        return cls(task, options, timeout_s=t.reward_timeout_s, threads=t.reward_workers,
                   processes=t.reward_processes, process_rewards=t.process_rewards, group_size=group_size,
                   background=t.reward_scoring == "overlap")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    # ------------------------------------------------------------------ starting calls

    def _submit(self, name: str, kind: str, args: tuple) -> concurrent.futures.Future:
        self.calls[name] += 1
        fn = self.functions[name]
        if self.pool is None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            try:
                future.set_result(invoke(fn, kind, args))
            except Exception as err:  # noqa: BLE001 - a failing reward scores 0 and is counted
                future.set_exception(err)
            return future
        return self.pool.submit(name, lambda: invoke(fn, kind, args), remote=(name, kind, args))

    def _groups(self, examples: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        n = len(examples)
        if self.group_size:
            return [list(range(i, min(i + self.group_size, n))) for i in range(0, n, self.group_size)]
        groups: list[list[int]] = []
        for i, ex in enumerate(examples):
            if groups and examples[groups[-1][0]] == ex:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def _batch_args(self, rows: list[int], examples: Sequence[Mapping[str, Any]], completions: Sequence[str],
                    prompts: Sequence[Any] | Mapping[int, Any]) -> tuple:
        keys: dict[str, None] = {}
        for i in rows:
            keys.update(dict.fromkeys(examples[i]))
        columns = {k: [examples[i].get(k) for i in rows] for k in keys}
        return [completions[i] for i in rows], [prompts[i] for i in rows], columns

    @property
    def row_names(self) -> tuple[str, ...]:
        """The rewards called per completion: a row can be scored by them alone, as soon as it
        finishes (overlapped scoring), without waiting for the rest of its group."""
        return tuple(n for n in self.names if self.batch[n] is None)

    def start(self, examples: Sequence[Mapping[str, Any]], completions: Sequence[str], *,
              rows: Sequence[int] | None = None, names: Sequence[str] | None = None) -> Pending:
        """Start every call for ``completions[i]`` against ``examples[i]`` (rows ``rows``
        of the batch; default 0..n-1), of every reward or of ``names`` only (a row's other
        rewards then come in another part: :meth:`collect` joins a row's parts). Whole
        groups only, for a function batched per group."""
        if len(examples) != len(completions):
            raise ValueError(f"{len(examples)} examples but {len(completions)} completions; pass one example per "
                             "completion")
        for c in completions:
            if not isinstance(c, str):
                raise ValueError(f"completions must be strings, got {type(c).__name__}")
        examples, completions = list(examples), list(completions)
        n = len(completions)
        calls: list[_Call] = []
        batched = [name for name in self.names if self.batch[name]]
        prompts: list[Any] = []
        if batched and n:
            prompts = [self.task.prompt_messages(ex, options=self.options) for ex in examples]
        for name in self.names if names is None else [n for n in self.names if n in names]:
            per = self.batch[name]
            if per is None:
                for i in range(n):
                    calls.append(_Call(name, "one", [i], self._submit(name, "one", (completions[i], examples[i])),
                                       False))
                continue
            for part in ([list(range(n))] if per == "step" else self._groups(examples)) if n else []:
                args = self._batch_args(part, examples, completions, prompts)
                calls.append(_Call(name, "batch", part, self._submit(name, "batch", args), per == "step" and len(part) > 1))
        return Pending(list(range(n)) if rows is None else list(rows), examples, completions, calls)

    # ------------------------------------------------------------------ collecting

    def collect(self, parts: Sequence[Pending]) -> Scores:
        """Wait for ``parts``' calls (and retries) and assemble their rows, in row order
        (by ``rows``), whatever order the calls finished in. A row may be in several parts,
        each with some of its rewards (:meth:`start`'s ``names``)."""
        order = sorted({row for p in parts for row in p.rows})
        n = len(order)
        names = self.names
        values = [[0.0] * len(names) for _ in range(n)]
        state = [[0] * len(names) for _ in range(n)]  # 0 ok, 1 error, 2 not applicable, 3 timeout
        message: dict[tuple[int, int], str] = {}
        pos_of = {row: pos for pos, row in enumerate(order)}
        where = {(pi, i): pos_of[row] for pi, p in enumerate(parts) for i, row in enumerate(p.rows)}
        col = {name: j for j, name in enumerate(names)}

        def record(pos: int, j: int, value: Any = None, err: BaseException | None = None) -> None:
            if err is None:
                try:
                    value = _as_reward(value)
                except Exception as bad:  # noqa: BLE001
                    err = bad
            if err is not None:
                state[pos][j] = 3 if isinstance(err, RewardTimeout) else 1
                values[pos][j] = 0.0
                message[pos, j] = _message(err)
            elif value is None:  # not applicable: 0, as TRL's nansum adds it
                state[pos][j], values[pos][j] = 2, 0.0
            else:
                state[pos][j], values[pos][j] = 0, value

        retries: list[tuple[int, int, concurrent.futures.Future]] = []
        for pi, p in enumerate(parts):
            for call in p.calls:
                j = col[call.name]
                try:
                    out = call.future.result()
                except Exception as err:  # noqa: BLE001
                    out, err_ = None, err
                else:
                    err_ = None
                if call.kind == "one":
                    record(where[pi, call.rows[0]], j, out, err_)
                    continue
                if err_ is None:
                    for i, v in zip(call.rows, out):
                        record(where[pi, i], j, v)
                    continue
                for i in call.rows:
                    record(where[pi, i], j, err=err_)
                    if call.retry and not isinstance(err_, RewardTimeout):
                        args = self._batch_args([i], p.examples, p.completions,
                                                {i: self.task.prompt_messages(p.examples[i], options=self.options)})
                        retries.append((where[pi, i], j, self._submit(call.name, "batch", args)))
        for pos, j, future in retries:
            try:
                out = future.result()
            except Exception as err:  # noqa: BLE001
                record(pos, j, err=err)
            else:
                record(pos, j, out[0])
        return self._scores(parts, order, values, state, message)

    def _scores(self, parts: Sequence[Pending], order: list, values: list, state: list, message: dict) -> Scores:
        names = self.names
        errors = {n: 0 for n in names}
        timeouts = {n: 0 for n in names}
        not_applicable = {n: 0 for n in names}
        first_errors: dict[str, str] = {}
        first_rows: dict[str, int] = {}
        rewards, totals, correct, failed, inapplicable, timed_out = [], [], [], [], [], []
        for pos in range(len(order)):
            row = dict(zip(names, values[pos]))
            rewards.append(row)
            totals.append(sum(self.weights[n] * row[n] for n in names))
            correct.append(bool(self.task.is_correct(row, options=self.options)))
            kinds = {1: [], 2: [], 3: []}
            for j, n in enumerate(names):
                k = state[pos][j]
                if k:
                    kinds[k].append(n)
                if k in (1, 3) and n not in first_errors:
                    first_errors[n], first_rows[n] = message[pos, j], pos
            for n in kinds[1]:
                errors[n] += 1
            for n in kinds[2]:
                not_applicable[n] += 1
            for n in kinds[3]:
                timeouts[n] += 1
            failed.append(tuple(kinds[1]))
            inapplicable.append(tuple(kinds[2]))
            timed_out.append(tuple(kinds[3]))
        return Scores(names=names, weights=self.weights, rewards=rewards, totals=totals, correct=correct,
                      errors=errors, first_errors=first_errors, failed=failed, first_error_rows=first_rows,
                      not_applicable=not_applicable, inapplicable=inapplicable, timeouts=timeouts,
                      timed_out=timed_out)

    def score(self, examples: Sequence[Mapping[str, Any]], completions: Sequence[str]) -> Scores:
        """Start and collect at once."""
        return self.collect([self.start(examples, completions)])


def score_completions(
    task: TaskPlugin,
    options: BaseModel,
    examples: Sequence[Mapping[str, Any]],
    completions: Sequence[str],
    *,
    group_size: int | None = None,
    scorer: RewardScorer | None = None,
) -> Scores:
    """Score ``completions[i]`` against ``examples[i]`` with every reward of ``task``
    (through ``scorer``, else an inline :class:`RewardScorer`; ``group_size``: the rows
    of a group, for rewards batched per group).

    The trainer passes each example once per generation (a GRPO group is consecutive
    rows). Never raises because a reward function failed; raises ValueError for
    mismatched inputs or a task whose weights name a reward it does not have.
    """
    if len(examples) != len(completions):
        raise ValueError(f"{len(examples)} examples but {len(completions)} completions; pass one example per completion")
    if scorer is None:
        scorer = RewardScorer(task, options, group_size=group_size)
    return scorer.score(examples, completions)

