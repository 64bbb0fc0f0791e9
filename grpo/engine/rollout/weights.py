"""The policy's weights as the rollout reads them.

Where the rollout runs (:func:`rollout_placement`: the training layout, or a rollout
style's own, the fastest that fits of its candidates), and the once-per-step state the
sampler reads for the trainable parameters (:func:`sampler_state`): the whole state as
is, LoRA merged into the projections (:func:`merge_program`), or copied into the
rollout's own layout, merged on the way (:func:`reshard_program`). The program builder
(:mod:`grpo.engine.programs`) caches the two programs by the names ``grpo plan`` lists
(``merge``, ``reshard``) and binds :func:`sampler_state` into its engines' weight
preparation (:meth:`~grpo.engine.programs.RunPrograms.prepare_weights`, an engine's
``prepare``): only an engine calls it, on the weights of its ``update_weights``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh

from grpo.core.config import RunConfig
from grpo.core.contracts import MeshLayout
from grpo.core.errors import UserError


def rollout_placement(
    config: RunConfig, style: Any, *, mesh: Mesh, layout: MeshLayout, arch: Any = None, topology: Any = None,
    state: Any = None, chip: Any = None,
) -> Any:
    """Where the rollout programs run for the rollout style ``style`` (a selected plugin):
    the training layout, or the style's own (the fastest that fits of its candidates)."""
    from grpo.core.contracts import ModelDims, Topology
    from grpo.engine.rollout.layout import RolloutPlacement, choose_layout, state_bytes

    batch_axes = tuple(style.plugin.batch_axes(layout, style.options))
    if arch is None:
        return RolloutPlacement.training(mesh, batch_axes)
    if topology is None:
        topology = Topology(process_count=1, local_device_count=layout.size)
    dims = ModelDims.of(arch)
    candidates = style.plugin.rollout_layouts(layout=layout, topology=topology, options=style.options, model=dims)
    if not candidates:
        return RolloutPlacement.training(mesh, batch_axes)
    rows = config.rollout_sequences_per_step
    if not any(rows % c.shards == 0 for c in candidates):
        raise UserError(
            f"rollout.style={config.rollout.style}: no layout it offers splits the {rows} sequences of a step "
            f"(train.prompts_per_step x rollout.num_generations); its layouts split the batch "
            + " or ".join(str(c.shards) for c in candidates) + " ways."
        )
    estimate: dict[str, Any] = {}
    if chip is not None and state is not None:
        from grpo.engine.rollout.prompts import default_buckets

        r = config.rollout
        lp = max(r.prompt_buckets or default_buckets(r.max_prompt_length))
        itemsize = 2 if config.model.compute_dtype == "bfloat16" else 4
        total = state_bytes(state)
        # Resident beside the rollout: the training state's shard per chip (parameters,
        # and with full fine-tuning an optimizer state of about two f32 moments each).
        per_chip = total / layout.size
        opt = 0.0 if config.model.lora is not None else per_chip * 8 / itemsize
        estimate = dict(cache_slots=lp + r.max_new_tokens, weight_bytes=total, compute_itemsize=itemsize,
                        resident_bytes=per_chip + opt)
    chosen, estimates = choose_layout(candidates, dims, rows=rows, chip=chip if estimate else None, **estimate)
    return RolloutPlacement.of_layout(mesh, chosen, estimates)


def sampler_state(params: Any, frozen: Any, *, resharded: bool, merging: bool,
                  reshard: Callable[[Any], Any], merge: Callable[[Any], Any]) -> Any:
    """What the sampler reads for trainable ``params`` and the ``frozen`` base.

    On the training layout: the whole state as is (no copy), or when ``merging`` (LoRA
    with ``model.lora.sampler: merged`` and a frozen base) a state whose targeted
    projections are ``W + (alpha / r) A @ B`` (one jitted merge, ``merge(state)``; a new
    array per projection, in the base's sharding). In a rollout style's own layout
    (``resharded``): one jitted program (``reshard(state)``) copies the state into it,
    merging on the way when ``merging``; the copy lives until the engine releases it
    (when the draw's decode is done: :meth:`grpo.RolloutEngine.release`). ``reshard``/``merge`` give the jitted program for the whole state (built
    once: the builder's cache)."""
    from grpo.models.lora import merge_params

    if resharded:
        state = merge_params(params, frozen)
        fn = reshard(state)
        return fn(params, frozen) if merging else fn(state)
    if not merging:
        return merge_params(params, frozen)
    return merge(merge_params(params, frozen))(params, frozen)


def merged(graphdef: Any) -> Callable[[Any, Any], Any]:
    """``fn(params, frozen)`` -> the sampler state with the LoRA adapters merged in."""
    from grpo.models.lora import merge_into_state

    def _merged(params: Any, frozen: Any) -> Any:
        return merge_into_state(graphdef, params, frozen)

    return _merged


def merge_program(graphdef: Any, state: Any) -> Any:
    """The jitted LoRA merge of ``model.lora.sampler: merged`` on the training layout:
    ``fn(params, frozen)`` -> the sampler state with the adapters merged in, each array in
    its sharding in ``state`` (the unmerged whole state, concrete or abstract)."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(merged(graphdef), out_shardings=shardings)


def reshard_program(placement: Any, graphdef: Any, state: Any, *, merging: bool) -> Any:
    """The jitted once-per-step reshard into the rollout layout of ``placement`` (a
    :class:`~grpo.engine.rollout.layout.RolloutPlacement`): ``fn(state)``, or
    ``fn(params, frozen)`` merging LoRA adapters on the way (``merging``). ``state``: the
    full sampler state (concrete or abstract), for its shardings."""
    return placement.reshard_jit(state, merged(graphdef) if merging else None)


__all__ = ["merge_program", "merged", "reshard_program", "rollout_placement", "sampler_state"]
