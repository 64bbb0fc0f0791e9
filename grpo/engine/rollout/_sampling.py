"""Token sampling math for the rollout sampler: pure, keyword-only, jittable.

Conventions (shared with the trainer's loss):

- The temperature divides the logits: ``scaled = logits / temperature``.
- top-k and top-p only restrict *which* tokens can be drawn. They are applied in
  transformers' order: top-k on ``scaled``, then top-p on the distribution renormalised
  over the surviving tokens (the smallest set of most likely tokens whose mass reaches
  ``top_p``; the most likely token is always kept). Tokens tied with the last kept value
  are kept too.
- Two log-probs of each drawn token are reported. The *full-vocabulary* one,
  ``log_softmax(scaled)[token]`` over the unfiltered vocabulary: the quantity the
  trainer's loss computes from its own forward pass, so the two can be compared (the
  sampler/trainer gap metrics) whatever filtering was used. And the *behaviour* one: the
  log-prob under the distribution that actually drew the token, ``scaled`` restricted to
  the kept tokens and renormalised over them (``log_softmax`` of the filtered logits):
  what importance weights against the sampling policy need (``loss.mismatch``). It is
  the full one plus ``-log(kept mass)``. With no filter the two are one array.
- ``loss.truncated_policy``: the trainer computes its log-probs under the same rule
  (:func:`truncated_logprobs`: the kept set from its own logits by :func:`filter_threshold`,
  renormalised over it), so they compare with the behaviour ones and the importance
  weight is about 1 rather than the kept mass.
- On a vocabulary-sharded head (the ``serving`` rollout style with ``tensor_parallel``
  > 1) nothing here gathers a ``[B, V]`` row for plain sampling: XLA partitions the
  log-sum-exp as per-shard max/sum reductions plus two ``[B]`` all-reduces, the Gumbel
  noise is generated per shard from each element's index, and the argmax is a per-shard
  argmax plus an all-gather of ``[B, tp]`` (value, index) pairs (checked in the compiled
  decode loop, ``tests/engine/rollout/test_layout.py``). top-k and top-p do need whole rows:
  with either on, the compiled loop all-gathers the ``[rows per shard, V]`` f32 logits every token,
  ``(tp-1)/tp x rows x V x 4`` bytes into each chip (Qwen2.5's 151,936-token vocabulary,
  32 rows per shard, tp=2: ~9.7 MB per token, ~24 us at v6e's 400 GB/s inbound ICI).
- Randomness is per row: each row has its own key (derived from the run key and the
  row's *global* index, :func:`grpo.engine.rollout.decoding.row_keys`) folded with the step number
  (:func:`step_keys`), so a row's draws never depend on how the batch is sharded or how
  many rows there are beside it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What to sample (hashable; every field is static for jit).

    - ``max_new_tokens``: completion length cap N.
    - ``num_generations``: K samples per prompt (the prompt is prefilled once).
    - ``temperature``: divides the logits (> 0), for sampling and reported log-probs.
    - ``top_k``: keep the k most likely tokens (0 = off); ``top_p``: nucleus mass (1.0 =
      off). Both restrict what can be drawn: the full-vocabulary log-probs ignore them,
      the behaviour log-probs are under the renormalised, truncated distribution.
    - ``greedy``: argmax instead of a draw.
    - ``eos_ids``: any of these ends a sequence (the stop token is part of the completion).
    - ``pad_id``: written after a sequence stops.
    - ``early_stop_chunk``: check "all rows stopped" every N tokens; 0 = never stop early.
    """

    max_new_tokens: int
    num_generations: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    early_stop_chunk: int = 32

    def __post_init__(self) -> None:
        eos = self.eos_ids
        if eos is None:
            eos = ()
        elif isinstance(eos, (int, np.integer)):
            eos = (eos,)
        object.__setattr__(self, "eos_ids", tuple(sorted({int(e) for e in eos})))
        problems = []
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            problems.append(f"max_new_tokens must be an integer >= 1 (got {self.max_new_tokens!r})")
        if not (isinstance(self.num_generations, int) and self.num_generations >= 1):
            problems.append(f"num_generations must be an integer >= 1 (got {self.num_generations!r})")
        if not self.temperature > 0:
            problems.append(f"temperature must be > 0 (got {self.temperature!r})")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            problems.append(f"top_k must be an integer >= 0 (got {self.top_k!r})")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not (isinstance(self.early_stop_chunk, int) and self.early_stop_chunk >= 0):
            problems.append(f"early_stop_chunk must be an integer >= 0 (got {self.early_stop_chunk!r})")
        if any(e < 0 for e in self.eos_ids) or self.pad_id < 0:
            problems.append(f"token ids must be >= 0 (eos_ids={self.eos_ids}, pad_id={self.pad_id})")
        if problems:
            raise ValueError("Invalid SamplingParams: " + "; ".join(problems))

    @property
    def truncates(self) -> bool:
        """Whether top-k/top-p restrict the draw, so that the behaviour policy may differ
        from the full-vocabulary one: the sampler then records both log-probs (a top-k of
        at least the vocabulary records two equal arrays)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


def step_keys(keys: jax.Array, step: jax.Array | int) -> jax.Array:
    """Every row's key for decode step ``step`` (same leading shape as ``keys``): one step
    for all rows (a scalar), or each row's own [B] (the continuous sampler's rows are at
    different steps; the key of (row, step) is the same either way)."""
    step = jnp.broadcast_to(jnp.asarray(step, jnp.uint32), keys.shape[:1])
    return jax.vmap(jax.random.fold_in)(keys, step)


def filters(*, top_k: int, top_p: float, vocab: int) -> bool:
    """Whether top-k or top-p restricts the draw over a ``vocab``-token vocabulary (top-k
    of at least the vocabulary is off)."""
    return 0 < top_k < vocab or top_p < 1.0


def filter_threshold(scaled: jax.Array, *, top_k: int, top_p: float) -> jax.Array | None:
    """[..., V] temperature-scaled logits -> [...] smallest logit that may still be drawn
    (None when neither filter is on): the sampler's [B, V] rows, and the trainer's
    [B, T, V] positions under ``loss.truncated_policy`` (:func:`truncated_logprobs`)."""
    V = scaled.shape[-1]
    use_k = 0 < top_k < V
    use_p = top_p < 1.0
    if not filters(top_k=top_k, top_p=top_p, vocab=V):
        return None
    if use_k:
        vals = jax.lax.top_k(scaled, top_k)[0]  # B k, descending
    else:
        # A full sort per step: only paid for when top-p is used without top-k.
        vals = -jnp.sort(-scaled, axis=-1)  # B V, descending
    if not use_p:
        return vals[..., -1]
    probs = jax.nn.softmax(vals, axis=-1)  # renormalised over the top-k survivors
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p).astype(jnp.int32)  # a prefix: cumulative mass is monotone
    n_keep = jnp.maximum(keep.sum(axis=-1), 1)
    return jnp.take_along_axis(vals, (n_keep - 1)[..., None], axis=-1)[..., 0]


def truncated_logprobs(scaled: jax.Array, targets: jax.Array, *, top_k: int,
                       top_p: float) -> tuple[jax.Array, jax.Array]:
    """The log-prob of each target under the top-k/top-p truncated, renormalised
    distribution of ``scaled``, the sampler's rule (:func:`filter_threshold`) applied to
    these logits: the trainer's side of ``loss.truncated_policy``.

    ``scaled`` [..., V] f32 temperature-scaled logits, ``targets`` [...] int -> (log-probs
    [...] f32, differentiable in ``scaled``; ``outside`` [...] bool). The kept set is
    chosen without gradient; the log-sum-exp over it carries one. For a target the sampler
    kept, at the same logits, this equals :func:`sample_tokens`' behaviour log-prob.

    A target outside these logits' kept set (``outside``: the sampler's logits differed,
    numerics or a staler policy, near the top-k/top-p boundary) joins it: its log-prob is
    renormalised over the kept set plus itself, finite and with its gradient, rather
    than -inf (whose ratio would be NaN). It is a little above the truncated policy's
    own (0 probability): the caller counts these tokens (``truncated_policy/outside_frac``).
    With neither filter on: the full ``log_softmax`` and no token outside."""
    picked = jnp.take_along_axis(scaled, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    threshold = filter_threshold(jax.lax.stop_gradient(scaled), top_k=top_k, top_p=top_p)
    if threshold is None:
        return picked - jax.nn.logsumexp(scaled, axis=-1), jnp.zeros(picked.shape, bool)
    outside = jax.lax.stop_gradient(picked) < threshold
    vocab = jnp.arange(scaled.shape[-1], dtype=jnp.int32)
    keep = (jax.lax.stop_gradient(scaled) >= threshold[..., None]) | (vocab == targets[..., None])
    return picked - jax.nn.logsumexp(jnp.where(keep, scaled, -jnp.inf), axis=-1), outside


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draw one token per row.

    Args:
      logits: [B, V] (any float dtype; computed in float32).
      keys: [B] keys (one per row, e.g. ``step_keys(row_keys(rng, B), t)``); unused when
        ``greedy``.
      temperature: divides the logits (> 0).
      top_k: keep the k most likely tokens; 0 (or >= V) = off.
      top_p: nucleus mass; 1.0 = off.
      greedy: take the argmax (filters are then irrelevant).

    Returns:
      tokens [B] int32, their log-probs [B] float32 under ``log_softmax(logits /
      temperature)`` over the full vocabulary, and their behaviour log-probs [B] float32
      under the filtered, renormalised distribution that drew them (see the module
      docstring): the *same array* as the full ones when no filter is on (and for
      ``greedy``, which is for evaluation: no behaviour policy to correct for).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.astype(jnp.float32) / jnp.float32(temperature)  # B V
    candidates = None
    if greedy:
        tokens = jnp.argmax(scaled, axis=-1)
    else:
        threshold = filter_threshold(scaled, top_k=top_k, top_p=top_p)
        candidates = scaled if threshold is None else jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
        # Gumbel-max: argmax(scaled + Gumbel noise) is a draw from softmax(scaled); the
        # noise comes from each row's own key.
        V = scaled.shape[-1]
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)  # B V
        tokens = jnp.argmax(candidates + noise, axis=-1)
    tokens = tokens.astype(jnp.int32)
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    logprobs = picked - jax.nn.logsumexp(scaled, axis=-1)
    if candidates is None or candidates is scaled:
        return tokens, logprobs, logprobs
    # The drawn token is a candidate, so `picked` is its filtered logit too; the
    # log-sum-exp runs over the kept tokens only (-inf elsewhere adds nothing).
    return tokens, logprobs, picked - jax.nn.logsumexp(candidates, axis=-1)


__all__ = ["SamplingParams", "filter_threshold", "filters", "sample_tokens", "step_keys", "truncated_logprobs"]
