"""The built-in objectives' per-token math (see :class:`grpo.ObjectivePlugin`).

Notation, per token t of row i: ``A = advantages[i]``, ``r = exp(logp - old)`` (1 with
gradient ``dlogp`` on-policy), ``sg`` = stop-gradient, ``el``/``eh`` = ``epsilon_low``/
``epsilon_high``. Each function returns the objective [B, T] that the loss maximises and
per-token metrics; padding positions are arbitrary (the loss ignores them), but their
inputs are already zeroed so nothing there is NaN, value or gradient.

- ``ppo_clip``: ``min(r A, clip(r, 1-el, 1+eh) A)``, written with an explicit clip
  indicator so the gradient is unambiguous: the clip is *active* (value
  ``clip(r) A``, no gradient) exactly when ``A > 0 and r > 1 + eh`` (``clip_frac/high``)
  or ``A < 0 and r < 1 - el`` (``clip_frac/low``); otherwise the value is ``r A`` with
  gradient ``r A dlogp``. A ratio exactly on a bound is not clipped; ``A == 0`` never is.
- ``gspo`` (Zheng et al. 2025, the token form verl and Tunix call ``gspo-token``): the
  sequence ratio ``s_i = exp(mean over the sequence's valid tokens of (logp - old))`` (the
  row's, or packed the segment's) and the
  per-token ratio ``sg(s_i) * exp(logp_t - sg(logp_t))``, whose value is ``s_i`` and whose
  gradient is ``s_i dlogp_t``. The clip is ``ppo_clip``'s, decided per sequence on
  ``s_i``: a clipped sequence contributes ``clip(s_i) A`` without gradient on every token.
  Under ``sequence_mean`` the row's weights ``1/n_i`` make the gradient ``A ds_i``, the
  sequence-level GSPO objective exactly. GSPO's ratios are means of per-token log-ratios,
  so its clip range is ~1e-3 wide (the paper: el = 3e-4, eh = 4e-4).
- ``cispo`` (MiniMax-M1): ``sg(clip(r, 1-el, 1+eh)) A logp``: REINFORCE with a clipped,
  gradient-free importance weight, so no token ever loses its gradient (``ppo_clip``
  zeroes the clipped ones); its value involves ``logp``, not a ratio.
- ``sapo`` (Gao et al. 2025, TRL's ``loss_type="sapo"``): the soft gate
  ``sigmoid(tau (r - 1)) * (4 / tau) * A`` with ``tau = tau_pos`` for ``A > 0`` and
  ``tau_neg`` otherwise. Its gradient is ``4 g (1 - g) r A dlogp`` (``g`` the sigmoid):
  ``r A dlogp`` on-policy like ``ppo_clip``, fading smoothly as ``r`` leaves 1 instead of
  dropping to 0 at a clip bound (``sapo/gate_mean`` is the mean of ``4 g (1 - g)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo.core.contracts import sequence_sum

sg = jax.lax.stop_gradient


def _clip_flags(ratio: jax.Array, adv: jax.Array, eps_low: float, eps_high: float):
    high = (adv > 0) & (ratio > 1.0 + eps_high)
    low = (adv < 0) & (ratio < 1.0 - eps_low)
    return low, high


def ppo_clip(*, log_ratio: jax.Array, advantages: jax.Array, eps_low: float, eps_high: float):
    """log_ratio [B, T], advantages [B, 1] -> (objective [B, T], metrics)."""
    ratio = jnp.exp(log_ratio)
    low, high = _clip_flags(ratio, advantages, eps_low, eps_high)
    bounded = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    objective = jnp.where(low | high, sg(bounded) * advantages, ratio * advantages)
    return objective, {"clip_frac/low": low, "clip_frac/high": high}


def gspo(*, logprobs: jax.Array, log_ratio: jax.Array, valid: jax.Array, advantages: jax.Array,
         eps_low: float, eps_high: float, segment_ids: jax.Array | None = None):
    """logprobs, log_ratio [B, T] (zero on padding), valid [B, T], advantages [B, 1] or
    [B, T]; ``segment_ids`` [B, T] (packed): the sequence ratio is per (row, segment id)."""
    count = sequence_sum(valid.astype(jnp.float32), segment_ids=segment_ids)  # B 1 (packed: B T)
    seq_log = sequence_sum(log_ratio, segment_ids=segment_ids) / jnp.maximum(count, 1.0)  # B 1 (B T)
    seq_ratio = jnp.exp(sg(seq_log))  # B 1 (B T)
    token_ratio = jnp.exp(sg(seq_log) + logprobs - sg(logprobs))  # B T: value s_i, gradient s_i dlogp
    low, high = _clip_flags(seq_ratio, advantages, eps_low, eps_high)  # B 1
    bounded = jnp.clip(seq_ratio, 1.0 - eps_low, 1.0 + eps_high)
    objective = jnp.where(low | high, bounded * advantages, token_ratio * advantages)
    shape = logprobs.shape
    low, high = jnp.broadcast_to(low, shape), jnp.broadcast_to(high, shape)
    per_token = jnp.broadcast_to(seq_ratio, shape)
    return objective, {
        "clip_frac/low": low,
        "clip_frac/high": high,
        "gspo/clip_frac": low | high,
        "gspo/seq_ratio/mean": per_token,
        "gspo/seq_ratio/min": per_token,
        "gspo/seq_ratio/max": per_token,
    }


def cispo(*, logprobs: jax.Array, log_ratio: jax.Array, advantages: jax.Array, eps_low: float, eps_high: float):
    """logprobs, log_ratio [B, T] (zero on padding), advantages [B, 1]."""
    ratio = jnp.exp(log_ratio)
    weight = sg(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    low, high = ratio < 1.0 - eps_low, ratio > 1.0 + eps_high
    return weight * advantages * logprobs, {
        "clip_frac/low": low,
        "clip_frac/high": high,
        "cispo/clipped_frac": low | high,
    }


def sapo(*, log_ratio: jax.Array, advantages: jax.Array, tau_pos: float, tau_neg: float):
    """log_ratio [B, T], advantages [B, 1]."""
    ratio = jnp.exp(log_ratio)
    tau = jnp.where(advantages > 0, tau_pos, tau_neg)  # B 1
    gate = jax.nn.sigmoid(tau * (ratio - 1.0))
    none = jnp.zeros(ratio.shape, bool)
    return gate * (4.0 / tau) * advantages, {
        "clip_frac/low": none,
        "clip_frac/high": none,
        "sapo/gate_mean": 4.0 * gate * (1.0 - gate),
    }
