"""Expert parallelism: a mixture-of-experts layer's experts split over the expert mesh
axis ``ep``, tokens sent to the chips holding their experts and back by all-to-all.

Per device, under ``shard_map`` (tokens split over the call's batch axes and ``ep``;
expert weights over ``ep`` by expert, each expert's hidden width over the MLP's tensor
axes; anything else gathered as the call's layout needs):

1. dispatch: the ``n k`` (token, expert) pairs of the device's ``n`` tokens, sorted by
   the ``ep`` shard holding their expert, are written into a send buffer ``[ep, n k, D]``
   (slot ``[e, j]``: the ``j``-th pair bound for shard ``e``), with each pair's expert
   id within that shard (``X / ep`` for an empty slot), and exchanged by one
   :func:`jax.lax.all_to_all` over ``ep``;
2. the received ``ep n k`` rows, sorted by local expert, go through the dropless grouped
   matmuls (:func:`grpo.kernels.grouped_matmul`; the empty slots sort last, outside
   every group, and come out zero);
3. combine: the results go back by the reverse all-to-all, each pair reads its row, and
   the token's output is the gate-weighted sum, summed over the tensor axes that split
   the experts' hidden width.

Dropless by sizing for the worst case: every slot of the send buffer can hold all ``n k``
pairs of the device (all its tokens routed to one shard), so nothing is dropped and
there is no capacity factor, at ``ep`` times the routed pairs' bytes in the buffers and
on the wire (``(ep - 1) / ep`` of them leave the chip) and ``ep`` times the rows in the
grouped matmuls' inputs (the empty rows outside every group: a grouped kernel skips
them, XLA's cost analysis counts them). The token count is padded to a multiple of the
token shards; padded tokens' outputs are dropped.

May import: ``grpo.kernels``, ``grpo.sharding``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo.kernels.grouped_matmul import grouped_matmul

EP = "ep"


def _axes(rule: Any, mesh: Any, skip: Sequence[str] = ()) -> tuple[str, ...]:
    tup = () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)
    return tuple(a for a in tup if a in mesh.shape and mesh.shape[a] > 1 and a not in skip)


def expert_parallel(mesh: Any) -> bool:
    """Whether ``mesh`` splits the experts (an ``ep`` axis over 1)."""
    return mesh is not None and mesh.shape.get(EP, 1) > 1


def ep_experts_forward(
    x: jax.Array, experts: jax.Array, gates: jax.Array, p: Mapping[str, jax.Array], *, mesh: Any,
    rules: Mapping[str, Any], dtype: Any,
) -> jax.Array:
    """``sum_j gates[..., j] * expert_{experts[..., j]}(x)`` with the experts split over
    ``mesh``'s ``ep`` axis: x [N, D] (compute dtype), experts/gates [N, k] -> [N, D]
    (the same as :func:`grpo.models.layers.moe.experts_forward` on one device)."""
    N, D = x.shape
    X = p["expert_gate"].shape[0]
    ep = mesh.shape[EP]
    if X % ep:
        raise ValueError(f"{X} experts do not split over the expert axis of size {ep}")
    tokens = _axes(rules.get("batch"), mesh, skip=(EP,)) + (EP,)  # the tokens' shards
    hidden = _axes(rules.get("mlp"), mesh, skip=tokens)  # the experts' hidden width's
    shards = math.prod(mesh.shape[a] for a in tokens)
    pad = -N % shards
    if pad:  # padded tokens go to expert 0 with gate 0; their rows are dropped below
        x = jnp.pad(x, ((0, pad), (0, 0)))
        experts, gates = jnp.pad(experts, ((0, pad), (0, 0))), jnp.pad(gates, ((0, pad), (0, 0)))
    h = hidden or None
    rows, w_in, w_out = P(tokens, None), P(EP, None, h), P(EP, h, None)
    out = jax.shard_map(
        lambda *a: _local(*a, ep=ep, hidden=hidden, dtype=dtype), mesh=mesh,
        in_specs=(rows, rows, rows, w_in, w_in, w_out), out_specs=rows,
    )(x, experts.astype(jnp.int32), gates, p["expert_gate"].astype(dtype), p["expert_up"].astype(dtype),
      p["expert_down"].astype(dtype))
    return out[:N]


def _local(
    x: jax.Array, experts: jax.Array, gates: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array, *,
    ep: int, hidden: tuple[str, ...], dtype: Any,
) -> jax.Array:
    """One device's dispatch, experts and combine (see the module docstring)."""
    n, k = experts.shape
    D, Xl = x.shape[1], wg.shape[0]  # Xl: the experts on this device
    pairs = n * k
    flat = experts.reshape(-1)  # pair i*k + j
    dest = flat // Xl  # the ep shard holding the pair's expert
    order = jnp.argsort(dest, stable=True)
    counts = jnp.bincount(dest, length=ep)
    sdest = dest[order]
    slot = jnp.arange(pairs) - (jnp.cumsum(counts) - counts)[sdest]  # place among its shard's pairs
    send = jnp.zeros((ep, pairs, D), x.dtype).at[sdest, slot].set(jnp.take(x, order // k, axis=0))
    ids = jnp.full((ep, pairs), Xl, jnp.int32).at[sdest, slot].set((flat % Xl)[order])
    recv = jax.lax.all_to_all(send, EP, 0, 0).reshape(ep * pairs, D)  # [source shard, slot]
    rids = jax.lax.all_to_all(ids, EP, 0, 0).reshape(-1)
    by_expert = jnp.argsort(rids, stable=True)  # empty slots (id Xl) last, outside every group
    sizes = jnp.bincount(rids, length=Xl + 1)[:Xl].astype(jnp.int32)
    xs = jnp.take(recv, by_expert, axis=0)
    g = grouped_matmul(xs, wg, sizes)
    u = grouped_matmul(xs, wu, sizes)
    y = grouped_matmul(jax.nn.silu(g) * u, wd, sizes)
    y = jnp.zeros_like(y).at[by_expert].set(y, unique_indices=True).reshape(ep, pairs, D)
    back = jax.lax.all_to_all(y, EP, 0, 0)  # [shard the pair went to, slot]
    out = jnp.zeros((pairs, D), y.dtype).at[order].set(back[sdest, slot], unique_indices=True)
    out = jnp.einsum("nkd,nk->nd", out.reshape(n, k, D), gates.astype(dtype))
    return jax.lax.psum(out, hidden) if hidden else out


__all__ = ["ep_experts_forward", "expert_parallel"]
