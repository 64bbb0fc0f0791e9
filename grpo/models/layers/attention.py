"""The attention block of a decoder layer: the residual stream normed and projected to
q/k/v with RoPE (:func:`qkv`), then the new keys/values written to the cache and attended
over (:func:`attend`).

Attention takes one of three forms, chosen by the :class:`LayerContext`:

- dense: ``jax.nn.dot_product_attention`` with the materialised mask
  (:func:`attention_mask`); the cache is a :class:`KVCache`, written in place;
- a blocked kernel (:data:`grpo.kernels.attention.AttentionFn`) over whole sequences,
  run per device under ``shard_map`` (:func:`sharded`: a Pallas call is opaque to XLA's
  partitioner, which would otherwise gather its operands onto every device);
- one decode token per row over a paged pool (:mod:`grpo.models.layers.paged`).

K/V stay at ``num_key_value_heads``: the grouped einsum of ``dot_product_attention``
never repeats them.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from grpo.kernels.attention import AttentionFn
from grpo.models.layers.context import LayerContext
from grpo.models.layers.norms import rms_norm
from grpo.models.layers.paged import paged_decode
from grpo.models.layers.projection import project
from grpo.models.layers.rope import apply_rope


class KVCache(NamedTuple):
    """Keys and values of every layer, ``[layers, batch, max_length, kv_heads, head_dim]``.

    K/V are stored at ``num_key_value_heads`` (no GQA repetition). A plain pytree:
    jit, donate and ``jax.tree.map`` it freely.
    """

    k: jax.Array
    v: jax.Array

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_length(self) -> int:
        return self.k.shape[2]

    def repeat(self, n: int) -> "KVCache":
        """Each row repeated ``n`` times in place (row b -> rows b*n .. b*n+n-1)."""
        return KVCache(k=jnp.repeat(self.k, n, axis=1), v=jnp.repeat(self.v, n, axis=1))


CACHE_AXES: tuple[str, ...] = ("layers", "batch", "cache_length", "kv_heads", "head_dim")


def attention_mask(kv_mask: jax.Array, q_slots: jax.Array) -> jax.Array:
    """[B, 1, T, S] bool: key slot s is visible to the query in slot q_slots[t] iff
    ``s <= q_slots[t]`` and ``kv_mask[b, s]``."""
    S = kv_mask.shape[-1]
    causal = jnp.arange(S, dtype=jnp.int32)[None, :] <= q_slots[:, None]  # T S
    return causal[None, None, :, :] & kv_mask.astype(bool)[:, None, None, :]


def qkv(
    ctx: LayerContext, h: jax.Array, p: Mapping[str, jax.Array], layer: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention block's inputs: the residual stream h [B, T, D] normed and projected
    to q [B, T, H, E] and k, v [B, T, K, E] (biases, Qwen3's q/k norms, RoPE)."""
    c, dt = ctx.config, ctx.dtype
    x = rms_norm(h, p["attn_norm"], c.rms_norm_eps, dt)
    q = project(ctx, "btd,dhe->bthe", x, p, "q_proj", layer)
    k = project(ctx, "btd,dke->btke", x, p, "k_proj", layer)
    v = project(ctx, "btd,dke->btke", x, p, "v_proj", layer)
    if c.qkv_bias:
        q = q + p["q_bias"].astype(dt)
        k = k + p["k_bias"].astype(dt)
        v = v + p["v_bias"].astype(dt)
    if c.qk_norm:  # Qwen3: per head, over head_dim, before RoPE
        q = rms_norm(q, p["q_norm"], c.rms_norm_eps, dt)
        k = rms_norm(k, p["k_norm"], c.rms_norm_eps, dt)
    q = ctx.constrain(apply_rope(q, ctx.cos, ctx.sin), ("batch", "length", "heads", "head_dim"))
    k = ctx.constrain(apply_rope(k, ctx.cos, ctx.sin), ("batch", "length", "kv_heads", "head_dim"))
    v = ctx.constrain(v, ("batch", "length", "kv_heads", "head_dim"))
    return q, k, v


def attend(ctx: LayerContext, q: jax.Array, k_new: jax.Array, v_new: jax.Array, kv: Any) -> tuple[jax.Array, Any]:
    """Attention of q [B, T, H, E] over the new keys/values or, with a cache carry ``kv``
    = (k, v, layer), over the cache after writing them at ``write_index``. Returns the
    output [B, T, H, E] and the carry ((k, v) updated; None without a cache)."""
    dt = ctx.dtype
    if ctx.paged is not None:
        return _attend_paged(ctx, q, k_new, v_new, kv)
    if kv is None:
        k_all, v_all = k_new, v_new
    else:
        ck, cv, layer = kv
        start = (layer, jnp.int32(0), ctx.write_index, jnp.int32(0), jnp.int32(0))
        ck = jax.lax.dynamic_update_slice(ck, k_new.astype(ck.dtype)[None], start)
        cv = jax.lax.dynamic_update_slice(cv, v_new.astype(cv.dtype)[None], start)
        ck = ctx.constrain(ck, CACHE_AXES)
        cv = ctx.constrain(cv, CACHE_AXES)
        k_all = jax.lax.dynamic_index_in_dim(ck, layer, axis=0, keepdims=False).astype(dt)
        v_all = jax.lax.dynamic_index_in_dim(cv, layer, axis=0, keepdims=False).astype(dt)
        kv = (ck, cv)
    scale = 1.0 / math.sqrt(ctx.config.head_dim)
    if ctx.kernel is not None:
        out = sharded(
            ctx.kernel, q, k_all, v_all, ctx.segment_ids, scale=scale, mesh=ctx.mesh, rules=dict(ctx.rules),
        )
        return out, kv
    out = jax.nn.dot_product_attention(
        q, k_all, v_all, mask=ctx.mask, scale=scale, implementation=ctx.dense_impl
    )  # B T H E
    return out, kv


def _attend_paged(
    ctx: LayerContext, q: jax.Array, k_new: jax.Array, v_new: jax.Array, kv: Any
) -> tuple[jax.Array, Any]:
    """One decode token per row (T = 1) over a paged pool: the new key/value written at
    token ``lengths`` of each live row's pages, then attention over the row's
    ``lengths + 1`` tokens (:func:`grpo.models.layers.paged.paged_decode`)."""
    page_table, lengths, live, spec = ctx.paged
    pk, pv, layer = kv
    out, pk, pv = paged_decode(
        q=q[:, 0], k_new=k_new[:, 0], v_new=v_new[:, 0], pool_k=pk, pool_v=pv, layer=layer, page_table=page_table,
        lengths=lengths, live=live, scale=1.0 / math.sqrt(ctx.config.head_dim), spec=spec, mesh=ctx.mesh,
    )
    return out[:, None].astype(ctx.dtype), (pk, pv)


# --------------------------------------------------------------------------- a kernel per device


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def head_specs(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], mesh: Mesh, rules: Mapping[str, Any]
) -> tuple[PartitionSpec, PartitionSpec, tuple[str, ...]]:
    """The per-device ``shard_map`` specs of q and k/v, and the mesh axes that split a KV
    shard's query heads further (empty: none).

    The batch goes over its activation axes and the sequence stays whole. Query heads go
    over their axes when the KV heads' axes lead them (``kv_heads: tp``, ``heads: (tp,
    fsdp)``, the serving layout): a device then holds its KV shard whole and reads the KV
    heads of its own query heads (:func:`sharded` slices them). Otherwise the query
    heads are split only as the KV heads are.
    """
    from grpo.sharding import fit_spec

    qs = fit_spec(q_shape, ("batch", None, "heads", None), mesh, rules)
    ks = fit_spec(k_shape, ("batch", None, "kv_heads", None), mesh, rules)
    qh, kh = _axes(qs[2]), _axes(ks[2])
    rest = qh[len(kh):]
    if qh[: len(kh)] != kh:
        qh, rest = kh, ()
    elif rest:
        local = q_shape[2] // math.prod(mesh.shape[a] for a in qh)
        group = q_shape[2] // k_shape[2]
        if local % group and group % local:
            qh, rest = kh, ()
    batch = qs[0]
    return PartitionSpec(batch, None, _entry(qh), None), PartitionSpec(batch, None, _entry(kh), None), rest


def sharded(
    fn: AttentionFn, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
    scale: float, mesh: Mesh | None, rules: Mapping[str, Any],
) -> jax.Array:
    """``fn`` per device under ``shard_map`` (a Pallas call is opaque to XLA's partitioner,
    which would otherwise gather its operands onto every device)."""
    if mesh is None or mesh.size == 1:
        return fn(q, k, v, segment_ids, scale=scale)
    qspec, kspec, rest = head_specs(q.shape, k.shape, mesh, rules)
    group = q.shape[2] // k.shape[2]

    def body(a, b, c, s):
        if rest:  # this device's query heads read a slice of its KV shard
            local = a.shape[2]
            start = (jax.lax.axis_index(rest) * local) // group
            size = max(1, local // group)
            b = jax.lax.dynamic_slice_in_dim(b, start, size, axis=2)
            c = jax.lax.dynamic_slice_in_dim(c, start, size, axis=2)
        return fn(a, b, c, s, scale=scale)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(qspec, kspec, kspec, PartitionSpec(qspec[0], None)), out_specs=qspec,
        check_vma=False,
    )(q, k, v, segment_ids)


__all__ = ["CACHE_AXES", "KVCache", "attend", "attention_mask", "head_specs", "qkv", "sharded"]
