"""The rollout engine contract: what turns a step's prompts and the current weights into rows."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping

from pydantic import BaseModel

from grpo.core.contracts.base import _PluginBase


@dataclasses.dataclass(frozen=True)
class EngineContext:
    """What the program builder hands a rollout engine's :meth:`RolloutEnginePlugin.build`.

    - ``graphdef``: the policy's ``nnx.split`` graph (JAX engines merge it with the
      weights each :meth:`sample` call receives);
    - ``sampling``: a :class:`grpo.engine.rollout.sampler.SamplingParams` (cap, K,
      temperature, top-k/top-p, greedy, stop and pad ids);
    - ``rollout``: the run's ``rollout`` config section (the built-in engines' options
      live there, e.g. ``rollout.continuous``);
    - ``sampler_kwargs``: the keywords of :class:`grpo.engine.rollout.sampler.BaseSampler`
      for the run's rollout layout (mesh, batch axes, sharding rules, kv_segment, LoRA);
    - ``detokenize``: ``(tokens [b, N], mask [b, N]) -> texts`` of the run's tokenizer;
    - ``conversations``: a multi-turn task's conversations (None when single-turn);
    - ``multi_turn``: whether the task rolls out conversations (tools or an environment).
    """

    graphdef: Any
    sampling: Any
    rollout: Any
    sampler_kwargs: Mapping[str, Any]
    detokenize: Any = None
    conversations: Any = None
    multi_turn: bool = False


class RolloutEnginePlugin(_PluginBase):
    """A rollout engine (``rollout.engine``; options in ``rollout.engine_options``): what
    turns a step's prompts and the current weights into rows.

    :meth:`build` returns the run's sampler: an object with the one rollout interface the
    trainer and the evaluator call::

        sampled = sampler.sample(params, prompt_tokens, prompt_mask, rng, examples)

    - **New weights**: ``params`` is the policy's sampler state of this step
      (``RunPrograms.sampler_state``: the rollout layout's parameters, LoRA merged or
      not); an engine with its own copy (an external server) pushes them when they
      change, i.e. once per step, before its first row.
    - **Rows with per-row keys**: ``prompt_tokens``/``prompt_mask`` [P, Lp] int32 (padded
      either side), K = ``sampling.num_generations`` rows per prompt, row ``b*K + j``.
      Row ``r`` must draw step ``t`` from ``fold_in(fold_in(rng, r), t)``
      (:func:`grpo.engine.rollout._sampling.row_keys` / ``step_keys``) or, for an external
      engine, from a seed derived from ``fold_in(rng, r)``: samples then depend on the
      row alone, never on batching or slots, and a resumed run redraws them.
    - **Tokens and both log-probs**: a :class:`grpo.engine.rollout.sampler.Sampled`
      whose ``output`` is a ``RolloutOutput`` of global arrays, rows sharded over the
      rollout's batch axes: ``tokens``/``mask`` [B, N] (the stop token included, mask 1;
      ``pad_id`` and mask 0 after it), ``lengths`` [B], ``truncated`` [B] (no stop token
      by the cap), ``logprobs`` [B, N] float32 ``log_softmax(logits / temperature)`` over
      the full vocabulary (what the trainer's loss computes, so the mismatch metrics
      measure numerics) and ``behaviour_logprobs`` [B, N] under the distribution that drew
      the token (top-k/top-p truncated and renormalised; None without a filter); ``texts``
      of this process's rows and its ``examples``.

    ``grpo plan`` also asks the sampler for its programs: ``jitted()`` (name -> jitted
    functions a run executes), ``lowerings(params, *, prompts, prompt_length, key)``
    (name -> a zero-argument lowering), ``cache_slots(prompt_length)``,
    ``cache_bytes(params, *, rows, prompt_length)`` and ``abstract_output(*, prompts,
    prompt_length)``; :class:`grpo.engine.rollout.sampler.BaseSampler` implements them
    for a JAX engine, and an engine outside JAX returns empty programs and 0 bytes.
    ``build`` imports the engine's code itself (plugins stay importable without JAX).
    """

    multi_turn: ClassVar[bool] = False  # samples multi-turn tasks (tools, environments)

    def check(self, *, multi_turn: bool, options: BaseModel) -> list[str]:
        """Problems running this engine on a task (one sentence each); the default
        refuses a multi-turn task unless :attr:`multi_turn`."""
        if multi_turn and not self.multi_turn:
            return [f"rollout.engine={self.name!r} samples single-turn tasks only; this run's task has tools or an "
                    "environment: use rollout.engine: static"]
        return []

    @abc.abstractmethod
    def build(self, context: EngineContext, options: BaseModel) -> Any: ...
