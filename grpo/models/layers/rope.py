"""Rotary position embeddings (transformers' rotate-half convention): the inverse
frequencies computed on the host in float32 in transformers' operation order (so the
``llama3`` scaling's band edges fall where transformers' do), the cos/sin tables of a
call's positions and the rotation, in float32."""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np


def rope_inv_freq(head_dim: int, theta: float, llama3: Mapping[str, Any] | None = None) -> np.ndarray:
    """RoPE inverse frequencies [head_dim / 2] in float32, as transformers computes them.

    ``theta ** (-2i / head_dim)``; with ``llama3`` scaling (Llama 3.1/3.2), wavelengths
    longer than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, shorter than ``... / high_freq_factor`` kept, and the band between
    interpolated smoothly — transformers' ``_compute_llama3_parameters``, step by step in
    float32 so the band edges fall on the same frequencies.
    """
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim)
    inv_freq = (f32(1.0) / (f32(theta) ** exponent)).astype(f32)
    if not llama3:
        return inv_freq
    factor = f32(llama3["factor"])
    low = f32(llama3["low_freq_factor"])
    high = f32(llama3["high_freq_factor"])
    old_context = f32(llama3["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = (f32(2 * math.pi) / inv_freq).astype(f32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(f32)
    smooth = ((old_context / wavelen - low) / (high - low)).astype(f32)
    smoothed = ((f32(1) - smooth) * scaled / factor + smooth * scaled).astype(f32)
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


def rope_tables(
    positions: jax.Array, head_dim: int, theta: float, inv_freq: np.ndarray | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, head_dim] (float32) for integer positions [B, T].

    transformers' convention: frequencies ``theta ** (-2i / head_dim)`` (or the given
    ``inv_freq`` [head_dim / 2], e.g. llama3-scaled) for the first half, repeated for the
    second half (paired with :func:`apply_rope`'s rotate-half).
    """
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    else:
        inv_freq = jnp.asarray(inv_freq, jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # B T E/2
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # B T E
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, N, E] by cos/sin [B, T, E] (rotate-half convention), in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


__all__ = ["apply_rope", "rope_inv_freq", "rope_tables"]
