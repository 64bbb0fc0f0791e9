"""Group-relative advantages.

Rewards arrive as one flat vector laid out group-major: the K completions of prompt i
are rows ``i*K .. i*K+K-1``. Advantages are computed per group and broadcast to every
token of a completion by the loss.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp


def group_advantages(
    rewards: jnp.ndarray,
    *,
    num_generations: int,
    baseline: Literal["group_mean", "rloo"] = "group_mean",
    scale: Literal["group_std", "batch_std", "none"] = "group_std",
    epsilon: float = 1e-4,
) -> jnp.ndarray:
    """Advantages [B] from rewards [B] (B = prompts x num_generations, group-major).

    - ``group_mean``: r - mean(group) (GRPO).
    - ``rloo``: r - mean(other members of the group) = K/(K-1) * (r - mean(group)).
    - ``group_std`` divides by (std(group) + epsilon), the population std as in GRPO;
      ``batch_std`` by (std of all the batch's rewards + epsilon) (TRL's
      ``scale_rewards="batch"``; Liu et al., "Part I: Tricks or Traps?"): every group on
      one scale, so a group with a small spread is not blown up to unit size, while the
      overall scale stays normalised; ``none`` leaves the scale alone (Dr.GRPO, which
      removes the std's difficulty bias). The baseline is the group's either way.

    A group whose rewards are all equal gets exactly zero advantages, whatever the
    options: ``r - mean`` alone leaves a rounding residue when the reward is not exactly
    representable (1.2 -> ~1e-7), and ``group_std`` would divide it by ``0 + epsilon``
    into ~1e-3 per member, pushing every fully solved group up.
    """
    k = num_generations
    if rewards.ndim != 1 or rewards.shape[0] % k:
        raise ValueError(f"rewards must be [prompts * {k}], got shape {rewards.shape}")
    r = rewards.astype(jnp.float32).reshape(-1, k)  # P K
    mean = r.mean(axis=1, keepdims=True)
    # Equal rewards carry no preference: zero by definition, not by rounding.
    adv = jnp.where(r.max(axis=1, keepdims=True) == r.min(axis=1, keepdims=True), 0.0, r - mean)
    if baseline == "rloo":
        adv = adv * (k / (k - 1))
    if scale == "group_std":
        adv = adv / (r.std(axis=1, keepdims=True) + epsilon)
    elif scale == "batch_std":
        adv = adv / (r.std() + epsilon)
    return adv.reshape(-1)
