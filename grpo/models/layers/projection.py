"""A layer's projections: the base weight (dequantized when stored as QLoRA codes; a
quantized rollout's codes times their per-channel scales, :mod:`grpo.models.rollout_quant`) and,
when the projection is a LoRA target, the adapter's term beside it (never merged), with
its per-token dropout."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from grpo.models.layers.context import LayerContext
from grpo.models.quant import dequantize
from grpo.models.rollout_quant import quantized_matmul


def project(
    ctx: LayerContext, eq: str, x: jax.Array, p: Mapping[str, jax.Array], name: str, layer: jax.Array
) -> jax.Array:
    """``x`` through projection ``name`` (``eq``: its einsum, x first): the (dequantized)
    base weight plus, when targeted, the adapter ``(alpha / r) * (dropout(x) @ A) @ B``,
    never merged."""
    w = p[name]
    if f"{name}_qscale" in p:  # a quantized rollout's codes, one scale per output channel
        y = quantized_matmul(eq, x, w, p[f"{name}_qscale"], ctx.dtype)
    else:
        if f"{name}_scale" in p:
            w = dequantize(w, p[f"{name}_scale"], ctx.quantization, ctx.dtype, axis=0)
        y = jnp.einsum(eq, x, w.astype(ctx.dtype))
    if f"{name}_lora_a" not in p:
        return y
    return y + _adapter(ctx, eq, x, p, name, layer)


def _adapter(
    ctx: LayerContext, eq: str, x: jax.Array, p: Mapping[str, jax.Array], name: str, layer: jax.Array
) -> jax.Array:
    """The adapter's term of projection ``name``: ``x`` [lead..., contracted...] through
    A [contracted..., r] then B [r, kept...], scaled by ``alpha / r``."""
    dt = ctx.dtype
    ins, out = eq.split("->")
    xs, ws = ins.split(",")
    contracted = "".join(ch for ch in ws if ch in xs)
    kept = "".join(ch for ch in ws if ch not in xs)
    lead = "".join(ch for ch in out if ch not in kept)
    if ctx.dropout_keys is not None:
        x = _adapter_dropout(ctx, x, name, layer)
    t = jnp.einsum(f"{xs},{contracted}r->{lead}r", x, p[f"{name}_lora_a"].astype(dt))
    d = jnp.einsum(f"{lead}r,r{kept}->{out}", t, p[f"{name}_lora_b"].astype(dt))
    return d * jnp.asarray(ctx.lora.scale, dt)


def _adapter_dropout(ctx: LayerContext, x: jax.Array, name: str, layer: jax.Array) -> jax.Array:
    """Inverted dropout on an adapter's input [B, T, ...]: each token's mask from its
    row's key folded with the layer, the projection (every adapter draws its own) and the
    token's position in its sequence. A token's mask is then the same wherever the token
    sits: in a padded row (any left padding) or in a packed bin, in any micro-batch."""
    keep = 1.0 - ctx.lora.dropout
    salt = ctx.config.layer_params().index(name)

    def token_mask(k, pos):
        k = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(k), layer), salt)
        return jax.random.bernoulli(jax.random.fold_in(k, pos), keep, x.shape[2:])

    masks = jax.vmap(jax.vmap(token_mask))(ctx.dropout_keys, ctx.positions)  # B T ...
    return jnp.where(masks, x / keep, jnp.zeros((), x.dtype)).astype(x.dtype)


__all__ = ["project"]
