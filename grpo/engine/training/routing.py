"""Mixture-of-experts routing in the update (issue 54): the sampler's routed experts laid
out for the trainer's forward (router replay), the routing metrics and the router's
auxiliary losses.

- :func:`moe_call` — what a forward over a batch asks of its MoE layers
  (:class:`grpo.models.layers.moe.MoeCall`): the rollout's experts of each input token
  ([layers, rows, tokens, k], -1 for prompt tokens), whether to use them
  (``router_replay: rollout``) or only compare (``compare``), and the tokens the
  statistics count: those whose hidden state predicts a trained token.
- :func:`routing_metrics` — ``moe/routing_agreement`` (completion tokens whose recomputed
  top-k equals the rollout's), ``moe/expert_load/max|mean`` (a layer's busiest expert over
  its mean load; the max and the mean over layers) and the two router losses.
- :func:`router_losses` — ``load_balancing_loss * LB + router_z_loss * Z``, for the loss.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from grpo.models.layers.moe import MoeCall, load_balancing_loss, routed_shape, router_z_loss


def is_moe(model: Any) -> bool:
    return bool(getattr(model.config, "num_experts", 0))


def moe_call(batch: Any, *, packed: bool, options: Any, replay: bool = True) -> MoeCall:
    """The :class:`MoeCall` of a forward over ``batch`` (an ``UpdateBatch`` or a
    micro-batch of a ``PackedBatch``). ``replay``: False ignores the rollout's experts
    (the reference model routes itself)."""
    routed = getattr(batch, "routed_experts", None) if replay else None
    use = options is not None and options.router_replay == "rollout"
    if packed:  # W L: the slots whose output predicts a trained token
        mask = batch.trained > 0
        given = None if routed is None else jnp.moveaxis(routed, 2, 0)  # W L Ly k -> Ly W L k
        return MoeCall(replay=given, use_replay=use and given is not None, mask=mask)
    B, lp = batch.prompt_tokens.shape
    # slot lp-1+j predicts completion token j: those slots count
    mask = jnp.concatenate([jnp.zeros((B, lp - 1), bool), batch.trained > 0, jnp.zeros((B, 1), bool)], axis=1)
    if routed is None:
        return MoeCall(mask=mask)
    prompt = jnp.full((B, lp) + routed.shape[2:], -1, routed.dtype)
    given = jnp.moveaxis(jnp.concatenate([prompt, routed], axis=1), 2, 0)  # B S Ly k -> Ly B S k
    return MoeCall(replay=given, use_replay=use, mask=mask)


def routing_metrics(routing: Any, *, top_k: int, compared: bool) -> dict[str, jax.Array]:
    """Scalars of a forward's routing (each field stacked [layers, ...])."""
    X = routing.load.shape[-1]
    mean = routing.tokens * top_k / X  # L: each expert's load under uniform routing
    ratio = jnp.max(routing.load, axis=-1) / jnp.maximum(mean, 1e-9)  # L
    out = {
        "moe/expert_load/max": jnp.max(ratio),
        "moe/expert_load/mean": jnp.mean(ratio),
        "moe/load_balancing_loss": load_balancing_loss(routing, top_k),
        "moe/router_z_loss": router_z_loss(routing),
    }
    if compared:
        out["moe/routing_agreement"] = jnp.sum(routing.agree) / jnp.maximum(jnp.sum(routing.compared), 1.0)
    return out


def router_losses(metrics: dict[str, jax.Array], options: Any) -> jax.Array:
    """The router's auxiliary losses with their coefficients (0 when both are off)."""
    total = jnp.float32(0.0)
    if options is not None and options.load_balancing_loss > 0:
        total = total + options.load_balancing_loss * metrics["moe/load_balancing_loss"]
    if options is not None and options.router_z_loss > 0:
        total = total + options.router_z_loss * metrics["moe/router_z_loss"]
    return total


__all__ = ["is_moe", "moe_call", "routed_shape", "router_losses", "routing_metrics"]
