"""Periodic evaluation: pass@1 (greedy or sampled), pass@k and mean@k on the eval split.

Prompts are processed in fixed-size batches (padded with repeats of the last prompt,
whose results are dropped) so one compiled sampler serves every batch. Each process
generates and scores its own slice; per-prompt correct counts are then gathered so every
process reports the same numbers.

The :class:`Evaluator` is built from the run's pieces (config, program builder, task,
tokenizer), never from the trainer: the sampler comes from
:meth:`~grpo.engine.programs.RunPrograms.sampler` like the training rollout's, and rows
move between processes through :mod:`grpo.engine.parallel.rows`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import jax
import numpy as np

from grpo.core.config import RunConfig
from grpo.engine.parallel.rows import local_rows, to_global
from grpo.engine.programs import RunPrograms
from grpo.engine.rollout.prompts import (
    PromptSet,
    bucket_for,
    build_batch,
    process_slice,
    tokenize_prompts,
)


def eval_batch_size(requested: int, *, k: int, shards: int, processes: int) -> int:
    """The smallest size >= requested with prompts splitting over processes and
    prompts*k over the rollout shards."""
    unit = math.lcm(processes, shards // math.gcd(shards, k))
    return max(unit, math.ceil(requested / unit) * unit)


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

    def _prepare(self) -> tuple[PromptSet, Any]:
        if self._prompts is None:
            cfg, ev = self.config, self.config.eval
            examples = self.task.load(split=cfg.task.eval_split, options=self.task_options, seed=cfg.train.seed)
            if ev.num_examples is not None:
                examples = examples[: ev.num_examples]
            self._prompts = tokenize_prompts(
                examples, self.render, self.policy.tokenizer,
                max_prompt_length=cfg.rollout.max_prompt_length, split=cfg.task.eval_split,
            )
            self._sampler = self.programs.sampler(greedy=ev.greedy, num_generations=ev.k)
        return self._prompts, self._sampler

    def __call__(self, step: int, sampler_state: Any) -> dict[str, Any]:
        """One evaluation of the policy whose sampler state is ``sampler_state`` (what
        :meth:`~grpo.engine.programs.RunPrograms.sampler_state` gives), logged at ``step``."""
        from grpo.plugins.tasks import group_metrics, score_completions

        cfg = self.config
        ev = cfg.eval
        t0 = time.perf_counter()
        prompts, sampler = self._prepare()
        programs = self.programs
        shards = programs.layout.axis_size(programs.batch_axes)
        size = eval_batch_size(min(ev.batch_size, len(prompts)), k=ev.k, shards=shards, processes=jax.process_count())
        width = bucket_for(max(len(t) for t in prompts.token_ids), self.buckets)
        local = process_slice(size, jax.process_index(), jax.process_count())
        sharding = programs.rollout_sharding
        counts: list[int] = []
        reward_sum, n_scored = 0.0, 0
        for start in range(0, len(prompts), size):
            idx = np.arange(start, start + size)
            real = idx < len(prompts)
            idx = np.minimum(idx, len(prompts) - 1)
            batch = build_batch(prompts, idx, local=local, buckets=self.buckets, pad_id=self.policy.pad_id,
                                width=width)
            g_tok = to_global(batch.tokens, sharding)
            g_mask = to_global(batch.mask, sharding)
            rng = jax.random.fold_in(jax.random.key(cfg.train.seed + 1), start)
            out = sampler.generate(sampler_state, g_tok, g_mask, rng)
            texts = self.policy.decode(local_rows(out.tokens), local_rows(out.mask))
            examples = [ex for ex in batch.examples for _ in range(ev.k)]
            scores = score_completions(self.task, self.task_options, examples, texts)
            keep = real[local]
            for p in range(len(batch.examples)):
                # Padding rows count as -1 so every process gathers arrays of one length.
                counts.append(int(sum(scores.correct[p * ev.k : (p + 1) * ev.k])) if keep[p] else -1)
                if keep[p]:
                    reward_sum += float(sum(scores.totals[p * ev.k : (p + 1) * ev.k]))
                    n_scored += ev.k
        local_stats = np.array([reward_sum, n_scored], np.float64)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            gathered = np.asarray(multihost_utils.process_allgather(np.asarray(counts, np.int32)))
            counts = gathered.reshape(-1).tolist()
            local_stats = np.asarray(multihost_utils.process_allgather(local_stats)).sum(0)
        groups = [[True] * c + [False] * (ev.k - c) for c in counts if c >= 0]
        metrics = group_metrics(groups, ks=sorted({1, ev.k}))
        out_row: dict[str, Any] = {"step": step}
        out_row.update({f"eval/{k}": v for k, v in metrics.items()})
        out_row["eval/reward_mean"] = local_stats[0] / max(local_stats[1], 1)
        out_row["eval/greedy"] = ev.greedy
        out_row["time/eval_s"] = time.perf_counter() - t0
        return out_row


__all__ = ["Evaluator", "eval_batch_size"]
