"""The loss contract: the settings every loss shares, the mismatch correction, the loss
plugin (dense or packed layout) and :func:`sequence_sum`, its per-sequence reduction.

Import-light: JAX is imported inside the functions that compute.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel

from grpo.core.contracts.base import _PluginBase
from grpo.core.contracts.mesh import MeshLayout

if TYPE_CHECKING:  # pragma: no cover
    import jax

Aggregation = Literal["token_mean", "sequence_mean", "constant"]


MismatchLevel = Literal["token", "sequence"]
MismatchMode = Literal["truncate", "mask"]


@dataclasses.dataclass(frozen=True)
class MismatchCorrection:
    """Importance weighting of the policy term by how far the trainer's pre-update
    log-probs (``old``) are from the sampler's behaviour log-probs: the two disagree
    through numerics (bf16 decode, a different kernel) even at identical weights, and
    through top-k/top-p, which make the policy that drew the tokens the truncated
    distribution renormalised over its kept tokens (its log-prob is the full one minus the
    log of the kept mass, unless ``LossSettings.top_k``/``top_p`` put the trainer's
    log-probs under the same truncation); the loss's ratio assumes the samples came from ``old``.

    The weight is ``w = exp(old - sampler)`` per token at ``level="token"``, and
    ``exp(sum over the row's valid tokens of (old - sampler))`` per row at
    ``level="sequence"`` (the sequence's likelihood ratio). ``mode="truncate"`` multiplies
    the policy term by ``min(w, cap)`` (truncated importance sampling); ``mode="mask"``
    by ``1 if w <= cap else 0`` (the token or the whole sequence is dropped). No gradient
    flows through the weight; the KL and entropy terms are not weighted.
    """

    level: MismatchLevel = "token"
    mode: MismatchMode = "truncate"
    cap: float = 2.0


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Loss settings shared by every implementation (hashable: a static jit argument).

    - ``epsilon_low``/``epsilon_high``: the ratio is clipped to [1-eps_low, 1+eps_high].
    - ``beta``: weight of the k3 KL estimate to the reference policy; 0 disables it and
      the reference log-probs are never needed.
    - ``temperature``: divides the logits before the log-softmax (the sampler's too).
    - ``entropy_coef``: weight of an entropy bonus: ``- entropy_coef * H`` is added to each
      valid token's loss (``H`` the entropy of the full next-token distribution at the
      temperature), aggregated like the policy term; 0 disables it.
    - ``aggregation``: ``token_mean`` (sum over valid tokens / valid-token count),
      ``sequence_mean`` (mean over sequences of each sequence's token mean), ``constant``
      (sum over valid tokens / (sequences * ``max_completion_length``), Dr.GRPO).
    - ``objective``: the name of the registered :class:`ObjectivePlugin` that turns log-probs
      and advantages into the per-token surrogate (``ppo_clip``, ``gspo``, ``cispo``,
      ``sapo``, ...); ``objective_options`` its options as sorted ``(name, value)`` pairs
      (a tuple, so the settings stay hashable).
    - ``mismatch``: the sampler/trainer mismatch correction (:class:`MismatchCorrection`),
      or None: off, and the sampler's behaviour log-probs are unused.
    - ``top_k``/``top_p``: the truncation the trainer's log-probs are under
      (``loss.truncated_policy`` with a truncating rollout; 0 / 1.0 = none, the full
      vocabulary): every per-token log-prob of the policy (old, current, reference) is
      the token's under ``logits / temperature`` restricted to the tokens the sampler's
      top-k/top-p rule keeps *at these logits* and renormalised over them, so it compares
      with the sampler's behaviour log-prob (a token outside that kept set joins it; see
      :func:`grpo.engine.rollout._sampling.truncated_logprobs`). Only a plugin with
      ``supports_truncation`` computes it.
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    temperature: float = 1.0
    aggregation: Aggregation = "token_mean"
    entropy_coef: float = 0.0
    max_completion_length: int = 1
    objective: str = "ppo_clip"
    objective_options: tuple[tuple[str, Any], ...] = ()
    mismatch: MismatchCorrection | None = None
    top_k: int = 0
    top_p: float = 1.0

    @property
    def truncates(self) -> bool:
        """Whether the trainer's log-probs are under a top-k/top-p truncation."""
        return self.top_k > 0 or self.top_p < 1.0

    def normalizer(self, mask: "jax.Array", segment_ids: "jax.Array | None" = None) -> "jax.Array":
        """The aggregation's denominator for the batch whose completion mask is ``mask``
        [B, T]: valid tokens (at least 1), sequences, or sequences * ``max_completion_length``.
        Computed once for the global batch, it makes micro-batch losses sum exactly.
        Sequences are the rows, or with ``segment_ids`` [B, T] (the packed layout, see
        :class:`LossPlugin`) the segments: ids are numbered 1, 2, ... in each bin, so a
        bin's largest id is its sequence count."""
        import jax.numpy as jnp

        if segment_ids is None:
            rows = mask.shape[0]
        else:
            rows = jnp.sum(jnp.max(segment_ids, axis=1)).astype(jnp.float32)
        if self.aggregation == "token_mean":
            return jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)
        if self.aggregation == "sequence_mean":
            return jnp.float32(rows)
        if self.aggregation == "constant":
            return jnp.float32(rows * self.max_completion_length)
        raise ValueError(f"unknown aggregation {self.aggregation!r}")


class LossPlugin(_PluginBase):
    """A GRPO policy-gradient loss that fuses (or not) the output-head matmul.

    ``compute`` is jittable and keyword-only. Shapes: ``hidden`` [B, T, D] (final hidden
    states, already normed), ``head_weight`` [D, V], ``targets`` [B, T] int (the token
    each position predicts), ``mask`` [B, T] (1 on completion tokens that count),
    ``advantages`` [B] (one per row), or [B, T] (one per token: turn-level credit,
    ``train.advantage.credit: turn``), ``old_logprobs`` [B, T] or None (on-policy: the ratio is
    exp(logp - stop_gradient(logp))), ``ref_logprobs`` [B, T] or None (needed iff
    ``settings.beta > 0``), ``sampler_logprobs`` [B, T] (the behaviour policy's log-probs
    from the sampler: under the distribution that drew each token, top-k/top-p truncated
    and renormalised at the temperature — the full-vocabulary ``log_softmax`` when no filter
    is on; passed only when ``settings.mismatch`` is set, so an implementation without the
    mismatch correction may leave the parameter out).

    ``normalizer`` makes gradient accumulation exact: the trainer passes the value for the
    *global* batch (valid-token count for ``token_mean``, sequence count for
    ``sequence_mean``, sequences * max length for ``constant``) so that summing the
    micro-batch losses gives the full-batch loss. None: computed from this batch.

    Returns ``(loss, metrics)``. ``metrics`` holds scalars averaged over this call's valid
    tokens — ``clip_frac/low``, ``clip_frac/high``, ``ratio/mean``, ``kl`` (0 when beta
    is 0), optionally ``approx_kl``, ``entropy``, ``mismatch/*`` and the objective's own
    (``gspo/*``, ``cispo/*``, ...); keys ending in ``/min`` or ``/max`` are the extreme
    over the valid tokens instead of the mean — plus ``num_tokens``
    (valid-token count, to weight micro-batches) and ``logprobs`` [B, T] (per-token
    log-probs, no gradient).

    ``token_logprobs`` gives the per-token log-probs alone (the reference pass when
    ``beta > 0``); the default runs ``compute`` with zero advantages and keeps its
    ``logprobs``, and an implementation overrides it with its forward-only path. Both
    take the head weight in the compute dtype (the dtype of ``hidden``): the engine casts
    it, so every path does the head matmul at one precision.

    **Packed layout** (``train.packing``; only for a plugin with ``supports_packing =
    True``). The step's sequences (prompt + completion, padding dropped) are packed into
    ``B`` bins of ``T`` tokens, several sequences per bin, each contiguous and never split.
    The keyword arguments are the same, every per-token array [bins, T] and already
    aligned (``hidden[:, t]`` predicts ``targets[:, t]``), plus ``segment_ids`` [bins, T]
    int32: the tokens of one sequence share an id unique within its bin (1, 2, ... in
    bin order), 0 marks bin padding. ``mask`` is 1 only on the tokens the loss trains
    (never on prompts, a multi-turn environment's tokens or bin padding), and
    ``advantages`` is always per token [bins, T] (0 on padding). ``segment_ids`` is None
    (or, for ``compute``, not passed at all) in the unpacked layout, where each row is one
    sequence. A row-wise quantity — a per-sequence mean (``sequence_mean``), a sequence
    ratio (GSPO), a sequence-level importance weight — must then reduce over the tokens
    of equal (bin, segment id) instead of over the row: :func:`sequence_sum` does exactly
    that in either layout. The engine always passes ``normalizer`` (of the global batch:
    its valid tokens, sequences, sequences * max length), so a packed loss equals the
    padded one; per-token terms (the ratio, KL, entropy) need nothing new. A plugin
    without ``supports_packing`` is never given ``segment_ids``: the engine runs it on
    the unpacked layout. The update and the log-prob passes call it on the *head layout*,
    a narrower packed layout of the same contract: each row holds, in order, only the
    slots that predict a completion token of a device's bins in a micro-batch (so no
    logits are computed for prompts), its sequences renumbered 1, 2, ..., 0 (and mask 0)
    past the row's count; a sequence's slots stay contiguous and never span two rows.
    """

    supports_packing: ClassVar[bool] = False
    """True when ``compute`` and ``token_logprobs`` take ``segment_ids`` and reduce each
    per-sequence quantity per (bin, segment id) (see the packed layout above). False (the
    default, a loss written before packing): the engine never packs its batches."""

    per_shard: ClassVar[bool] = False
    """True for implementations XLA cannot partition (e.g. a Pallas kernel): the engine
    then calls ``compute`` inside ``shard_map`` over the batch's data-parallel axes, on each
    device's rows with the head weight gathered, and combines the results (the loss is
    summed; metrics are weighted by ``num_tokens``). False: ``compute`` sees global arrays
    and XLA's SPMD partitioner shards it."""

    supports_truncation: ClassVar[bool] = False
    """True when ``compute`` and ``token_logprobs`` honour ``settings.top_k``/``top_p``
    (the truncated policy, ``loss.truncated_policy``) and report the metric
    ``truncated_policy/outside_frac`` (the share of valid tokens outside the trainer's
    kept set). False (the default, and the fused ``pallas`` kernel): config validation
    refuses ``loss.truncated_policy: true`` with a truncating rollout for this plugin."""

    @abc.abstractmethod
    def compute(
        self,
        *,
        hidden: "jax.Array",
        head_weight: "jax.Array",
        targets: "jax.Array",
        mask: "jax.Array",
        advantages: "jax.Array",
        old_logprobs: "jax.Array | None",
        ref_logprobs: "jax.Array | None",
        settings: LossSettings,
        options: BaseModel,
        normalizer: "jax.Array | float | None" = None,
        sampler_logprobs: "jax.Array | None" = None,
        segment_ids: "jax.Array | None" = None,
    ) -> tuple["jax.Array", dict[str, "jax.Array"]]: ...

    def token_logprobs(
        self, *, hidden: "jax.Array", head_weight: "jax.Array", targets: "jax.Array",
        settings: LossSettings, options: BaseModel, segment_ids: "jax.Array | None" = None,
    ) -> "jax.Array":
        """Per-token log-probs [B, T] (f32, temperature applied) of ``targets``; a
        log-prob is per token, so ``segment_ids`` (packed layout) changes nothing here."""
        import jax.numpy as jnp

        b, t = targets.shape
        _, metrics = self.compute(
            hidden=hidden, head_weight=head_weight, targets=targets, mask=jnp.ones((b, t), jnp.int32),
            advantages=jnp.zeros((b,), jnp.float32), old_logprobs=None, ref_logprobs=None,
            settings=dataclasses.replace(settings, beta=0.0, mismatch=None), options=options,
        )
        return metrics["logprobs"]

    def check(self, *, layout: MeshLayout, options: BaseModel) -> list[str]:
        """Problems with running on this layout (e.g. tp > 1 unsupported)."""
        return []



def sequence_sum(values: "jax.Array", *, segment_ids: "jax.Array | None" = None) -> "jax.Array":
    """Each token's sum of ``values`` over its sequence: the per-sequence reduction of the
    loss contract, in either layout.

    ``values`` [B, T]. Unpacked (``segment_ids`` None): the row sum, [B, 1]. Packed
    (``segment_ids`` [bins, T], 1, 2, ... per sequence in each bin, 0 for bin padding):
    [bins, T], each token holding the sum over the tokens of equal (bin, segment id) (bin
    padding sums with bin padding: mask it). Both broadcast against [B, T]. Memory is
    O(bins * T): a segment sum over ids offset per bin, never a [bins, T, segments]
    one-hot. A per-sequence mean is ``sequence_sum(x * m) / max(sequence_sum(m), 1)``."""
    import jax
    import jax.numpy as jnp

    if segment_ids is None:
        return jnp.sum(values, axis=1, keepdims=True)  # B 1
    b, t = values.shape
    # Ids are in [0, T] (at most T sequences in a bin): bin i's ids sit at i*(T+1) + id.
    flat = (segment_ids.astype(jnp.int32) + (t + 1) * jnp.arange(b, dtype=jnp.int32)[:, None]).reshape(-1)  # B*T
    sums = jax.ops.segment_sum(values.reshape(-1), flat, num_segments=b * (t + 1))  # B*(T+1)
    return sums[flat].reshape(b, t)  # B T
