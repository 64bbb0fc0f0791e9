"""Group-relative advantages.

Rewards arrive as one flat vector laid out group-major: the K completions of prompt i
are rows ``i*K .. i*K+K-1``. Advantages are computed per group and broadcast to every
token of a completion by the loss (:func:`group_advantages`, one per row), or with
turn-level credit (``train.advantage.credit: turn``) given per token
(:func:`turn_advantages`).

A group is *informative* when the advantages the update trains on are not all zero on
the tokens it trains (:func:`informative_groups`): under the configured credit, baseline
and scale, over the samples it keeps (down-sampling). Dynamic sampling's filter, the fill
of a short step and the metrics all use this one definition. Under sequence credit it is
a spread of the group's total rewards. Under turn credit a group with equal totals may
still be informative (one reward credits the call, another the answer), and one whose
scopes' advantages cancel on every token it trains (a single-turn row where ``first``
and ``all`` meet) is not. ``loss.mask_truncated``'s dropped rows are not considered.

Host side, on a step's rewards: the rewards by name summed by weight into one component
per scope (:func:`turn_components`, what :func:`turn_advantages` takes), and which groups
of a round are informative by the update's own functions and options
(:func:`informative_groups_of`: dynamic sampling's filter).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Mapping

import jax.numpy as jnp
import numpy as np

SCOPES = ("all", "first", "last")
"""Which model turns a reward credits under turn-level credit: every turn, the first, the last."""


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


def turn_ids(loss_mask: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(turn [B, N] int32, turns [B] int32): the index of the model turn each of the
    model's tokens (``loss_mask`` 1) belongs to, -1 elsewhere, and each row's number of
    model turns. A turn is a maximal run of the model's own tokens: the environment's
    inserted tokens (``loss_mask`` 0, inside the completion) separate them."""
    own = loss_mask.astype(bool)
    before = jnp.pad(own[:, :-1], ((0, 0), (1, 0)))
    starts = own & ~before
    count = jnp.cumsum(starts.astype(jnp.int32), axis=1)
    return jnp.where(own, count - 1, -1), count[:, -1]


def turn_advantages(
    components: Mapping[str, jnp.ndarray],
    loss_mask: jnp.ndarray,
    *,
    num_generations: int,
    baseline: Literal["group_mean", "rloo"] = "group_mean",
    scale: Literal["group_std", "batch_std", "none"] = "group_std",
    epsilon: float = 1e-4,
) -> jnp.ndarray:
    """Per-token advantages [B, N] with turn-level credit (MT-GRPO: Zeng et al., 2025,
    "Reinforcing Multi-Turn Reasoning in LLM Agents via Turn-Level Credit Assignment").

    ``components`` maps a scope of :data:`SCOPES` to the weighted sum [B] of the rewards
    that credit it (the task's :meth:`~grpo.TaskPlugin.reward_turns`). Each component
    gets its own group advantage (:func:`group_advantages`, same options), and a token of
    the model takes the sum of those of the scopes its turn belongs to: ``all`` every
    model turn, ``first`` the first, ``last`` the last (a row with one turn: both). So a
    reward that scores the tool call moves only the call's tokens, and one that scores the
    final answer only the answer's, while an outcome reward (``all``) moves every turn
    that led to it. Tokens outside the model's turns (``loss_mask`` 0) get 0.

    With only ``all``, every model token of a row gets exactly
    :func:`group_advantages` of the total: sequence-level GRPO."""
    unknown = sorted(set(components) - set(SCOPES))
    if unknown:
        raise ValueError(f"unknown reward scopes {unknown}; choose from {list(SCOPES)}")
    turn, turns = turn_ids(loss_mask)
    own = turn >= 0
    where = {
        "all": own,
        "first": own & (turn == 0),
        "last": own & (turn == turns[:, None] - 1),
    }
    out = jnp.zeros(loss_mask.shape, jnp.float32)
    for scope, rewards in components.items():
        adv = group_advantages(rewards, num_generations=num_generations, baseline=baseline, scale=scale, epsilon=epsilon)
        out = out + jnp.where(where[scope], adv[:, None], 0.0)
    return out


def informative_groups(advantages: jnp.ndarray, trained: jnp.ndarray | None = None, *,
                       num_generations: int) -> jnp.ndarray:
    """Whether each group trains with an advantage that is not all zero: [G] bool.

    ``advantages`` [B] (one per row: every trained token of the row carries it; ``trained``
    is then not needed, a row has at least one) or [B, N] (turn credit); ``trained``
    [B, N] the tokens the loss trains on (the model's own). B = G * num_generations,
    group-major. Exact: a zero advantage is an exact 0 (:func:`group_advantages`)."""
    k = num_generations
    nonzero = advantages != 0
    if advantages.ndim == 2:
        if trained is None:
            raise ValueError("per-token advantages [B, N] need the trained tokens [B, N]")
        nonzero = jnp.any(nonzero & (trained > 0), axis=1)  # B
    return jnp.any(nonzero.reshape(-1, k), axis=1)  # G K -> G


def turn_components(per_fn: Mapping[str, Any], *, scopes: Mapping[str, str],
                    weights: Mapping[str, float]) -> dict[str, Any]:
    """The rewards (each [B], by name) summed by weight into one component per scope of
    turn-level credit: ``scopes`` maps a reward to its scope (absent: ``all``), ``weights``
    a reward to its weight (zero: left out). What :func:`turn_advantages` takes. Plain
    array math (host or device arrays): the update's program and the step's host-side
    filter (dynamic sampling, down-sampling) share it."""
    parts: dict[str, list[tuple[float, str]]] = {}
    for name in per_fn:
        if weights[name]:
            parts.setdefault(scopes.get(name, "all"), []).append((weights[name], name))
    return {scope: sum(w * per_fn[n] for w, n in terms) for scope, terms in parts.items()}


def in_scope_order(components: Mapping[str, Any]) -> dict[str, Any]:
    """``components`` (by scope) in the order of :data:`SCOPES` (all, first, last): what
    down-sampling ranks a group with equal totals by."""
    return {s: components[s] for s in SCOPES if s in components}


def informative_groups_of(totals: Any, per_fn: dict[str, Any], trained: Callable[[], Any], *, advantage: Any,
                          num_generations: int, components: Callable[[dict[str, Any]], dict[str, Any]]) -> np.ndarray:
    """Which groups of these rows ([G*K] total rewards and rewards by name, host arrays,
    group-major) are informative, [G] bool: the advantages the update would train them
    on, by its own functions and ``advantage`` options (``train.advantage``) over all
    ``num_generations`` samples, are not all zero on their trained tokens (``trained()``
    [G*K, N], read only under turn credit; ``components``: the rewards by name into
    their scopes' components, :func:`turn_components`). Eager array math on tiny arrays,
    not a program: the host-side filter of dynamic sampling. ``batch_std``'s batch-wide
    scale cannot turn a zero into a non-zero, so judging a round alone is exact."""
    adv, k = advantage, num_generations
    opts = dict(num_generations=k, baseline=adv.baseline, scale=adv.scale, epsilon=adv.epsilon)
    if adv.credit == "turn":
        own = jnp.asarray(trained())
        advantages = turn_advantages(components({n: jnp.asarray(v) for n, v in per_fn.items()}), own, **opts)
    else:
        own, advantages = None, group_advantages(jnp.asarray(totals), **opts)
    return np.asarray(informative_groups(advantages, own, num_generations=k))
