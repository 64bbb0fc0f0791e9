"""Periodic evaluation: pass@1 (greedy or sampled), pass@k and mean@k on the eval split.

Prompts are processed in batches of ``eval.batch_size`` (the last one shorter), each
placed in one compiled batch of :meth:`~grpo.engine.programs.RunPrograms.eval_batch`
rows: padding rows (repeats of the batch's first prompt) fill it up to a whole number of
prompts per process whose samples split evenly over the rollout shards, so any
``num_examples``, ``batch_size`` and ``k`` run on any mesh and process count. Padding
rows are never scored. A real prompt's samples depend only on the seed, the batch it is
in and its place there, never on the padding: every mesh and process count gives the
same per-example results, and greedy results do not depend on the batch size either.

Every process places the whole (small) prompt batch; prefill splits it over the part of
the rollout shards the prompts divide (replicated at worst), decode splits their ``k``
samples over all of them. Each process decodes and scores the samples of its own slice of prompts
(the rows it holds); per-prompt results are then gathered so every process reports the
same numbers. "Every process" is every process of the mesh it samples on: in an
asynchronous run split by processes, the rollout side's, which evaluates on its own mesh
at the weights it was sent (:mod:`grpo.engine.loop.processes`).

The :class:`Evaluator` is built from the run's pieces (config, program builder, task,
tokenizer), never from the trainer: the sampler comes from
:meth:`~grpo.engine.programs.RunPrograms.eval_sampler` like the training rollout's, and
takes the trained weights the same way, through its ``update_weights`` (the engine's
weight preparation: reshard, LoRA merge; its prepared copy is released when the
evaluation is done); rows move between processes through
:mod:`grpo.engine.parallel.rows`.

Samples are scored with the task's own rewards only: ``task.overlong`` shapes the
training signal, so it never enters ``eval/reward/*``, and correctness (pass@k) is the
task's judgement whatever the completion's length; a truncated wrong answer already
scores as wrong.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from grpo.core.config import RunConfig
from grpo.engine.parallel.mesh import mesh_processes
from grpo.engine.parallel.rows import gather_processes
from grpo.engine.programs import RunPrograms
from grpo.engine.rollout.prompts import (
    PromptSet,
    bucket_for,
    build_batch,
    process_slice,
    tokenize_prompts,
)


@dataclasses.dataclass(frozen=True)
class EvalScores:
    """Per-example results of one evaluation, in eval-split order (every process has
    them all)."""

    correct: np.ndarray  # [n] int64: correct samples of each prompt, of eval.k
    reward: np.ndarray  # [n] float64: total reward of each prompt's eval.k samples


class Evaluator:
    """Evaluation of one run: the eval prompts are tokenized and the eval sampler is
    compiled on first use, then reused by every later call.

    ``policy`` is the run's :class:`~grpo.models.policy.Policy` (tokenizer, ``decode``,
    ``pad_id``); ``render`` turns an example into prompt text; ``buckets`` are the
    prompt-length buckets of the run."""

    def __init__(
        self,
        config: RunConfig,
        programs: RunPrograms,
        *,
        task: Any,
        task_options: Any,
        policy: Any,
        render: Callable[[dict], str],
        buckets: tuple[int, ...],
    ):
        self.config = config
        self.programs = programs
        self.task = task
        self.task_options = task_options
        self.policy = policy
        self.render = render
        self.buckets = buckets
        self._prompts: PromptSet | None = None
        self._sampler: Any = None
        self._scorer: Any = None  # the run's reward settings (timeouts, threads, processes), built at first use

    def prepare(self) -> tuple[PromptSet, Any]:
        """Load and tokenize the eval prompts and build the eval sampler (nothing is
        compiled): done before the first training step, so a split with no usable prompt
        stops the run before it trains."""
        if self._prompts is None:
            cfg, ev = self.config, self.config.eval
            examples = self.task.load(split=cfg.task.eval_split, options=self.task_options, seed=cfg.train.seed)
            if ev.num_examples is not None:
                examples = examples[: ev.num_examples]
            self._prompts = tokenize_prompts(
                examples, self.render, self.policy.tokenizer,
                max_prompt_length=cfg.rollout.max_prompt_length, split=cfg.task.eval_split,
            )
            self._sampler = self.programs.eval_sampler()
        return self._prompts, self._sampler

    def scores(self, params: Any, version: int = 0) -> EvalScores:
        """Per-example results of the policy of trained weights ``params`` (policy
        ``version``), which enter the eval sampler through its ``update_weights``."""
        prompts, sampler = self.prepare()
        sampler.update_weights(params, version)
        try:
            return self._scores(prompts, sampler)
        finally:
            sampler.release()

    def _scores(self, prompts: PromptSet, sampler: Any) -> EvalScores:
        from grpo.engine.rollout.scoring import RewardScorer

        cfg = self.config
        k = cfg.eval.k
        if self._scorer is None:
            self._scorer = RewardScorer.for_run(cfg, self.task, self.task_options, group_size=k)
        n = len(prompts)
        real, size = self.programs.eval_batch(n)
        width = bucket_for(max(len(t) for t in prompts.token_ids), self.buckets)
        # The processes of the mesh it samples on: every process, or (split by processes) the rollout side's.
        local = process_slice(size, *mesh_processes(self.programs.mesh))
        starts = range(0, n, real)
        mine = np.zeros((len(starts), local.stop - local.start, 2), np.float64)  # correct, reward
        for b, start in enumerate(starts):
            count = min(real, n - start)
            idx = start + np.arange(size)
            idx[count:] = start  # padding: the batch's first prompt again (any real prompt would do)
            batch = build_batch(prompts, idx, local=slice(None), buckets=self.buckets, pad_id=self.policy.pad_id,
                                width=width)
            rng = jax.random.fold_in(jax.random.key(cfg.train.seed + 1), start)
            # This process's prompts' samples, rows p*k .. p*k+k-1 of prompt p; padding
            # prompts' samples are sampled with the rest but never detokenized or scored.
            keep = (np.arange(local.start, local.stop) < count).sum()
            examples = [ex for ex in batch.examples[local] for _ in range(k)]
            # The environments of a multi-turn task's rows are made for padding prompts too:
            # every process takes part in every turn's programs.
            sampled = sampler.sample(sampler.weights, batch.tokens, batch.mask, rng, examples)
            if keep == 0:
                continue
            texts, examples = sampled.texts[: keep * k], sampled.examples[: keep * k]
            scored = self._scorer.score(examples, texts)
            mine[b, :keep, 0] = np.asarray(scored.correct, np.float64).reshape(keep, k).sum(1)
            mine[b, :keep, 1] = np.asarray(scored.totals, np.float64).reshape(keep, k).sum(1)
        every = gather_processes(mine, self.programs.mesh)  # processes, batches, per, 2
        every = every.transpose(1, 0, 2, 3).reshape(len(starts), size, 2)  # batch, slot, 2
        real_slots = np.arange(size)[None, :] < np.minimum(real, n - np.asarray(starts))[:, None]
        flat = every[real_slots]  # n 2, eval-split order
        return EvalScores(correct=flat[:, 0].astype(np.int64), reward=flat[:, 1])

    def __call__(self, step: int, params: Any) -> dict[str, Any]:
        """One evaluation of the policy of trained weights ``params`` (the trainer's, at
        policy version ``step``), logged at ``step``."""
        from grpo.engine.eval_metrics import group_metrics

        k = self.config.eval.k
        t0 = time.perf_counter()
        scores = self.scores(params, step)
        groups = [[True] * int(c) + [False] * (k - int(c)) for c in scores.correct]
        metrics = group_metrics(groups, ks=sorted({1, k}))
        out_row: dict[str, Any] = {"step": step}
        out_row.update({f"eval/{name}": v for name, v in metrics.items()})
        out_row["eval/reward_mean"] = float(scores.reward.sum() / (len(scores.reward) * k))
        out_row["eval/greedy"] = self.config.eval.greedy
        out_row["time/eval_s"] = time.perf_counter() - t0
        return out_row


__all__ = ["EvalScores", "Evaluator"]
