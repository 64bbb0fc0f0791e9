"""Grouped (ragged) matmul: the experts of a mixture-of-experts layer over the tokens
routed to them, dropless.

Rows of ``x`` [M, K] are sorted by group (expert); ``group_sizes`` [G] says how many
rows each group has (their sum is M: no capacity, no token dropped). Row ``m`` of group
``g`` is multiplied by ``w[g]`` [K, N]. ``impl``:

- ``ragged_dot`` — :func:`jax.lax.ragged_dot`, on every backend (XLA's grouped GEMM on
  GPU, its TPU lowering, a loop on CPU); differentiable in ``x`` and ``w``.
- :func:`grouped_matmul_reference` — a dense per-row gather of the weights (memory
  M*K*N): the independent reference the tests compare against, not for models.

May import: ``grpo.core``. Not the models.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

GROUPED_IMPLS: tuple[str, ...] = ("ragged_dot",)


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str = "ragged_dot",
    preferred_element_type: Any = None,
) -> jax.Array:
    """x [M, K] (rows sorted by group) @ w[group of the row] [G, K, N] -> [M, N].

    ``group_sizes`` [G] int32 sums to M. ``preferred_element_type``: the accumulation and
    output dtype (default: x's)."""
    if impl != "ragged_dot":
        raise ValueError(f"unknown grouped matmul impl {impl!r}; choose one of {GROUPED_IMPLS}")
    return jax.lax.ragged_dot(
        x, w, group_sizes.astype(jnp.int32), preferred_element_type=preferred_element_type or x.dtype
    )


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The same product by gathering each row's weight matrix (a dense per-row reference)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    gid = jnp.searchsorted(ends, jnp.arange(x.shape[0], dtype=jnp.int32), side="right")  # M
    return jnp.einsum("mk,mkn->mn", x, w[jnp.minimum(gid, w.shape[0] - 1)])


__all__ = ["GROUPED_IMPLS", "grouped_matmul", "grouped_matmul_reference"]
