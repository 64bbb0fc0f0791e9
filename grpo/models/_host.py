"""Device -> host transfers for writing checkpoints (HF safetensors, PEFT adapters):
one layer of a stacked ``[L, ...]`` parameter at a time, gathered from every process
when the array spans several. Shared by ``loading`` and ``lora``."""

from __future__ import annotations

import jax
import numpy as np


@jax.jit
def take_layer(x: jax.Array, i: jax.Array) -> jax.Array:
    """Layer ``i`` of a stacked ``[L, ...]`` array (one compiled program for every i)."""
    return jax.lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole of ``x`` as a NumPy array on every process."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
