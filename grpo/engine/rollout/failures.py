"""What a run says about its reward functions' failures (the trainer calls it once a step).

A failing reward function scores 0 and is counted (:mod:`grpo.engine.rollout.scoring`);
counting alone is silent. So, for each function:

- its first failure in the run is logged once (a warning on stderr: the function's name,
  the step, the row of the step's scored batch and the exception's message), and written as
  one line of ``reward_errors.jsonl`` in the run directory (``{"step", "reward", "row",
  "error"}``; process 0's rows, and a resumed run adds its own first failures);
- a function that fails on every completion a step scored — raising, returning a
  non-number or the wrong length, or running past ``task.reward_timeout_s``, in any mix —
  stops the run with a :class:`~grpo.core.errors.UserError` (exit status 2, no traceback)
  naming it and quoting its first failure: a run would otherwise train on a reward that is
  never computed. A function that fails on some rows only never stops the run: those rows
  score 0 for it, and the step's counts are in the metrics.

Every failure still counts in ``reward_errors`` (the metrics' running total and the
summary's per-function totals; timeouts included), and in the step's
``reward/<name>/errors`` and ``reward/<name>/timeouts`` (logged when not 0). A function
that returned ``None`` or NaN ("not applicable") did not fail: those count in
``reward/<name>/not_applicable`` (the step's rows, logged when not 0). A judge
(``task.model_rewards``, ``kind: judge``) has no value only where its parser could not
read its reply: those rows count on their own, in ``reward/<name>/parse_failures``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from grpo.core.errors import UserError

log = logging.getLogger("grpo.rewards")

LOG_NAME = "reward_errors.jsonl"
"""The file in the run directory that holds each reward function's first failure."""


class RewardFailures:
    """Reports a run's reward failures (see the module docstring). ``write(row)``
    appends a row to the run directory's :data:`LOG_NAME` (None: nothing written, as on
    every process but 0); ``where``: that file's path, for the messages; ``judges``: the
    rewards whose rows without a value are parse failures (``reward/<name>/parse_failures``)."""

    def __init__(self, write: Callable[[dict[str, Any]], None] | None = None, *, where: str = LOG_NAME,
                 judges: Sequence[str] = ()):
        self.write = write
        self.where = where
        self.judges = frozenset(judges)
        self.reported: set[str] = set()

    def observe(self, step: int, names: Sequence[str], errors: Any, counts: Any,
                first_errors: Mapping[str, tuple[int, str]] | None) -> dict[str, float]:
        """A step's reward counters: ``errors`` [functions] failures (timeouts included), ``counts``
        [3 * functions] (not applicable, rows scored, then timeouts; a record saved before
        timeouts were counted has [2 * functions]; None: not recorded) over every
        process's rows, and this process's ``first_errors`` (name -> (row, message)).
        Reports each function's first failure, raises UserError for a function that failed
        (errors and timeouts) on every row scored, and returns the step's
        ``reward/<name>/not_applicable`` (a judge's: ``/parse_failures``), ``/errors`` and
        ``/timeouts`` metrics (those not 0)."""
        errors = np.asarray(errors).reshape(-1)
        first_errors = first_errors or {}
        for name, n in zip(names, errors):
            if n and name not in self.reported and name in first_errors:
                self.reported.add(name)
                row, message = first_errors[name]
                log.warning("reward function %r failed at step %d, row %d: %s (reported once per function; every "
                            "failure scores 0 and counts in reward_errors)", name, step, row, message)
                if self.write is not None:
                    self.write({"step": step, "reward": name, "row": row, "error": message})
        if counts is None:
            return {}
        counts = np.asarray(counts).reshape(-1, len(names))
        timeouts = counts[2] if len(counts) > 2 else np.zeros(len(names), counts.dtype)
        for name, n, late, scored in zip(names, errors, timeouts, counts[1]):
            if scored and n == scored:
                raise UserError(_all_failed(name, step, int(scored), int(late), first_errors.get(name), self.where))
        out = {}
        for label, values in (("not_applicable", counts[0]), ("errors", errors - timeouts), ("timeouts", timeouts)):
            out.update({f"reward/{name}/{_label(name, label, self.judges)}": float(n)
                        for name, n in zip(names, values) if n})
        return out


def _label(name: str, label: str, judges: frozenset[str]) -> str:
    """A judge's rows without a value are its parse failures (nothing else leaves it none)."""
    return "parse_failures" if label == "not_applicable" and name in judges else label


def _all_failed(name: str, step: int, scored: int, late: int, first: tuple[int, str] | None, where: str) -> str:
    what = f"; the first (row {first[0]}): {first[1]}" if first else ""
    timed = f", {late} of them past task.reward_timeout_s" if late else ""
    return (
        f"reward function {name!r} failed on every completion of step {step} ({scored} of {scored}{timed}){what}. "
        "A reward that is never computed scores 0 on every row, so the run would train without it; fix the "
        "function (it is called as fn(completions=[...], prompts=[...], **columns) and returns one number, or "
        f"None for not applicable, per completion) and run again. Its first failure is in {where}."
    )


__all__ = ["LOG_NAME", "RewardFailures"]
