"""Optimizer and learning-rate schedule from ``train.optimizer``.

The schedule is configured in training steps (``train.steps``, ``warmup_steps``), but optax
advances its schedule once per ``update`` call, and the trainer calls the optimizer
``train.ppo_epochs`` times per step. So the optimizer's schedule is the step schedule read
at ``count // ppo_epochs`` (:func:`optimizer_schedule`): every epoch of step ``s`` uses the
rate of step ``s``, and warm-up ends at the configured step whatever the epoch count.
Read at the raw count, the schedule would run ``ppo_epochs`` times too fast: measured on
the quickstart (CPU) with ``ppo_epochs=2``, a linear decay over 20 steps and lr 1e-2, the
rate reached 0 at step 10 and approx_kl was exactly 0 from step 11 on.

That holds only if the count advances once per optimizer call, skipped non-finite updates
included: :func:`~grpo.engine.training.update.keep_if_finite` keeps the parameters and
the moments of a skipped update but takes its schedule count. The learning rate the
trainer logs is read back from that count (:func:`applied_learning_rate`), not recomputed
from the trainer's step, so the log shows the rate the optimizer actually used.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from grpo.core.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The learning rate of training step ``s`` (0-based) of ``total_steps``."""
    peak, warm = cfg.learning_rate, cfg.warmup_steps
    decay_steps = max(1, total_steps - warm)
    end = peak * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    else:
        after = optax.linear_schedule(peak, end, decay_steps)
    if warm == 0:
        return after
    # Warm-up from peak/warm (not 0) so the first step already moves.
    warmup = optax.linear_schedule(peak / (warm + 1), peak, warm)
    return optax.join_schedules([warmup, after], [warm])


def optimizer_schedule(cfg: OptimizerConfig, total_steps: int, ppo_epochs: int = 1) -> optax.Schedule:
    """The schedule as the optimizer sees it: a function of its update count. The count
    of epoch ``e`` of step ``s`` is ``s * ppo_epochs + e``, so the rate is the step
    schedule's at ``count // ppo_epochs``."""
    per_step = learning_rate_schedule(cfg, total_steps)
    if ppo_epochs == 1:
        return per_step
    return lambda count: per_step(count // ppo_epochs)


def make_optimizer(cfg: OptimizerConfig, total_steps: int, ppo_epochs: int = 1) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW or Lion with :func:`optimizer_schedule`.

    Non-finite steps are skipped by the update (and counted by the trainer), not here.
    """
    lr = optimizer_schedule(cfg, total_steps, ppo_epochs)
    if cfg.name == "adamw":
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    else:
        opt = optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    parts = []
    if cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(opt)
    return optax.chain(*parts)


def is_schedule_state(x: Any) -> bool:
    return isinstance(x, optax.ScaleByScheduleState)


def schedule_count(opt_state: Any) -> jax.Array:
    """The update count the schedule reads, wherever the chain keeps it (also inside the
    :class:`~grpo.engine.training.update.MasterWeights` of a mixed-precision run)."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_schedule_state) if is_schedule_state(x)]
    if len(found) != 1:
        raise ValueError(f"expected one optax ScaleByScheduleState in the optimizer state, found {len(found)}")
    return found[0].count


def applied_learning_rate(schedule: optax.Schedule, opt_state: Any) -> float:
    """The rate the optimizer applied in its latest update (the schedule at the count
    before it; the peak's first value before any update)."""
    count = int(jax.device_get(schedule_count(opt_state)))
    return float(schedule(max(count - 1, 0)))
