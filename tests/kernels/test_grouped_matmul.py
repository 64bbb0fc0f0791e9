"""The grouped (ragged) expert matmul against a dense per-row reference, values and
gradients (issue 54, item 2): empty groups, one group holding every row, uneven sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo.kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference


def _dense(x: np.ndarray, w: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """NumPy float64: each group's rows times its own matrix (the independent reference)."""
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for g, n in enumerate(sizes):
        out[start:start + n] = x[start:start + n].astype(np.float64) @ w[g].astype(np.float64)
        start += n
    return out


@pytest.mark.parametrize("sizes", [(3, 0, 5, 2), (10, 0, 0, 0), (0, 0, 0, 10), (1, 2, 3, 4)])
def test_values_and_gradients_equal_the_dense_reference(sizes):
    sizes = np.array(sizes, np.int32)
    rng = np.random.default_rng(int(sizes @ np.arange(1, 5)))
    x = rng.standard_normal((int(sizes.sum()), 6)).astype(np.float32)
    w = rng.standard_normal((4, 6, 5)).astype(np.float32)
    y = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)))
    np.testing.assert_allclose(y, _dense(x, w, sizes), atol=1e-5)
    np.testing.assert_allclose(np.asarray(grouped_matmul_reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))),
                               _dense(x, w, sizes), atol=1e-5)
    cot = rng.standard_normal(y.shape).astype(np.float32)

    def loss(f):
        return lambda a, b: jnp.sum(f(a, b, jnp.asarray(sizes)) * cot)

    gx, gw = jax.grad(loss(grouped_matmul), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    rx, rw = jax.grad(loss(grouped_matmul_reference), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), atol=1e-5)
    # d/dw[g] = x_g^T cot_g, zero for an empty group (checked against NumPy too)
    start = 0
    for g, n in enumerate(sizes):
        np.testing.assert_allclose(np.asarray(gw[g]), x[start:start + n].T @ cot[start:start + n], atol=1e-5)
        start += n


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="unknown grouped matmul impl"):
        grouped_matmul(jnp.zeros((2, 3)), jnp.zeros((1, 3, 4)), jnp.array([2]), impl="megablox")
