"""The MLP block of a decoder layer (SwiGLU: ``down(silu(gate(x)) * up(x))``) with its
residual. A family with experts runs :func:`grpo.models.layers.moe.moe_block` instead."""

from __future__ import annotations

from typing import Mapping

import jax

from grpo.models.layers.context import LayerContext
from grpo.models.layers.norms import rms_norm
from grpo.models.layers.projection import project


def mlp_block(ctx: LayerContext, h: jax.Array, p: Mapping[str, jax.Array], layer: jax.Array) -> jax.Array:
    """The MLP block with its residual: h [B, T, D] + down(silu(gate(x)) * up(x)), x the
    normed h."""
    x = rms_norm(h, p["mlp_norm"], ctx.config.rms_norm_eps, ctx.dtype)
    g = project(ctx, "btd,df->btf", x, p, "gate_proj", layer)
    u = project(ctx, "btd,df->btf", x, p, "up_proj", layer)
    y = ctx.constrain(jax.nn.silu(g) * u, ("batch", "length", "mlp"))
    h = h + project(ctx, "btf,fd->btd", y, p, "down_proj", layer)
    return ctx.constrain(h, ("batch", "length", "embed"))


__all__ = ["mlp_block"]
