"""The mixture-of-experts block of a decoder layer (Qwen3-MoE), in place of
:func:`grpo.models.layers.mlp.mlp_block`, with its residual.

Routing (transformers ``Qwen3MoeTopKRouter``): router logits ``x @ router`` [B, T, X]
(float32 accumulation), a float32 softmax over the X experts, the top ``k`` kept and,
with ``norm_topk_prob``, renormalised to sum to one. The token's output is the sum over
its k experts of ``gate * down(silu(gate_proj(x)) * up_proj(x))``.

Router replay (R3): given the experts a token was routed to elsewhere (the sampler's,
``p["moe_replay"]`` [B, T, k] for this layer, -1 where a token has none) and
``MoeCall.use_replay``, those ids are used instead of the recomputed top-k; the gates are still the router's probabilities *of
those experts* (renormalised), so the router gets its gradient.

Experts run dropless as grouped matmuls (:func:`grpo.kernels.grouped_matmul`): the
B*T*k (token, expert) pairs sorted by expert, one ragged matmul per projection, then
unsorted and gate-weighted. No capacity factor, no token dropped. With an expert mesh
axis (``mesh.expert_parallel``) the experts are split over it and the tokens reach them
by all-to-all (:mod:`grpo.models.layers.expert_parallel`).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from grpo.kernels.grouped_matmul import grouped_matmul
from grpo.models.layers.context import LayerContext
from grpo.models.layers.expert_parallel import ep_experts_forward, expert_parallel
from grpo.models.layers.norms import rms_norm

EXPERT_ID_DTYPE = jnp.int16
"""How routed expert ids are stored and carried (up to 32767 experts)."""


class MoeCall(NamedTuple):
    """What a forward asks of its mixture-of-experts layers (``Decoder(..., moe=...)``).

    ``replay`` [L, B, T, k] int: another forward's routed experts (the sampler's); with
    ``use_replay`` they replace the recomputed top-k, otherwise they are only compared
    (``LayerRouting.agree``). ``mask`` [B, T] bool: the tokens the statistics count
    (None: all)."""

    replay: jax.Array | None = None
    use_replay: bool = False
    mask: jax.Array | None = None


class LayerRouting(NamedTuple):
    """One layer's routing (stacked to [L, ...] by the layer scan)."""

    experts: jax.Array  # [B, T, k] EXPERT_ID_DTYPE: the experts each token used
    load: jax.Array  # [X] float32: counted tokens routed to each expert
    prob_sum: jax.Array  # [X] float32: the counted tokens' router probabilities, summed
    z_sum: jax.Array  # [] float32: sum over counted tokens of logsumexp(router logits)^2
    agree: jax.Array  # [] float32: compared tokens whose recomputed top-k set equals the replayed one
    compared: jax.Array  # [] float32: counted tokens with replayed ids (all counted tokens without replay)
    tokens: jax.Array  # [] float32: counted tokens


def route(
    ctx: LayerContext, x: jax.Array, router: jax.Array, replay: jax.Array | None, use_replay: bool
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """(experts [B, T, k] int32, gates [B, T, k] float32, probs [B, T, X] float32, logits
    [B, T, X] float32, own top-k [B, T, k] int32) of normed x [B, T, D]."""
    c = ctx.config
    logits = jnp.einsum("btd,dx->btx", x, router.astype(ctx.dtype), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top, own = jax.lax.top_k(probs, c.num_experts_per_tok)
    if replay is not None and use_replay:
        # A token without replayed ids (-1: a prompt token, the last completion token,
        # padding) keeps its own top-k.
        given = replay.astype(jnp.int32)
        experts = jnp.where(given[..., :1] >= 0, given, own)
        top = jnp.take_along_axis(probs, experts, axis=-1)
    else:
        experts = own
    if c.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return experts, top, probs, logits, own


def experts_forward(
    ctx: LayerContext, x: jax.Array, experts: jax.Array, gates: jax.Array, p: Mapping[str, jax.Array]
) -> jax.Array:
    """sum_j gates[..., j] * expert_{experts[..., j]}(x): x [N, D], experts/gates [N, k]
    -> [N, D] in the compute dtype (dropless grouped matmuls)."""
    dt = ctx.dtype
    N, k = experts.shape
    X = p["expert_gate"].shape[0]
    flat = experts.reshape(-1)  # N*k, pair i*k + j
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=X).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)  # N*k D, sorted by expert
    g = grouped_matmul(xs, p["expert_gate"].astype(dt), sizes)
    u = grouped_matmul(xs, p["expert_up"].astype(dt), sizes)
    y = grouped_matmul(jax.nn.silu(g) * u, p["expert_down"].astype(dt), sizes)  # N*k D
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True).reshape(N, k, -1)  # back to pair order
    return jnp.einsum("nkd,nk->nd", y, gates.astype(dt))


def moe_block(
    ctx: LayerContext, h: jax.Array, p: Mapping[str, jax.Array], layer: jax.Array
) -> tuple[jax.Array, LayerRouting | None]:
    """The MoE block with its residual: (h [B, T, D] + experts(normed h), the layer's
    routing when the call asked for it (``ctx.moe``), else None)."""
    c = ctx.config
    B, T, D = h.shape
    call: MoeCall | None = ctx.moe
    replay = p.get("moe_replay")
    x = rms_norm(h, p["mlp_norm"], c.rms_norm_eps, ctx.dtype)
    experts, gates, probs, logits, own = route(ctx, x, p["router"], replay, bool(call and call.use_replay))
    if expert_parallel(ctx.mesh):  # experts split over the mesh's ep axis: all-to-all dispatch
        y = ep_experts_forward(x.reshape(B * T, D), experts.reshape(B * T, -1), gates.reshape(B * T, -1), p,
                               mesh=ctx.mesh, rules=dict(ctx.rules), dtype=ctx.dtype)
    else:
        y = experts_forward(ctx, x.reshape(B * T, D), experts.reshape(B * T, -1), gates.reshape(B * T, -1), p)
    h = ctx.constrain(h + y.reshape(B, T, D), ("batch", "length", "embed"))
    if call is None:
        return h, None
    return h, _routing(experts, probs, logits, own, replay, call.mask, c.num_experts)


def _routing(
    experts: jax.Array, probs: jax.Array, logits: jax.Array, own: jax.Array, replay: jax.Array | None,
    mask: jax.Array | None, num_experts: int,
) -> LayerRouting:
    B, T, _ = experts.shape
    m = jnp.ones((B, T), jnp.float32) if mask is None else mask.astype(jnp.float32)
    hits = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(axis=2)  # B T X
    lse = jax.nn.logsumexp(logits, axis=-1)
    if replay is None:
        agree = compared = jnp.sum(m)
    else:  # over the tokens that have replayed ids
        given = replay.astype(jnp.int32)
        has = (given[..., 0] >= 0).astype(jnp.float32)
        same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(given, axis=-1), axis=-1)
        agree, compared = jnp.sum(m * has * same), jnp.sum(m * has)
    return LayerRouting(
        experts=experts.astype(EXPERT_ID_DTYPE),
        load=jnp.einsum("bt,btx->x", m, hits),
        prob_sum=jnp.einsum("bt,btx->x", m, probs),
        z_sum=jnp.sum(m * lse * lse),
        agree=agree,
        compared=compared,
        tokens=jnp.sum(m),
    )


def load_balancing_loss(routing: Any, top_k: int) -> jax.Array:
    """Switch-Transformer load-balancing loss, mean over layers: ``X * sum_x f_x * P_x``,
    f_x the share of (token, slot) pairs routed to expert x and P_x its mean router
    probability over the counted tokens (1 for perfectly uniform routing)."""
    tokens = jnp.maximum(routing.tokens, 1.0)[:, None]  # L 1
    f = routing.load / (tokens * top_k)
    P = routing.prob_sum / tokens
    return jnp.mean(routing.load.shape[-1] * jnp.sum(f * P, axis=-1))


def router_z_loss(routing: Any) -> jax.Array:
    """ST-MoE router z-loss, mean over layers: mean over tokens of logsumexp(logits)^2."""
    return jnp.mean(routing.z_sum / jnp.maximum(routing.tokens, 1.0))



def routed_shape(graphdef: Any) -> tuple[int, int] | None:
    """(layers, experts per token) of the model a graphdef describes (its static config),
    or None for a dense model: the trailing dims of ``routed_experts``."""
    for name, value in getattr(graphdef, "attributes", ()):
        if name == "config":
            c = getattr(value, "value", None)
            if getattr(c, "num_experts", 0):
                return c.num_hidden_layers, c.num_experts_per_tok
            return None
    return None

__all__ = [
    "EXPERT_ID_DTYPE", "LayerRouting", "MoeCall", "experts_forward", "load_balancing_loss", "moe_block", "route",
    "routed_shape", "router_z_loss",
]
