"""The contract every blocked attention kernel keeps (:data:`AttentionFn`, see
:mod:`grpo.kernels.attention`): its reference in plain XLA, the start-up check of a kernel
against that reference, and the padding of a sequence to a kernel's blocks."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

AttentionFn = Callable[..., jax.Array]


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, scale: float) -> jax.Array:
    """The :data:`AttentionFn` contract in plain XLA (materialises the scores)."""
    T = q.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = (causal[None] & same)[:, None]  # B 1 T T
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return -(-n // m) * m


def pad_time(x: jax.Array, length: int, value: Any = 0) -> jax.Array:
    """``x`` [B, T, ...] padded with ``value`` to ``length`` slots on the time axis."""
    pad = length - x.shape[1]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


# --------------------------------------------------------------------------- self-check

CHECK_TOLERANCE = {"float32": 2e-2, "bfloat16": 6e-2, "float16": 4e-2}
"""The largest error a kernel may show against :func:`reference_attention` in the
start-up check, as a fraction of the reference's largest magnitude (outputs and each
gradient): above the rounding of two summation orders (TF32 or bf16 matmul passes on
GPU/TPU), far below what a wrong mask, scale or gradient gives (order 1)."""


def self_check(fn: AttentionFn, *, dtype: Any = jnp.float32, head_dim: int = 64, heads: int = 2,
               device: Any = None) -> str | None:
    """Why ``fn`` cannot be trusted on ``device``, or None: it is compiled there once on a
    tiny shape (2 rows of 40 tokens, ``heads`` query heads sharing one KV head, the
    model's ``head_dim``; one row left-padded, one holding two segments) and its outputs
    and gradients (q, k, v) compared with the XLA reference's, real query rows only.

    A kernel whose compile fails, or that is wrong, would otherwise surface in the middle
    of a run (a kernel is compiled with the update program) or not at all. Costs one
    small forward + backward compile of the kernel and of the reference."""
    B, T, H, K, E = 2, 40, heads, 1, head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, E), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (B, T, K, E), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (B, T, K, E), jnp.float32).astype(dtype)
    seg = jnp.asarray([[0] * 9 + [1] * (T - 9), [1] * 25 + [2] * (T - 25)], jnp.int32)  # B T
    weight = jax.random.normal(keys[3], (B, T, H, E), jnp.float32) * (seg > 0)[:, :, None, None]
    scale = 1.0 / math.sqrt(E)

    def outputs(attend):
        def loss(q, k, v):
            out = attend(q, k, v, seg, scale=scale).astype(jnp.float32)
            return jnp.sum(out * weight), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out * (seg > 0)[:, :, None, None], *grads)

    try:
        with jax.default_device(device) if device is not None else contextlib.nullcontext():
            got = jax.device_get(jax.jit(lambda: outputs(fn))())
            ref = jax.device_get(jax.jit(lambda: outputs(reference_attention))())
    except Exception as err:  # noqa: BLE001 - the kernel's own failure, reported in one line
        lines = str(err).strip().splitlines()
        return f"it failed to compile or run ({type(err).__name__}: {lines[0][:300] if lines else ''})"
    tol = CHECK_TOLERANCE.get(jnp.dtype(dtype).name, 2e-2)
    for what, a, b in zip(("outputs", "dq", "dk", "dv"), got, ref):
        a = np.asarray(a, np.float32)
        b = np.asarray(b, np.float32)
        if a.shape != b.shape:
            return f"its {what} have shape {a.shape}, the XLA reference's {b.shape}"
        err = float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-6) if np.all(np.isfinite(a)) else np.inf
        if not err <= tol:
            return (f"its {what} differ from the XLA reference's by {err:.3g} of their largest magnitude "
                    f"(tolerance {tol:g}, {jnp.dtype(dtype).name})")
    return None


__all__ = ["AttentionFn", "CHECK_TOLERANCE", "pad_time", "reference_attention", "round_up", "self_check"]
