"""Optimizer and learning-rate schedule from ``train.optimizer``."""

from __future__ import annotations

import optax

from grpo.core.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
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


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW or Lion with the schedule.

    Non-finite steps are skipped by the trainer (which also counts them), not here.
    """
    lr = learning_rate_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    else:
        opt = optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    parts = []
    if cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(opt)
    return optax.chain(*parts)
