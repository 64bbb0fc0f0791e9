"""Built-in GRPO losses: ``jax`` (the readable reference) and ``pallas`` (fused kernel).

Both compute the same objective (``grpo.plugins.losses._common``); they differ only in how
the per-token log-probs of the sampled tokens, and their gradients to the hidden states
and the output head, are computed:

- ``jax`` materialises the ``[B, T, V]`` logits and takes a log-softmax. Correct on any
  mesh: with the head weight sharded over the vocabulary (tp > 1), GSPMD partitions the
  matmul and adds the collectives for the log-sum-exp and the target gather.
- ``pallas`` fuses the head matmul into a blocked online log-sum-exp and recomputes the
  blocks in a custom VJP, so no ``[B, T, V]`` array ever exists. It refuses tp > 1 (its
  kernel needs the whole vocabulary on one device) at config validation.

Both support the packed layout (``supports_packing``, see
:class:`~grpo.core.contracts.LossPlugin`): log-probs are per token whatever the layout,
and the per-sequence math (``sequence_mean``, GSPO's ratio, the sequence-level mismatch
weight) reduces per segment in ``_common``.

This module stays JAX-free at import time: the implementations are imported inside
``compute``.
"""

from __future__ import annotations

from typing import Any, ContextManager, Literal

from pydantic import Field, field_validator

from grpo.core.contracts import LossPlugin, LossSettings, MeshLayout, PluginOptions
from grpo.core.hookspecs import hookimpl


def _common_inputs(**kw):
    from grpo.plugins.losses import _common

    _common.check_inputs(**kw)
    return _common


class JaxLossOptions(PluginOptions):
    entropy: bool = Field(True, description="Compute the mean token entropy metric (one more pass over the logits).")


class JaxLoss(LossPlugin):
    name = "jax"
    description = "Reference GRPO loss in plain JAX: materialises the [B, T, V] logits."
    Options = JaxLossOptions
    supports_packing = True  # per-sequence math is _common's, per segment
    supports_truncation = True  # loss.truncated_policy: top-k/top-p on its materialised logits

    def compute(self, *, hidden, head_weight, targets, mask, advantages, old_logprobs, ref_logprobs,
                settings: LossSettings, options: JaxLossOptions, normalizer=None,
                sampler_logprobs=None, segment_ids=None):  # type: ignore[override]
        from grpo.plugins.losses import _jax

        common = _common_inputs(hidden=hidden, head_weight=head_weight, targets=targets, mask=mask,
                                advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                                settings=settings, sampler_logprobs=sampler_logprobs, segment_ids=segment_ids)
        bonus = settings.entropy_coef > 0
        logits = _jax.head_logits(hidden=hidden, head_weight=head_weight, temperature=settings.temperature)
        logp, entropy, outside = _jax.logits_logprobs(logits, targets, top_k=settings.top_k, top_p=settings.top_p,
                                                      with_entropy=options.entropy or bonus, entropy_grad=bonus)
        loss, metrics = common.grpo_objective(
            logprobs=logp, mask=mask, advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
            settings=settings, normalizer=normalizer, entropy=entropy, sampler_logprobs=sampler_logprobs,
            segment_ids=segment_ids)
        if outside is not None:  # loss.truncated_policy: tokens outside the trainer's kept set
            metrics["truncated_policy/outside_frac"] = common.valid_mean(outside, mask)
        return loss, metrics


    def token_logprobs(self, *, hidden, head_weight, targets, settings: LossSettings,
                       options: JaxLossOptions, segment_ids=None):  # type: ignore[override]  # noqa: ARG002
        from grpo.plugins.losses import _jax

        logp, _ = _jax.token_logprobs(hidden=hidden, head_weight=head_weight, targets=targets,
                                      temperature=settings.temperature, with_entropy=False,
                                      top_k=settings.top_k, top_p=settings.top_p)
        return logp


class PallasLossOptions(PluginOptions):
    block_t: int | None = Field(
        None, ge=8, le=65536,
        description="Token rows per block (rows are the flattened B*T positions); a multiple of 8 "
        "(16 for bf16 on TPU). None: 256 on TPU/CPU, 64 on GPU.",
    )
    block_v: int | None = Field(
        None, ge=128, le=1 << 20,
        description="Vocabulary columns per block; a multiple of 128 (TPU lanes). None: 512 on TPU/CPU, 128 on GPU.",
    )
    block_d: int | None = Field(
        None, ge=16, le=65536,
        description="Hidden-size chunk of the in-kernel matmul loop (loop/GPU schedule only); a power of two. None: 64.",
    )
    schedule: Literal["auto", "grid", "loop"] = Field(
        "auto",
        description="grid: vocab/row reductions run over the Pallas grid with VMEM accumulators (TPU); "
        "loop: one program per block loops in-kernel (GPU Triton); auto: by backend. Both run in interpret mode.",
    )
    interpret: bool | None = Field(
        None, description="Run the kernels in Pallas interpret mode; None: on CPU only (the only way there)."
    )

    @field_validator("block_t")
    @classmethod
    def _bt(cls, v):
        if v is not None and v % 8:
            raise ValueError(f"block_t={v} must be a multiple of 8 (the TPU sublane tile)")
        return v

    @field_validator("block_v")
    @classmethod
    def _bv(cls, v):
        if v is not None and v % 128:
            raise ValueError(f"block_v={v} must be a multiple of 128 (the TPU lane tile)")
        return v

    @field_validator("block_d")
    @classmethod
    def _bd(cls, v):
        if v is not None and v & (v - 1):
            raise ValueError(f"block_d={v} must be a power of two (Triton tensor sizes)")
        return v


def _no_truncation(settings: LossSettings) -> None:
    """The fused kernel has no top-k/top-p: config validation refuses the combination;
    this stops a direct caller from getting full-vocabulary log-probs silently."""
    if settings.truncates:
        raise ValueError(f"loss.impl=pallas cannot compute truncated log-probs (settings.top_k={settings.top_k}, "
                         f"top_p={settings.top_p}, loss.truncated_policy): use loss.impl=jax")


class PallasLoss(LossPlugin):
    name = "pallas"
    description = "Fused head-matmul + online log-sum-exp GRPO loss in Pallas; never holds [B, T, V] logits."
    Options = PallasLossOptions
    per_shard = True  # XLA cannot split a Pallas call: run it per device on its own rows
    # The kernel computes per-token log-probs of flattened rows (any [B, T]); the
    # per-sequence math on top is _common's, per segment.
    supports_packing = True

    def check(self, *, layout: MeshLayout, options: PallasLossOptions) -> list[str]:  # type: ignore[override]
        if layout.tp > 1:
            return [
                f"loss.impl=pallas needs the whole vocabulary on each device, but the mesh has tp={layout.tp} "
                "(the head weight is sharded over the vocabulary). Use loss.impl=jax, or a mesh with tp=1."
            ]
        return []

    def compute(self, *, hidden, head_weight, targets, mask, advantages, old_logprobs, ref_logprobs,
                settings: LossSettings, options: PallasLossOptions, normalizer=None,
                sampler_logprobs=None, segment_ids=None):  # type: ignore[override]
        from grpo.plugins.losses import _pallas

        _no_truncation(settings)
        common = _common_inputs(hidden=hidden, head_weight=head_weight, targets=targets, mask=mask,
                                advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                                settings=settings, sampler_logprobs=sampler_logprobs, segment_ids=segment_ids)
        config = _pallas.resolve_config(options, dtype=hidden.dtype, hidden_size=hidden.shape[-1])
        logp, entropy = _pallas.fused_token_logprobs(hidden=hidden, head_weight=head_weight, targets=targets,
                                                     temperature=settings.temperature, config=config)
        return common.grpo_objective(logprobs=logp, mask=mask, advantages=advantages, old_logprobs=old_logprobs,
                                     ref_logprobs=ref_logprobs, settings=settings, normalizer=normalizer,
                                     entropy=entropy, sampler_logprobs=sampler_logprobs,
                                     segment_ids=segment_ids)

    def token_logprobs(self, *, hidden, head_weight, targets, settings: LossSettings,
                       options: PallasLossOptions, segment_ids=None):  # type: ignore[override]  # noqa: ARG002
        from grpo.plugins.losses import _pallas

        _no_truncation(settings)
        config = _pallas.resolve_config(options, dtype=hidden.dtype, hidden_size=hidden.shape[-1])
        logp, _ = _pallas.fused_token_logprobs(hidden=hidden, head_weight=head_weight, targets=targets,
                                               temperature=settings.temperature, config=config)
        return logp

    # ``grpo bench loss`` (engine code) reads these instead of the kernel module.

    def kernel_report(self, options: PallasLossOptions, *, dtype: Any, hidden_size: int) -> dict[str, Any]:
        """The kernel parameters ``options`` resolve to for hidden states of ``dtype`` and
        ``hidden_size`` on this backend."""
        from grpo.plugins.losses import _pallas

        cfg = _pallas.resolve_config(options, dtype=dtype, hidden_size=hidden_size)
        return {"block_t": cfg.block_t, "block_v": cfg.block_v, "block_d": cfg.block_d,
                "schedule": cfg.schedule, "interpret": cfg.interpret}

    def opaque_kernels(self) -> ContextManager[None]:
        """A context within which the kernels are opaque calls with the same operands (a
        compile-only memory measurement: they cannot run)."""
        from grpo.plugins.losses import _pallas

        return _pallas.opaque_kernels()


__all__ = ["JaxLoss", "JaxLossOptions", "PallasLoss", "PallasLossOptions"]


@hookimpl
def register_losses(register):
    register(JaxLoss())
    register(PallasLoss())
