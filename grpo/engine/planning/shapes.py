"""The abstract state a plan lowers the run's programs on: ``jax.ShapeDtypeStruct`` in
the shardings the run gives the real arrays (:mod:`grpo.engine.programs`), at the worst
case ``grpo run`` compiles (the largest prompt bucket, the widest packed micro-batch).

- :func:`abstract_opt_state`: the optimizer state of abstract parameters;
- :func:`abstract_rollout_inputs` / :func:`abstract_eval_inputs`: the prompts of one
  step's rollout and of one evaluation batch;
- :func:`abstract_update_batch`: one step's update batch, padded or packed.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp


def abstract_opt_state(programs: Any, params: Any) -> Any:
    """The optimizer state of ``programs`` (a :class:`~grpo.engine.programs.RunPrograms`)
    for abstract ``params``: shapes from ``jax.eval_shape`` of the optimizer's init,
    shardings matched to the parameter each leaf mirrors (the same path suffix and shape;
    f32 master copies and moments alike), the rest replicated."""
    shapes = jax.eval_shape(programs.optimizer_init, params)
    by_path: dict[tuple, Any] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        by_path[_path_key(path)] = leaf
    longest = max((len(k) for k in by_path), default=0)

    def place(path, leaf):
        key = _path_key(path)
        for n in range(min(longest, len(key)), 0, -1):
            match = by_path.get(key[-n:])
            if match is not None and tuple(match.shape) == tuple(leaf.shape):
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=match.sharding)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=programs.replicated)

    return jax.tree_util.tree_map_with_path(place, shapes)


def abstract_rollout_inputs(programs: Any) -> dict[str, Any]:
    """Abstract prefill inputs of one training step: [P, Lp] prompts at the largest
    prompt bucket (the worst case ``grpo run`` compiles)."""
    return _abstract_prompts(programs, programs.config.train.prompts_per_step)


def abstract_eval_inputs(programs: Any) -> dict[str, Any]:
    """Abstract prefill inputs of one evaluation batch: the padded
    :meth:`~grpo.engine.programs.RunPrograms.eval_batch` of prompts at the largest
    prompt bucket."""
    return _abstract_prompts(programs, programs.eval_batch()[1])


def _abstract_prompts(programs: Any, p: int) -> dict[str, Any]:
    from grpo.engine.rollout.prompts import default_buckets

    cfg = programs.config
    buckets = cfg.rollout.prompt_buckets or default_buckets(cfg.rollout.max_prompt_length)
    lp = max(buckets)
    tok = jax.ShapeDtypeStruct((p, lp), jnp.int32, sharding=programs.prompt_sharding((p, lp)))
    return {"prompt_tokens": tok, "prompt_mask": tok}


def abstract_update_batch(programs: Any, *, old_logprobs: bool = False, packed: bool | None = None,
                          per: int | None = None):
    """An abstract :class:`~grpo.engine.training.update.UpdateBatch` of one step, in the
    update's row sharding (the first PPO epoch has no old log-probs); with packing
    (``packed``, default: the run's) a :class:`~grpo.engine.training.packing.PackedBatch`
    in the scheduled layout at ``per`` bins per device per micro-batch
    (:meth:`~grpo.engine.programs.RunPrograms.scheduled_shape`; default: the widest, the
    most memory a step needs)."""
    if programs.packing if packed is None else packed:
        return _abstract_packed_batch(programs, old_logprobs=old_logprobs, per=per)
    from grpo.engine.rollout.prompts import default_buckets
    from grpo.engine.training.update import UpdateBatch

    cfg = programs.config
    buckets = cfg.rollout.prompt_buckets or default_buckets(cfg.rollout.max_prompt_length)
    b, lp, n = cfg.sequences_per_step, max(buckets), cfg.rollout.max_new_tokens
    sh = programs.train_sharding

    def arr(shape: Sequence[int], dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sh)

    return UpdateBatch(
        prompt_tokens=arr((b, lp), jnp.int32),
        prompt_mask=arr((b, lp), jnp.int32),
        tokens=arr((b, n), jnp.int32),
        mask=arr((b, n), jnp.int32),
        advantages=arr((b, n) if cfg.train.advantage.credit == "turn" else (b,), jnp.float32),
        old_logprobs=arr((b, n), jnp.float32) if old_logprobs else None,
        ref_logprobs=arr((b, n), jnp.float32) if cfg.loss.beta > 0 else None,
        sampler_logprobs=arr((b, n), jnp.float32) if cfg.loss.mismatch is not None else None,
        dropout_keys=arr((b, 2), jnp.uint32) if programs.lora_dropout else None,
        truncated=arr((b,), jnp.bool_) if cfg.loss.mask_truncated else None,
    )


def _abstract_packed_batch(programs: Any, *, old_logprobs: bool, per: int | None) -> Any:
    from grpo.engine.training.packing import PackedBatch

    cfg = programs.config
    shape = programs.scheduled_shape(per)
    sh = programs.bins_sharding
    i32 = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh)
    # The widest head layout (every slot of a device's bins): the most memory a step needs.
    d = programs.update_devices
    head = jax.ShapeDtypeStruct((shape[0], d, shape[1] // d * shape[2]), jnp.int32, sharding=sh)
    f32 = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh)
    return PackedBatch(
        tokens=i32, positions=i32, segment_ids=i32, targets=i32, mask=i32, trained=i32, advantages=f32,
        old_logprobs=f32 if old_logprobs else None,
        ref_logprobs=f32 if cfg.loss.beta > 0 else None,
        sampler_logprobs=f32 if cfg.loss.mismatch is not None else None,
        dropout_keys=jax.ShapeDtypeStruct(shape + (2,), jnp.uint32, sharding=sh) if programs.lora_dropout else None,
        normalizer=jax.ShapeDtypeStruct((), jnp.float32, sharding=programs.replicated),
        micro_batches=jax.ShapeDtypeStruct((), jnp.int32, sharding=programs.replicated),
        head_index=head, head_segments=head,
    )


def _path_key(path) -> tuple:
    out = []
    for p in path:
        for attr in ("key", "name", "idx"):
            if hasattr(p, attr):
                out.append(getattr(p, attr))
                break
        else:
            out.append(str(p))
    return tuple(out)


__all__ = ["abstract_eval_inputs", "abstract_opt_state", "abstract_rollout_inputs", "abstract_update_batch"]
