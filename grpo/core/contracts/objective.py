"""The objective contract: each token's contribution to the policy-gradient surrogate,
shared by every loss implementation."""

from __future__ import annotations

import abc
import inspect
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from grpo.core.contracts.base import _PluginBase
from grpo.core.contracts.loss import LossSettings

if TYPE_CHECKING:  # pragma: no cover
    import jax


class ObjectivePlugin(_PluginBase):
    """The policy-gradient objective: what each token contributes to the surrogate that
    the loss maximises, given its log-prob under the policy being trained and under the
    pre-update policy. Chosen by ``loss.objective`` (options in ``loss.objective_options``)
    and carried to every loss implementation as ``LossSettings.objective``, so the
    implementations (the plain-JAX one, the fused kernel) share it: a kernel computes the
    per-token log-probs and their VJP, the objective is elementwise and row-wise JAX on
    top of them.

    :meth:`per_token` is pure and jittable. Shapes: ``logprobs`` [B, T] f32 (carries the
    gradient), ``log_ratio`` [B, T] = ``logprobs - old`` on valid tokens and 0 elsewhere
    (``old`` is ``stop_gradient(logprobs)`` on-policy), ``valid`` [B, T] bool,
    ``advantages`` [B, 1] f32 (or [B, T] with turn-level credit: write the math so that
    it broadcasts). It returns ``(objective, metrics)``: the per-token objective
    [B, T] (maximised: the loss adds ``-objective``, weighted by the mismatch correction
    and aggregated like every other term; padding positions are ignored) and
    ``metrics``, name -> [B, T] per-token values that the loss reduces over the valid
    tokens: the mean, or the minimum / maximum for names ending in ``/min`` / ``/max``.
    Every objective reports ``clip_frac/low`` and ``clip_frac/high`` (0 where nothing is
    clipped) so runs of different objectives log the same columns.

    Packed layout (see :class:`LossPlugin`): ``per_token`` may take a keyword argument
    ``segment_ids`` [bins, T] int32 (None: unpacked, each row one sequence); the arrays are
    then [bins, T], ``advantages`` per token, and anything per sequence (GSPO's ratio)
    must reduce with :func:`sequence_sum`, not over the row. An objective whose
    ``per_token`` has no ``segment_ids`` parameter is called without it
    (:meth:`call_per_token`) and is correct only unpacked, unless it is purely per token:
    :attr:`supports_packing` says which, for the engine to decide.
    """

    @abc.abstractmethod
    def per_token(
        self,
        *,
        logprobs: "jax.Array",
        log_ratio: "jax.Array",
        valid: "jax.Array",
        advantages: "jax.Array",
        settings: LossSettings,
        options: BaseModel,
        segment_ids: "jax.Array | None" = None,
    ) -> tuple["jax.Array", dict[str, "jax.Array"]]: ...

    @property
    def supports_packing(self) -> bool:
        """Whether :meth:`per_token` takes ``segment_ids`` (by its signature; ``**kwargs``
        counts), i.e. computes its per-sequence quantities per segment."""
        params = inspect.signature(self.per_token).parameters
        return "segment_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def call_per_token(self, *, segment_ids: "jax.Array | None" = None, **kwargs: Any):
        """:meth:`per_token` with ``segment_ids`` passed only when packed and accepted, so
        objectives written before packing keep working on the unpacked layout."""
        if segment_ids is not None and self.supports_packing:
            return self.per_token(**kwargs, segment_ids=segment_ids)
        return self.per_token(**kwargs)
