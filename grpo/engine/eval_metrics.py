"""Evaluation metrics over groups of scored samples (task-independent, pure).

The trainer generates ``n`` completions per evaluation prompt (``n = 1`` greedy, or
``n = eval.k`` sampled), scores them, and calls :func:`evaluate_completions`:

- ``pass@k`` is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language
  Models Trained on Code"): for a prompt with ``n`` samples of which ``c`` are correct,
  ``1 - C(n-c, k) / C(n, k)`` — the chance that k samples drawn without replacement from
  the n include a correct one — averaged over prompts. ``pass@1`` from one greedy sample
  is plain accuracy; from n samples it equals ``mean@n``.
- ``mean@n`` is the mean over prompts of each prompt's fraction of correct samples
  (the expected accuracy of one sample).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from pydantic import BaseModel

from grpo.core.contracts import TaskPlugin
from grpo.engine.rollout.scoring import Scores, score_completions


def pass_at_k(*, n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``n`` samples, ``c`` correct: 1 - C(n-c,k)/C(n,k)."""
    if not (0 <= c <= n) or n < 1:
        raise ValueError(f"need 0 <= c <= n and n >= 1, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per prompt (n={n})")
    if n - c < k:
        return 1.0
    # Product form of C(n-c,k)/C(n,k): no huge binomials, no cancellation.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_correct(correct: Sequence[bool]) -> float:
    """Fraction of one prompt's samples that are correct."""
    if not correct:
        raise ValueError("a prompt with no samples")
    return sum(map(bool, correct)) / len(correct)


def group_metrics(groups: Sequence[Sequence[bool]], *, ks: Sequence[int] | None = None) -> dict[str, float]:
    """pass@k for each k in ``ks`` and mean@n over prompts, from per-prompt correctness.

    ``groups[p]`` holds the correctness of prompt p's samples; every prompt must have
    the same number ``n`` of samples. ``ks`` defaults to ``(1, n)``. Returns
    ``{"pass@1": .., "pass@<k>": .., "mean@<n>": .., "num_prompts": P, "num_samples": n}``.
    """
    if not groups:
        raise ValueError("no prompts to evaluate")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of samples, got sizes {sorted(sizes)}")
    n = sizes.pop()
    if n == 0:
        raise ValueError("prompts with no samples")
    ks = sorted(set(ks if ks is not None else (1, n)))
    counts = [sum(map(bool, g)) for g in groups]
    out: dict[str, float] = {}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n=n, c=c, k=k) for c in counts) / len(counts)
    out[f"mean@{n}"] = sum(c / n for c in counts) / len(counts)
    out["num_prompts"] = float(len(groups))
    out["num_samples"] = float(n)
    return out


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """``metrics`` (pass@k, mean@n, reward means/errors/accuracy) and the per-sample ``scores``
    (row ``p * n + j`` is sample j of prompt p)."""

    metrics: dict[str, float]
    scores: Scores
    groups: list[list[bool]]


def evaluate_completions(
    task: TaskPlugin,
    options: BaseModel,
    examples: Sequence[Mapping[str, Any]],
    completions: Sequence[Sequence[str]],
    *,
    ks: Sequence[int] | None = None,
) -> EvalResult:
    """Score ``completions[p]`` (the samples of ``examples[p]``) and compute pass@k/mean@n.

    ``examples`` is the split or any subset of it (e.g. its first ``eval.num_examples``).
    Correctness is ``task.is_correct``; a reward function that fails counts as 0, so such a
    sample is not correct. Greedy pass@1: one completion per prompt.
    """
    if len(examples) != len(completions):
        raise ValueError(f"{len(examples)} examples but {len(completions)} groups of completions")
    flat_examples = [ex for ex, group in zip(examples, completions) for _ in group]
    flat = [c for group in completions for c in group]
    scores = score_completions(task, options, flat_examples, flat)
    groups: list[list[bool]] = []
    i = 0
    for group in completions:
        groups.append(scores.correct[i : i + len(group)])
        i += len(group)
    metrics = group_metrics(groups, ks=ks)
    metrics.update(scores.metrics())
    return EvalResult(metrics=metrics, scores=scores, groups=groups)
