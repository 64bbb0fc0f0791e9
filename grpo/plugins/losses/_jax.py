"""Per-token log-probs the readable way: materialise the logits, take the log-softmax.

Memory: holds ``[B, T, V]`` f32 logits (and, under autodiff, a softmax/cotangent of the
same size). Sharding: under GSPMD with the head weight sharded over the vocabulary (tp),
XLA partitions the matmul and inserts the collectives for the max/sum reductions of the
log-softmax and for the target gather, so this path is correct for any mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(
    *,
    hidden: jax.Array,
    head_weight: jax.Array,
    targets: jax.Array,
    temperature: float,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """``log_softmax(hidden @ head_weight / temperature)[targets]``.

    hidden [B, T, D], head_weight [D, V], targets [B, T] -> (logp [B, T] f32,
    entropy [B, T] f32 — with its gradient when ``entropy_grad`` (the entropy bonus),
    else without — or None).
    """
    # The head matmul's one precision rule (sampler, reference, Pallas alike): operands in
    # the compute dtype of ``hidden``, f32 accumulation. Promoting a bf16 ``hidden`` to an
    # f32 head here made policy and sampler log-probs differ at identical weights.
    logits = jnp.einsum(
        "btd,dv->btv", hidden, head_weight.astype(hidden.dtype), preferred_element_type=jnp.float32
    )  # B T V
    if temperature != 1.0:
        logits = logits / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)  # B T
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]  # B T
    logp = picked - logz
    entropy = None
    if entropy_grad:
        probs = jnp.exp(logits - logz[..., None])  # B T V
        entropy = logz - jnp.sum(probs * logits, axis=-1)
    elif with_entropy:
        sg = jax.lax.stop_gradient
        probs = jnp.exp(sg(logits) - sg(logz)[..., None])  # B T V
        entropy = sg(logz) - jnp.sum(probs * sg(logits), axis=-1)
    return logp, entropy
