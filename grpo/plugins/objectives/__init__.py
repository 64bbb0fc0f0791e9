"""Built-in policy-gradient objectives: ``ppo_clip`` (the default), ``gspo``, ``cispo``,
``sapo``. Chosen by ``loss.objective``, options in ``loss.objective_options``; every loss
implementation computes them through the shared per-token math
(:func:`grpo.plugins.losses._common.grpo_objective`), so the fused kernel needs nothing
new. All four take ``segment_ids`` (the packed layout); only GSPO, whose ratio is per
sequence, uses it. Definitions, gradients and sources: :mod:`grpo.plugins.objectives._math`.

This module stays JAX-free at import time: the math is imported inside ``per_token``.
"""

from __future__ import annotations

from pydantic import Field

from grpo.core.contracts import LossSettings, ObjectivePlugin, PluginOptions
from grpo.core.hookspecs import hookimpl


class PpoClip(ObjectivePlugin):
    name = "ppo_clip"
    description = "PPO/GRPO clipped surrogate min(r A, clip(r, 1-eps_low, 1+eps_high) A) per token."

    def per_token(self, *, logprobs, log_ratio, valid, advantages, settings: LossSettings, options,  # noqa: ARG002
                  segment_ids=None):
        from grpo.plugins.objectives import _math

        return _math.ppo_clip(log_ratio=log_ratio, advantages=advantages,
                              eps_low=settings.epsilon_low, eps_high=settings.epsilon_high)


class Gspo(ObjectivePlugin):
    name = "gspo"
    description = "GSPO: the sequence's geometric-mean ratio, clipped per sequence (token form, gspo-token)."

    def per_token(self, *, logprobs, log_ratio, valid, advantages, settings: LossSettings, options,  # noqa: ARG002
                  segment_ids=None):
        from grpo.plugins.objectives import _math

        return _math.gspo(logprobs=logprobs, log_ratio=log_ratio, valid=valid, advantages=advantages,
                          eps_low=settings.epsilon_low, eps_high=settings.epsilon_high, segment_ids=segment_ids)


class Cispo(ObjectivePlugin):
    name = "cispo"
    description = "CISPO (MiniMax-M1): sg(clip(r)) A log p, a clipped importance weight that keeps every gradient."

    def per_token(self, *, logprobs, log_ratio, valid, advantages, settings: LossSettings, options,  # noqa: ARG002
                  segment_ids=None):
        from grpo.plugins.objectives import _math

        return _math.cispo(logprobs=logprobs, log_ratio=log_ratio, advantages=advantages,
                           eps_low=settings.epsilon_low, eps_high=settings.epsilon_high)


class SapoOptions(PluginOptions):
    tau_pos: float = Field(1.0, gt=0.0, le=1e3, description="Gate temperature for positive advantages (TRL: 1.0).")
    tau_neg: float = Field(1.05, gt=0.0, le=1e3, description="Gate temperature for other advantages (TRL: 1.05).")


class Sapo(ObjectivePlugin):
    name = "sapo"
    description = "SAPO: soft sigmoid gate sigmoid(tau (r - 1)) 4/tau A instead of a hard clip (TRL's sapo)."
    Options = SapoOptions

    def per_token(self, *, logprobs, log_ratio, valid, advantages, settings: LossSettings,  # noqa: ARG002
                  options: SapoOptions, segment_ids=None):
        from grpo.plugins.objectives import _math

        return _math.sapo(log_ratio=log_ratio, advantages=advantages, tau_pos=options.tau_pos, tau_neg=options.tau_neg)


__all__ = ["Cispo", "Gspo", "PpoClip", "Sapo", "SapoOptions"]


@hookimpl
def register_objectives(register):
    for plugin in (PpoClip(), Gspo(), Cispo(), Sapo()):
        register(plugin)
