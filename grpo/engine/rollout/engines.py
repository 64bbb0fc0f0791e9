"""The run's rollout engine built through its plugin.

:func:`build_sampler` makes the sampling parameters of a run (or of its evaluation:
greedy, its own k), checks that the ``rollout.engine`` plugin
(:class:`grpo.RolloutEnginePlugin`) can sample the run's task, and has the plugin build
the sampler for the rollout's layout. The program builder (:mod:`grpo.engine.programs`)
caches one per ``(greedy, k)``.
"""

from __future__ import annotations

from typing import Any

import jax

from grpo.core.config import RunConfig
from grpo.core.errors import UserError


def _platform(placement: Any) -> str:
    """The platform of the rollout layout's devices (JAX's default backend without a mesh)."""
    mesh = getattr(placement, "mesh", None)
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def build_sampler(
    config: RunConfig,
    *,
    placement: Any,
    graphdef: Any,
    plugins: dict[str, Any] | None,
    eos_ids: tuple[int, ...],
    pad_id: int,
    multi_turn: bool,
    lora_adapters: bool,
    detokenize: Any = None,
    conversations: Any = None,
    greedy: bool = False,
    num_generations: int | None = None,
    prepare: Any = None,
) -> Any:
    """The rollout sampler (``grpo run``'s; evaluation asks for greedy / its own k),
    built by the ``rollout.engine`` plugin (:class:`grpo.RolloutEnginePlugin`) on the
    rollout layout ``placement`` (a :class:`~grpo.engine.rollout.layout.RolloutPlacement`):
    the built-in ``static`` engine gives
    :class:`~grpo.engine.rollout.multiturn.MultiTurnSampler` (``rollout.max_turns``
    turns) when the run is ``multi_turn``, else the single-turn
    :class:`~grpo.engine.rollout.sampler.Sampler`; ``continuous`` the
    :class:`~grpo.engine.rollout.continuous.ContinuousSampler`. All are called the same
    way (``sample``) and lower their own programs for the plan (``lowerings``).
    ``lora_adapters``: the sampler reads base + adapters (not a merged copy).
    ``prepare``: the run's weight preparation (trained params -> what the engine reads:
    :meth:`~grpo.engine.programs.RunPrograms.prepare_weights`), handed to the plugin in
    the :class:`grpo.EngineContext` and set as the built engine's
    :attr:`grpo.RolloutEngine.prepare` unless it has its own (an engine written before
    the contract, wrapped, gets it too)."""
    from grpo.core.contracts import EngineContext, as_engine
    from grpo.engine.rollout.sampler import SamplingParams

    r = config.rollout
    k = r.num_generations if num_generations is None else num_generations
    sampling = SamplingParams(
        max_new_tokens=r.max_new_tokens,
        num_generations=k,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        greedy=greedy,
        eos_ids=eos_ids,
        pad_id=pad_id,
        early_stop_chunk=r.early_stop_chunk,
    )
    ro = placement
    kwargs = dict(
        mesh=ro.mesh, batch_axes=ro.batch_axes,
        kv_segment=r.kv_segment, lora_adapters=lora_adapters,
        activation_rules=ro.activation_rules, cache_rules=ro.cache_rules,
    )
    q = r.quantization  # a low-precision rollout (the built-in samplers take these)
    if q.weights != "none":
        kwargs["weight_format"] = q.weights
    if q.head != "none":
        kwargs["head_format"] = q.head
    if q.kv_cache != "none":
        kwargs["kv_format"] = q.kv_cache
    plugin, options = engine_plugin(config, plugins)
    problems = plugin.check(multi_turn=multi_turn, options=options)
    if problems:
        raise UserError("The rollout engine cannot sample this run's task:", problems=problems)
    context = EngineContext(graphdef=graphdef, sampling=sampling, rollout=r, sampler_kwargs=kwargs,
                            detokenize=detokenize, conversations=conversations,
                            multi_turn=multi_turn, prepare=prepare,
                            compile_ahead=config.train.compile.decode_buckets_ahead(_platform(placement)))
    engine = as_engine(plugin.build(context, options), name=plugin.name)
    if engine.prepare is None:
        engine.prepare = prepare
    if config.model.moe.records and not greedy:
        if not getattr(engine, "records_routing", False):
            raise UserError(
                f"model.moe.router_replay={config.model.moe.router_replay}: the {plugin.name} engine"
                f"{' (multi-turn)' if multi_turn else ''} does not record routed experts; use rollout.engine: static "
                "or continuous with a single-turn task, or model.moe.router_replay: off")
        engine.record_routing = True
    return engine


def engine_plugin(config: RunConfig, plugins: dict[str, Any] | None) -> tuple[Any, Any]:
    """The ``rollout.engine`` plugin and its options (the selection's, else looked up)."""
    selected = (plugins or {}).get("engine")
    if selected is not None:
        return selected.plugin, selected.options
    from grpo.core.plugins import get_plugins

    plugin = get_plugins().get("engine", config.rollout.engine)
    return plugin, plugin.parse_options(config.rollout.engine_options)


__all__ = ["build_sampler", "engine_plugin"]
