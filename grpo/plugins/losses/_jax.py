"""Per-token log-probs the readable way: materialise the logits, take the log-softmax.

Memory: holds ``[B, T, V]`` f32 logits (and, under autodiff, a softmax/cotangent of the
same size). Sharding: under GSPMD with the head weight sharded over the vocabulary (tp),
XLA partitions the matmul and inserts the collectives for the max/sum reductions of the
log-softmax and for the target gather, so this path is correct for any mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def head_logits(*, hidden: jax.Array, head_weight: jax.Array, temperature: float) -> jax.Array:
    """hidden [B, T, D] @ head_weight [D, V] / temperature -> [B, T, V] f32 logits."""
    # The head matmul's one precision rule (sampler, reference, Pallas alike): operands in
    # the compute dtype of ``hidden``, f32 accumulation. Promoting a bf16 ``hidden`` to an
    # f32 head here made policy and sampler log-probs differ at identical weights.
    logits = jnp.einsum(
        "btd,dv->btv", hidden, head_weight.astype(hidden.dtype), preferred_element_type=jnp.float32
    )  # B T V
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def logits_logprobs(
    logits: jax.Array,
    targets: jax.Array,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """[B, T, V] scaled logits -> (logp [B, T] f32, entropy [B, T] f32 or None, outside
    [B, T] bool or None).

    Without truncation (``top_k`` 0, ``top_p`` 1.0) ``logp`` is the full
    ``log_softmax(logits)[targets]`` and ``outside`` None. With it (``loss.truncated_policy``)
    ``logp`` is under the sampler's top-k/top-p rule applied to these logits, renormalised
    over the kept set, and ``outside`` marks the targets that fell outside it (see
    :func:`grpo.engine.rollout._sampling.truncated_logprobs`). The entropy is the full
    distribution's either way (with its gradient when ``entropy_grad``: the entropy bonus).
    """
    logz = jax.nn.logsumexp(logits, axis=-1)  # B T
    outside = None
    if top_k > 0 or top_p < 1.0:
        from grpo.engine.rollout._sampling import truncated_logprobs

        logp, outside = truncated_logprobs(logits, targets, top_k=top_k, top_p=top_p)
    else:
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
    return logp, entropy, outside


def token_logprobs(
    *,
    hidden: jax.Array,
    head_weight: jax.Array,
    targets: jax.Array,
    temperature: float,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[jax.Array, jax.Array | None]:
    """``log_softmax(hidden @ head_weight / temperature)[targets]`` (under the top-k/top-p
    truncation ``top_k``/``top_p`` when set, see :func:`logits_logprobs`).

    hidden [B, T, D], head_weight [D, V], targets [B, T] -> (logp [B, T] f32,
    entropy [B, T] f32 — with its gradient when ``entropy_grad`` (the entropy bonus),
    else without — or None).
    """
    logits = head_logits(hidden=hidden, head_weight=head_weight, temperature=temperature)
    logp, entropy, _ = logits_logprobs(logits, targets, top_k=top_k, top_p=top_p,
                                       with_entropy=with_entropy, entropy_grad=entropy_grad)
    return logp, entropy
