"""The bytes a plan counts per device: of a state tree in its shardings, of the state that
stays resident between a step's programs (:func:`state_bytes`), of LoRA's merged
projections, and ``model.lora`` as resolved for the model (:func:`lora_report`).
"""

from __future__ import annotations

import math
from typing import Any

from grpo.core.config import RunConfig


def bytes_per_device(tree: Any) -> int:
    import jax

    from grpo.models import quant

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += (math.prod(shape) * quant.bits_per_element(leaf.dtype) + 7) // 8
    return total


def merged_projection_bytes(full: Any) -> int:
    """Per-device bytes of the LoRA-targeted projections (what a merged copy holds)."""
    from flax import nnx

    from grpo.models.lora import LORA_COLLECTION

    targets = {path[1].removesuffix("_a") for path, _ in nnx.to_flat_state(full)
               if path[0] == LORA_COLLECTION and str(path[1]).endswith("_a")}
    return sum(bytes_per_device(var.get_value()) for path, var in nnx.to_flat_state(full)
               if path[0] == "layers" and path[1] in targets)


def quantization_scales(tree: Any) -> dict[str, int]:
    """``projection -> elements`` of a QLoRA base's block scales (``layers.<proj>_scale``)
    in ``tree``: what the model actually quantized."""
    import jax

    out: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        for k in path:
            name = str(getattr(k, "key", ""))
            if name.endswith("_scale"):
                out[name[: -len("_scale")]] = out.get(name[: -len("_scale")], 0) + math.prod(leaf.shape)
    return out


def lora_report(config: RunConfig, arch: Any, params: Any, frozen: Any) -> dict[str, Any] | None:
    """``model.lora`` as resolved for ``arch`` and what it holds per device (None without)."""
    lora = config.model.lora
    if lora is None:
        return None
    from grpo.models.lora import resolve_spec

    resolved = resolve_spec(arch, lora)
    scales = quantization_scales(frozen)
    return {
        "rank": resolved.rank,
        "alpha": resolved.alpha,
        "targets": list(resolved.targets),
        "base_quantization": lora.base_quantization,
        # nf4/int8 quantize every projection of the base, targeted or not.
        "quantized": list(scales),
        "quantization_block": lora.quantization_block,
        "quantization_scales": sum(scales.values()),
        # Per device, as state_bytes_per_device counts them (uint4 codes at 4 bits).
        "adapter_bytes": bytes_per_device(params),
        "base_bytes": bytes_per_device(frozen),
    }


def state_bytes(config: RunConfig, programs: Any, *, full: Any, opt_state: Any, frozen: Any,
                rollout_state: Any) -> dict[str, int]:
    """Per-device bytes of the state that stays resident between programs (and of the
    rollout's own copies, which live while the rollout programs run)."""
    state = {
        "parameters": bytes_per_device(full),
        "optimizer_state": bytes_per_device(opt_state),
        # Full fine-tuning keeps a frozen copy; LoRA's reference is the base itself.
        "reference_parameters": bytes_per_device(full) if config.loss.beta > 0 and frozen is None else 0,
    }
    # model.lora.sampler=merged: the rollout reads a merged copy of every targeted
    # projection, made once per step and dropped before the update; the programs take
    # the merged state, and the base's own projections stay resident beside it.
    state["merged_projections"] = (
        merged_projection_bytes(full) if programs.merged_sampling and not programs.rollout.resharded else 0)
    # A rollout in its own layout reads a copy of the policy made once per step
    # (merged on the way with model.lora.sampler=merged), dropped before the update.
    state["rollout_parameters"] = bytes_per_device(rollout_state) if rollout_state is not None else 0
    return state


__all__ = ["bytes_per_device", "lora_report", "merged_projection_bytes", "quantization_scales", "state_bytes"]
