"""Periodic evaluation: pass@1 (greedy or sampled), pass@k and mean@k on the eval split.

Prompts are processed in fixed-size batches (padded with repeats of the last prompt,
whose results are dropped) so one compiled sampler serves every batch. Each process
generates and scores its own slice; per-prompt correct counts are then gathered so every
process reports the same numbers.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from grpo.engine.data import bucket_for, build_batch, process_slice, tokenize_prompts

if TYPE_CHECKING:  # pragma: no cover
    from grpo.engine.trainer import Trainer


def eval_batch_size(requested: int, *, k: int, shards: int, processes: int) -> int:
    """The smallest size >= requested with prompts splitting over processes and
    prompts*k over the rollout shards."""
    unit = math.lcm(processes, shards // math.gcd(shards, k))
    return max(unit, math.ceil(requested / unit) * unit)


def evaluate(trainer: "Trainer") -> dict[str, Any]:
    from grpo.engine.trainer import _local_rows, _to_global
    from grpo.plugins.tasks import group_metrics, score_completions

    cfg = trainer.config
    ev = cfg.eval
    t0 = time.perf_counter()
    if trainer.eval_state is None:
        examples = trainer.task.load(split=cfg.task.eval_split, options=trainer.task_options, seed=cfg.train.seed)
        if ev.num_examples is not None:
            examples = examples[: ev.num_examples]
        prompts = tokenize_prompts(
            examples, trainer.render, trainer.policy.tokenizer,
            max_prompt_length=cfg.rollout.max_prompt_length, split=cfg.task.eval_split,
        )
        # Built once per run: the eval prompts and a sampler compiled for eval's settings.
        trainer.eval_state = (prompts, trainer._make_sampler(greedy=ev.greedy, num_generations=ev.k))
    prompts, sampler = trainer.eval_state
    shards = trainer.layout.axis_size(trainer.batch_axes)
    size = eval_batch_size(min(ev.batch_size, len(prompts)), k=ev.k, shards=shards, processes=jax.process_count())
    width = bucket_for(max(len(t) for t in prompts.token_ids), trainer.buckets)
    local = process_slice(size, jax.process_index(), jax.process_count())
    counts: list[int] = []
    reward_sum, n_scored = 0.0, 0
    for start in range(0, len(prompts), size):
        idx = np.arange(start, start + size)
        real = idx < len(prompts)
        idx = np.minimum(idx, len(prompts) - 1)
        batch = build_batch(prompts, idx, local=local, buckets=trainer.buckets, pad_id=trainer.policy.pad_id,
                            width=width)
        g_tok = _to_global(batch.tokens, trainer.batch_sharding)
        g_mask = _to_global(batch.mask, trainer.batch_sharding)
        rng = jax.random.fold_in(jax.random.key(cfg.train.seed + 1), start)
        out = sampler.generate(trainer.policy_params(), g_tok, g_mask, rng)
        texts = trainer.policy.decode(_local_rows(out.tokens), _local_rows(out.mask))
        examples = [ex for ex in batch.examples for _ in range(ev.k)]
        scores = score_completions(trainer.task, trainer.task_options, examples, texts)
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
    out_row: dict[str, Any] = {"step": trainer.step}
    out_row.update({f"eval/{k}": v for k, v in metrics.items()})
    out_row["eval/reward_mean"] = local_stats[0] / max(local_stats[1], 1)
    out_row["eval/greedy"] = ev.greedy
    out_row["time/eval_s"] = time.perf_counter() - t0
    return out_row
