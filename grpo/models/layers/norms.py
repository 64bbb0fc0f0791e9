"""RMSNorm: statistics in float32, the result in the compute dtype."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype: Any) -> jax.Array:
    """RMSNorm over the last axis; statistics in float32, result in ``dtype``."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return y.astype(dtype) * weight.astype(dtype)


__all__ = ["rms_norm"]
