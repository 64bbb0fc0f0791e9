"""Built-in rollout engines (``rollout.engine``): ``static`` and ``continuous``.

Each registers a factory only: the samplers live in :mod:`grpo.engine.rollout` and are
imported when a run builds them (this module stays JAX-free). An engine outside grpo
(an adapter to vLLM, SGLang-JAX, ...) registers the same way from its own package; its
contract is :class:`grpo.RolloutEnginePlugin`'s.
"""

from __future__ import annotations

from typing import Any

from grpo.core.contracts import EngineContext, RolloutEnginePlugin
from grpo.core.hookspecs import hookimpl


class StaticEngine(RolloutEnginePlugin):
    name = "static"
    description = ("One batch of every row of the step, each holding a decode slot and a prompt + max_new_tokens "
                   "KV cache until the longest stops; multi-turn tasks too.")
    multi_turn = True
    quantized_weights = True
    records_routing = records_multi_turn_routing = True  # router replay, single- and multi-turn

    def build(self, context: EngineContext, options: Any) -> Any:
        from grpo.engine.rollout.multiturn import MultiTurnSampler
        from grpo.engine.rollout.sampler import Sampler

        r, kwargs = context.rollout, dict(context.sampler_kwargs)
        if context.multi_turn:
            engine = MultiTurnSampler(context.graphdef, sampling=context.sampling, max_turns=r.max_turns,
                                      conversations=context.conversations, max_turn_tokens=r.max_turn_tokens,
                                      **kwargs)
        else:
            engine = Sampler(context.graphdef, sampling=context.sampling, detokenize=context.detokenize, **kwargs)
        engine.prepare = context.prepare  # the run's weight preparation (reshard, LoRA merge)
        return engine


class ContinuousEngine(RolloutEnginePlugin):
    name = "continuous"
    description = ("Rows queue for rollout.continuous.slots decode slots over a paged KV cache, refilled at chunk "
                   "boundaries; the static engine's samples; multi-turn tasks too (a row leaves its slot at a tool "
                   "call and its next turn is appended into its own pages).")
    multi_turn = True
    streams = True
    quantized_weights = True
    quantized_kv = True
    records_routing = True  # router replay, single-turn rows (its multi-turn rows do not record yet)

    def build(self, context: EngineContext, options: Any) -> Any:
        from grpo.engine.rollout.continuous import ContinuousSampler
        from grpo.engine.rollout.continuous_multiturn import ContinuousMultiTurnSampler

        r = context.rollout
        c = r.continuous
        paged = dict(slots=c.slots, page_size=c.page_size, pool_pages=c.pool_pages, chunk=c.chunk,
                     backend=c.attention, **context.sampler_kwargs)
        if context.multi_turn:
            engine = ContinuousMultiTurnSampler(context.graphdef, sampling=context.sampling, max_turns=r.max_turns,
                                                conversations=context.conversations,
                                                max_turn_tokens=r.max_turn_tokens, **paged)
        else:
            engine = ContinuousSampler(context.graphdef, sampling=context.sampling, detokenize=context.detokenize,
                                       compile_ahead=context.compile_ahead, **paged)
        engine.prepare = context.prepare  # the run's weight preparation (reshard, LoRA merge)
        return engine


@hookimpl
def register_rollout_engines(register):
    register(StaticEngine())
    register(ContinuousEngine())
