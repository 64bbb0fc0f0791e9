"""The GRPO objective given per-token log-probs: shared by every built-in loss.

The ``jax`` and ``pallas`` implementations differ only in how the per-token log-probs
(and entropies) of the sampled tokens, and their VJP, are computed from the hidden states
and the output head. Everything after that — ratio, clipping, KL, aggregation, metrics —
is this module, so the two cannot drift apart.

Definitions (per token t of row b, ``A = advantages[b]``, or ``advantages[b, t]`` with
turn-level credit, ``r = exp(logp - old)``, ``old``
the pre-update log-probs, ``stop_gradient(logp)`` on-policy):

- objective: the registered :class:`~grpo.core.contracts.ObjectivePlugin` named by
  ``settings.objective`` (``ppo_clip`` by default: ``min(r A, clip(r, 1-eps_low,
  1+eps_high) A)``; the built-ins are defined in :mod:`grpo.plugins.objectives._math`)
  gives the per-token objective from ``logp``, ``logp - old``, the mask and ``A``.
- mismatch correction (``settings.mismatch``, see
  :class:`~grpo.core.contracts.MismatchCorrection`): the objective is multiplied by a
  weight without gradient from ``exp(old - sampler)`` (``sampler``: the behaviour
  policy's log-probs, top-k/top-p truncated and renormalised; per token, or per sequence
  from its summed log-ratio), truncated at the cap or masked above it. It is computed in log
  space, so a long sequence's huge ratio is an exact comparison, never ``inf``.
- per-token loss: ``-objective * weight + beta * k3`` with ``k3 = exp(ref - logp) - (ref -
  logp) - 1`` (Schulman's k3 estimate of KL(pi || ref)); with ``beta == 0`` the term and
  the reference log-probs are never touched.
- aggregation: ``loss = sum_t w_t * loss_t / normalizer`` with ``w = mask`` for
  ``token_mean`` and ``constant``, and ``w = mask / (valid tokens of the sequence)`` (0
  for empty sequences) for ``sequence_mean``; a sequence is a row, or in the packed layout
  (``segment_ids``) a segment of a bin. The default normalizer is this batch's valid-token
  count (at least 1), sequence count, or ``sequences * max_completion_length``; passing the
  global batch's value makes micro-batch losses and gradients sum to the full-batch ones
  (every objective and correction is per token or per sequence, and sequences are never
  split), and a packed batch's equal to the padded one's.

Metrics are averaged over this call's valid tokens (0 when there are none), except names
ending in ``/min`` / ``/max``: the extreme over the valid tokens, ``+inf`` / ``-inf`` when
there are none (the identities, so micro-batches and shards combine by min / max):
the objective's (``clip_frac/low``, ``clip_frac/high``, ``gspo/*``, ``cispo/*``,
``sapo/*``), ``ratio/mean`` (the per-token ``r``), ``kl`` (mean k3 to the reference, 0
when beta is 0), ``approx_kl`` (mean ``(r - 1) - log r``: the k3 estimate of
KL(old || current), the usual PPO drift signal; 0 on-policy), ``entropy`` (when the
implementation computes it), with a mismatch correction ``mismatch/weight_mean`` and
``mismatch/truncated_frac`` or ``mismatch/masked_frac`` (tokens whose weight hit the cap,
or were dropped), ``num_tokens``, and ``logprobs`` [B, T] (no gradient). Under a
truncation (``settings.top_k``/``top_p``, ``loss.truncated_policy``) the implementation
adds ``truncated_policy/outside_frac`` (:func:`valid_mean` of the tokens outside its kept set).
"""

from __future__ import annotations

from typing import Any

import math

import jax
import jax.numpy as jnp

from grpo.core.contracts import LossSettings, ObjectivePlugin, sequence_sum

EXTREMES = {"/min": jnp.min, "/max": jnp.max}
"""Metric-name suffix -> how its per-token values reduce (the rest: the token mean)."""


def objective_plugin(settings: LossSettings) -> tuple[ObjectivePlugin, object]:
    """The registered objective ``settings.objective`` and its parsed options (config
    validation has checked both; a direct caller gets the registry's error)."""
    from grpo.core.plugins import get_plugins

    plugin = get_plugins().get("objective", settings.objective)
    return plugin, plugin.parse_options(dict(settings.objective_options))


def valid_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """The mean of ``x`` [B, T] over the valid tokens of ``mask`` (0 when there are none,
    no gradient): how a per-token metric reduces."""
    valid = mask.astype(bool)
    total = jnp.sum(jnp.where(valid, jax.lax.stop_gradient(x).astype(jnp.float32), 0.0))
    return total / jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)


def token_weights(mask: jax.Array, aggregation: str, segment_ids: jax.Array | None = None) -> jax.Array:
    """Per-token weights ``w`` [B, T] (f32) of ``sum_t w_t * loss_t / normalizer``; with
    ``segment_ids`` (packed) a ``sequence_mean`` weight is per segment, not per row."""
    m = mask.astype(jnp.float32)
    if aggregation in ("token_mean", "constant"):
        return m
    if aggregation == "sequence_mean":
        per_row = sequence_sum(m, segment_ids=segment_ids)  # B 1 (packed: B T)
        return jnp.where(per_row > 0, m / jnp.maximum(per_row, 1.0), 0.0)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def default_normalizer(mask: jax.Array, settings: LossSettings, segment_ids: jax.Array | None = None) -> jax.Array:
    """This batch's normalizer (see the module docstring and ``LossSettings.normalizer``)."""
    return settings.normalizer(mask) if segment_ids is None else settings.normalizer(mask, segment_ids)


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
    segment_ids: jax.Array | None = None,
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
    if advantages.shape not in ((b,), (b, t)):
        raise ValueError(f"advantages must be [B] = {(b,)} or [B, T] = {(b, t)}, got shape {advantages.shape}")
    if old_logprobs is not None and old_logprobs.shape != (b, t):
        raise ValueError(f"old_logprobs must be [B, T] = {(b, t)} or None, got shape {old_logprobs.shape}")
    if settings.beta > 0:
        if ref_logprobs is None:
            raise ValueError("settings.beta > 0 needs ref_logprobs [B, T]; got None")
        if ref_logprobs.shape != (b, t):
            raise ValueError(f"ref_logprobs must be [B, T] = {(b, t)}, got shape {ref_logprobs.shape}")
    if settings.mismatch is not None:
        if sampler_logprobs is None:
            raise ValueError("settings.mismatch needs sampler_logprobs [B, T]; got None")
        if sampler_logprobs.shape != (b, t):
            raise ValueError(f"sampler_logprobs must be [B, T] = {(b, t)}, got shape {sampler_logprobs.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")
    if segment_ids is not None:
        if segment_ids.shape != (b, t) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integer [bins, T] = {(b, t)}, got {segment_ids.dtype} "
                             f"{segment_ids.shape}")
        if advantages.shape != (b, t):
            raise ValueError(f"packed (segment_ids given): advantages must be per token [bins, T] = {(b, t)}, "
                             f"got shape {advantages.shape}")


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
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, Any]]:
    """The GRPO loss from per-token log-probs ``logprobs`` [B, T] (f32, differentiable).

    ``entropy`` [B, T] (optional) feeds the ``entropy`` metric and, with
    ``settings.entropy_coef > 0``, the entropy bonus (it must then carry its gradient).
    ``segment_ids`` [B, T] (packed layout, see :class:`~grpo.core.contracts.LossPlugin`):
    every per-sequence quantity reduces per (row, segment id); None: per row.
    Returns ``(loss, metrics)`` as documented in the module docstring.
    """
    logp = logprobs.astype(jnp.float32)
    valid = mask.astype(bool)
    m = valid.astype(jnp.float32)
    adv = advantages.astype(jnp.float32)
    adv = adv[:, None] if adv.ndim == 1 else adv  # B 1, or B T (turn-level credit)

    old = jax.lax.stop_gradient(logp) if old_logprobs is None else old_logprobs.astype(jnp.float32)
    # Padding positions may hold anything (even -inf log-probs): keep them out of exp().
    log_ratio = jnp.where(valid, logp - old, 0.0)
    ratio = jnp.exp(log_ratio)

    plugin, options = objective_plugin(settings)
    objective, token_metrics = plugin.call_per_token(
        logprobs=jnp.where(valid, logp, 0.0), log_ratio=log_ratio, valid=valid, advantages=adv,
        settings=settings, options=options, segment_ids=segment_ids,
    )
    if settings.mismatch is not None:
        weight, mismatch_metrics = mismatch_weight(
            old=old, sampler=sampler_logprobs.astype(jnp.float32), valid=valid,  # type: ignore[union-attr]
            correction=settings.mismatch, segment_ids=segment_ids,
        )
        objective = objective * weight
        token_metrics = {**token_metrics, **mismatch_metrics}
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

    weights = token_weights(mask, settings.aggregation, segment_ids)
    norm = (default_normalizer(mask, settings, segment_ids) if normalizer is None
            else jnp.asarray(normalizer, jnp.float32))
    loss = jnp.sum(jnp.where(valid, weights * per_token, 0.0)) / norm

    count = jnp.sum(m)
    denom = jnp.maximum(count, 1.0)

    def token_mean(x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(valid, jax.lax.stop_gradient(x).astype(jnp.float32), 0.0)) / denom

    def reduce(name: str, x: jax.Array) -> jax.Array:
        for suffix, fn in EXTREMES.items():
            if name.endswith(suffix):
                identity = jnp.inf if suffix == "/min" else -jnp.inf
                return fn(jnp.where(valid, jax.lax.stop_gradient(x).astype(jnp.float32), identity))
        return token_mean(x)

    metrics: dict[str, Any] = {
        **{k: reduce(k, v) for k, v in token_metrics.items()},
        "ratio/mean": token_mean(ratio),
        "kl": token_mean(k3) if k3 is not None else jnp.float32(0.0),
        "approx_kl": token_mean(ratio - 1.0 - log_ratio),
        "num_tokens": count,
        "logprobs": jax.lax.stop_gradient(logp),
    }
    if entropy is not None:
        metrics["entropy"] = token_mean(entropy)
    return loss, metrics


def mismatch_weight(*, old: jax.Array, sampler: jax.Array, valid: jax.Array, correction,
                    segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """The mismatch correction's weight [B, T] (no gradient) and its per-token metrics.

    ``old``, ``sampler`` [B, T] f32 log-probs, ``valid`` [B, T] bool, ``correction`` a
    :class:`~grpo.core.contracts.MismatchCorrection`. The log-weight is ``old - sampler``
    per token or its sum over the sequence (the row's, packed the segment's) per sequence;
    compared with ``log(cap)`` rather than exponentiated first, so a sequence-level ratio
    past f32's range truncates to ``cap`` (or is masked) exactly."""
    log_w = jnp.where(valid, old - sampler, 0.0)  # B T
    if correction.level == "sequence":
        log_w = jnp.broadcast_to(sequence_sum(log_w, segment_ids=segment_ids), log_w.shape)  # B T
    log_cap = math.log(correction.cap)
    over = log_w > log_cap
    if correction.mode == "truncate":
        weight = jnp.exp(jnp.minimum(log_w, log_cap))
        frac = {"mismatch/truncated_frac": over}
    else:
        weight = jnp.where(over, 0.0, 1.0)
        frac = {"mismatch/masked_frac": over}
    weight = jax.lax.stop_gradient(weight)
    return weight, {"mismatch/weight_mean": weight, **frac}
