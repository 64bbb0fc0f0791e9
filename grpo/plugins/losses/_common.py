"""The GRPO objective given per-token log-probs: shared by every built-in loss.

The ``jax`` and ``pallas`` implementations differ only in how the per-token log-probs
(and entropies) of the sampled tokens, and their VJP, are computed from the hidden states
and the output head. Everything after that — ratio, clipping, KL, aggregation, metrics —
is this module, so the two cannot drift apart.

Definitions (per token t of row b, ``A = advantages[b]``, ``r = exp(logp - old)``):

- objective: ``min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`` (the pessimistic
  PPO/GRPO form). It is written with an explicit clip indicator so the gradient is
  unambiguous: the clip is *active* (value ``clip(r) * A``, no gradient) exactly when
  ``A > 0 and r > 1 + eps_high`` (``clip_frac/high``) or ``A < 0 and r < 1 - eps_low``
  (``clip_frac/low``); otherwise the value is ``r * A`` with gradient ``r * A * dlogp``.
  A ratio exactly on a bound is not clipped. When ``A == 0`` nothing is clipped.
- truncated importance sampling (``tis_cap > 0``): the objective of each token is
  multiplied by ``w = min(exp(old - sampler), tis_cap)`` (no gradient through ``w``),
  where ``sampler`` is the sampler's log-prob of the token: it corrects for the sampler
  and the trainer disagreeing (bf16 decode vs the update's numerics) without letting a
  rare huge ratio dominate the step.
- per-token loss: ``-objective + beta * k3`` with ``k3 = exp(ref - logp) - (ref - logp) - 1``
  (Schulman's k3 estimate of KL(pi || ref)); with ``beta == 0`` the term and the reference
  log-probs are never touched.
- aggregation: ``loss = sum_t w_t * loss_t / normalizer`` with ``w = mask`` for
  ``token_mean`` and ``constant``, and ``w = mask / (valid tokens of the row)`` (0 for
  empty rows) for ``sequence_mean``. The default normalizer is this batch's valid-token
  count (at least 1), row count, or ``rows * max_completion_length``; passing the global
  batch's value makes micro-batch losses and gradients sum to the full-batch ones.

Metrics are averaged over this call's valid tokens (0 when there are none):
``clip_frac/low``, ``clip_frac/high``, ``ratio/mean``, ``kl`` (mean k3 to the reference,
0 when beta is 0), ``approx_kl`` (mean ``(r - 1) - log r``: the k3 estimate of
KL(old || current), the usual PPO drift signal; 0 on-policy), ``entropy`` (when the
implementation computes it), with ``tis_cap > 0`` ``tis/weight_mean`` (mean ``w``) and
``tis/capped_frac`` (tokens whose ratio hit the cap), ``num_tokens``, and ``logprobs``
[B, T] (no gradient).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from grpo.core.contracts import LossSettings


def token_weights(mask: jax.Array, aggregation: str) -> jax.Array:
    """Per-token weights ``w`` [B, T] (f32) of ``sum_t w_t * loss_t / normalizer``."""
    m = mask.astype(jnp.float32)
    if aggregation in ("token_mean", "constant"):
        return m
    if aggregation == "sequence_mean":
        per_row = jnp.sum(m, axis=1, keepdims=True)  # B 1
        return jnp.where(per_row > 0, m / jnp.maximum(per_row, 1.0), 0.0)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def default_normalizer(mask: jax.Array, settings: LossSettings) -> jax.Array:
    """This batch's normalizer (see the module docstring and ``LossSettings.normalizer``)."""
    return settings.normalizer(mask)


def check_inputs(
    *,
    hidden: jax.Array,
    head_weight: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    advantages: jax.Array,
    old_logprobs: jax.Array | None,
    ref_logprobs: jax.Array | None,
    settings: LossSettings,
    sampler_logprobs: jax.Array | None = None,
) -> None:
    """Shape checks at trace time, with messages that name the argument."""
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, T, D], got shape {hidden.shape}")
    b, t, d = hidden.shape
    if head_weight.ndim != 2 or head_weight.shape[0] != d:
        raise ValueError(f"head_weight must be [D={d}, V], got shape {head_weight.shape}")
    for name, arr in (("targets", targets), ("mask", mask)):
        if arr.shape != (b, t):
            raise ValueError(f"{name} must be [B, T] = {(b, t)}, got shape {arr.shape}")
    if advantages.shape != (b,):
        raise ValueError(f"advantages must be [B] = {(b,)}, got shape {advantages.shape}")
    if old_logprobs is not None and old_logprobs.shape != (b, t):
        raise ValueError(f"old_logprobs must be [B, T] = {(b, t)} or None, got shape {old_logprobs.shape}")
    if settings.beta > 0:
        if ref_logprobs is None:
            raise ValueError("settings.beta > 0 needs ref_logprobs [B, T]; got None")
        if ref_logprobs.shape != (b, t):
            raise ValueError(f"ref_logprobs must be [B, T] = {(b, t)}, got shape {ref_logprobs.shape}")
    if settings.tis_cap > 0:
        if sampler_logprobs is None:
            raise ValueError("settings.tis_cap > 0 needs sampler_logprobs [B, T]; got None")
        if sampler_logprobs.shape != (b, t):
            raise ValueError(f"sampler_logprobs must be [B, T] = {(b, t)}, got shape {sampler_logprobs.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")


def grpo_objective(
    *,
    logprobs: jax.Array,
    mask: jax.Array,
    advantages: jax.Array,
    old_logprobs: jax.Array | None,
    ref_logprobs: jax.Array | None,
    settings: LossSettings,
    normalizer: jax.Array | float | None = None,
    entropy: jax.Array | None = None,
    sampler_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, Any]]:
    """The GRPO loss from per-token log-probs ``logprobs`` [B, T] (f32, differentiable).

    ``entropy`` [B, T] (optional) feeds the ``entropy`` metric and, with
    ``settings.entropy_coef > 0``, the entropy bonus (it must then carry its gradient).
    Returns ``(loss, metrics)`` as documented in the module docstring.
    """
    logp = logprobs.astype(jnp.float32)
    valid = mask.astype(bool)
    m = valid.astype(jnp.float32)
    adv = advantages.astype(jnp.float32)[:, None]  # B 1

    old = jax.lax.stop_gradient(logp) if old_logprobs is None else old_logprobs.astype(jnp.float32)
    # Padding positions may hold anything (even -inf log-probs): keep them out of exp().
    log_ratio = jnp.where(valid, logp - old, 0.0)
    ratio = jnp.exp(log_ratio)

    clipped_high = (adv > 0) & (ratio > 1.0 + settings.epsilon_high)
    clipped_low = (adv < 0) & (ratio < 1.0 - settings.epsilon_low)
    clipped = clipped_high | clipped_low
    bounded = jnp.clip(ratio, 1.0 - settings.epsilon_low, 1.0 + settings.epsilon_high)
    objective = jnp.where(clipped, jax.lax.stop_gradient(bounded) * adv, ratio * adv)
    tis_metrics: dict[str, Any] = {}
    if settings.tis_cap > 0:
        behaviour = jnp.where(valid, old - sampler_logprobs.astype(jnp.float32), 0.0)  # type: ignore[union-attr]
        is_ratio = jnp.exp(behaviour)
        weight = jax.lax.stop_gradient(jnp.minimum(is_ratio, settings.tis_cap))
        objective = objective * weight
        tis_metrics = {"tis/weight_mean": weight, "tis/capped_frac": is_ratio > settings.tis_cap}
    per_token = -objective

    if settings.beta > 0:
        delta = jnp.where(valid, ref_logprobs.astype(jnp.float32) - logp, 0.0)  # type: ignore[union-attr]
        k3 = jnp.exp(delta) - delta - 1.0
        per_token = per_token + settings.beta * k3
    else:
        k3 = None

    if settings.entropy_coef > 0:
        if entropy is None:
            raise ValueError("settings.entropy_coef > 0 needs the per-token entropy")
        per_token = per_token - settings.entropy_coef * entropy.astype(jnp.float32)

    weights = token_weights(mask, settings.aggregation)
    norm = default_normalizer(mask, settings) if normalizer is None else jnp.asarray(normalizer, jnp.float32)
    loss = jnp.sum(jnp.where(valid, weights * per_token, 0.0)) / norm

    count = jnp.sum(m)
    denom = jnp.maximum(count, 1.0)

    def token_mean(x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(valid, jax.lax.stop_gradient(x).astype(jnp.float32), 0.0)) / denom

    metrics: dict[str, Any] = {
        "clip_frac/low": token_mean(clipped_low),
        "clip_frac/high": token_mean(clipped_high),
        "ratio/mean": token_mean(ratio),
        "kl": token_mean(k3) if k3 is not None else jnp.float32(0.0),
        "approx_kl": token_mean(ratio - 1.0 - log_ratio),
        "num_tokens": count,
        "logprobs": jax.lax.stop_gradient(logp),
    }
    if entropy is not None:
        metrics["entropy"] = token_mean(entropy)
    metrics.update({k: token_mean(v) for k, v in tis_metrics.items()})
    return loss, metrics
