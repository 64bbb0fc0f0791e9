"""Built-in rollout styles: ``legacy``, ``maxtext`` (the training layout) and ``serving``.

``legacy`` and ``maxtext`` decode on the training layout: the parameters stay FSDP-sharded
while sampling, so XLA all-gathers every layer's weights (and the embedding/head) for
*every generated token*. Compiled for a v6e-8, Qwen2.5-3B's decode loop gathers ~5.8 GB
per chip per token that way (``grpo plan`` reports it as ``collective_bytes_per_step``).
They are kept exactly as they were, so runs compared against the seed project reproduce.

``serving`` gives the rollout its own layout over the same devices: the policy is
resharded once per step (before prefill) into a tensor-parallel layout, decoded there and
the copy dropped; per token only activations cross the interconnect (two all-reduces of
``[rows, hidden]`` per layer, and ``[rows]``-sized reductions to sample from a
vocabulary-sharded head). Query heads, MLP and vocabulary split ``tensor_parallel`` ways;
KV heads (and so the KV cache) split ``gcd(tensor_parallel, KV heads)`` ways, each
chip's query heads beside their KV head.
"""

from __future__ import annotations

import math
from typing import Literal, Union

from pydantic import Field, field_validator

from grpo.core.contracts import (
    MeshLayout,
    ModelDims,
    NoOptions,
    PluginOptions,
    RolloutLayout,
    RolloutStyle,
    Topology,
)
from grpo.core.errors import UserError
from grpo.core.hookspecs import hookimpl


class LegacyStyle(RolloutStyle):
    name = "legacy"
    description = (
        "Rollout batch sharded over dp x fsdp x tp on the training layout (weights gathered per token)."
    )
    Options = NoOptions

    def batch_axes(self, layout: MeshLayout, options: NoOptions) -> tuple[str, ...]:
        return layout.axis_names  # dp, fsdp(, ep), tp


class MaxTextStyle(RolloutStyle):
    name = "maxtext"
    description = (
        "Rollout batch sharded over dp only on the training layout (weights gathered per token); "
        "needs dp == process count."
    )
    Options = NoOptions

    def batch_axes(self, layout: MeshLayout, options: NoOptions) -> tuple[str, ...]:
        return ("dp",)

    def check(self, *, layout: MeshLayout, topology: Topology, options: NoOptions) -> list[str]:
        if layout.dp != topology.process_count:
            return [
                f"rollout.style=maxtext shards the rollout batch over dp only and needs dp == "
                f"process count; the mesh has dp={layout.dp} with {topology.process_count} "
                "process(es). Use mesh.policy=host_local, or rollout.style=legacy."
            ]
        return []


# The serving layout's tensor parallelism of size T spans two mesh axes: ``tp`` of size
# k = gcd(T, KV heads) and ``fsdp`` of size T / k (tp-major). Query heads, MLP and
# vocabulary split over both (T ways); KV heads (and the KV cache) over ``tp`` only, so
# each chip's query heads find their KV head on the same chip, and a model with fewer KV
# heads than T (Qwen2.5-3B has 2) keeps its cache split k ways instead of replicated.
# Nothing is FSDP-sharded: the ``embed`` dimension is whole on every chip; LoRA's rank
# axis too.
_SPLIT = ("tp", "fsdp")

SERVING_PARAM_RULES: dict[str, str | tuple[str, ...] | None] = {
    "embed": None,
    "vocab": _SPLIT,
    "heads": _SPLIT,
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": _SPLIT,
    "layers": None,
    "norm": None,
    "lora_rank": None,
    # Mixture-of-experts: the experts over the expert axis (a serving mesh has one when the
    # training mesh does), each expert's hidden width split like the MLP's.
    "experts": "ep",
    "expert_mlp": _SPLIT,
    "router_experts": None,
}

SERVING_ACTIVATION_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("dp",),
    "length": None,
    "embed": None,
    "heads": _SPLIT,
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": _SPLIT,
    "vocab": _SPLIT,
    "cache_length": None,
    "layers": None,
}


class ServingOptions(PluginOptions):
    tensor_parallel: Union[Literal["auto"], int] = Field(
        "auto",
        description=(
            "How many ways the rollout splits attention heads, MLP and vocabulary (the batch "
            "takes the remaining devices); 1 replicates the weights. auto: the fastest that "
            "fits by the roofline of the chip (the smallest valid one where there are no chip "
            "figures, e.g. CPU). Must divide the devices of one host and the attention heads."
        ),
    )

    @field_validator("tensor_parallel")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be an integer >= 1 or 'auto', got {v}")
        return v


class ServingStyle(RolloutStyle):
    name = "serving"
    description = (
        "Rollout in its own tensor-parallel serving layout: weights resharded once per step, "
        "no weight all-gather per token (options: tensor_parallel auto|N)."
    )
    Options = ServingOptions

    def batch_axes(self, layout: MeshLayout, options: ServingOptions) -> tuple[str, ...]:
        # On the training mesh (what legacy uses); the serving layout has its own.
        return layout.axis_names

    @staticmethod
    def _per_host(topology: Topology, layout: MeshLayout) -> int:
        return topology.local_device_count if topology.process_count > 1 else layout.size

    def check(self, *, layout: MeshLayout, topology: Topology, options: ServingOptions) -> list[str]:
        tp = options.tensor_parallel
        if tp == "auto":
            return []
        n, per_host = layout.size, self._per_host(topology, layout)
        if n % tp:
            return [f"rollout.options.tensor_parallel={tp} does not divide the {n} devices"]
        if per_host % tp:
            return [
                f"rollout.options.tensor_parallel={tp} would span hosts: tensor parallelism stays "
                f"within one host's {per_host} devices (its ICI), so it must divide {per_host}"
            ]
        return []

    def rollout_shards(self, *, layout: MeshLayout, topology: Topology, options: ServingOptions) -> int:
        tp = options.tensor_parallel
        if tp == "auto":
            # The fewest shards auto can pick (tp = a whole host): what every candidate divides.
            tp = self._per_host(topology, layout)
        return max(1, layout.size // tp)

    def rollout_layouts(
        self, *, layout: MeshLayout, topology: Topology, options: ServingOptions, model: ModelDims
    ) -> tuple[RolloutLayout, ...]:
        n, per_host = layout.size, self._per_host(topology, layout)
        heads, ep = model.num_attention_heads, layout.ep
        if options.tensor_parallel == "auto":
            sizes = [t for t in range(1, per_host + 1)
                     if per_host % t == 0 and n % (t * ep) == 0 and heads % t == 0]
        else:
            problems = self.check(layout=layout, topology=topology, options=options)
            if problems:
                raise UserError(problems[0] + ".")
            tp = options.tensor_parallel
            if heads % tp:
                raise UserError(
                    f"rollout.options.tensor_parallel={tp} does not divide the model's {heads} attention "
                    f"heads; valid values here: "
                    + ", ".join(str(t) for t in range(1, per_host + 1) if per_host % t == 0 and heads % t == 0)
                    + "."
                )
            if n % (tp * ep):
                raise UserError(
                    f"rollout.options.tensor_parallel={tp} x mesh.expert_parallel={ep} does not divide the "
                    f"{n} devices: the serving layout splits its batch over dp x ep."
                )
            sizes = [tp]
        return tuple(serving_layout(n, t, kv_heads=model.num_key_value_heads, ep=ep) for t in sizes)


def serving_layout(devices: int, tp: int, *, kv_heads: int | None = None, ep: int = 1) -> RolloutLayout:
    """The serving layout of ``devices`` devices with tensor parallelism ``tp``: the mesh
    ``(dp, fsdp, tp) = (devices / tp, tp / k, k)`` with ``k = gcd(tp, kv_heads)`` (see
    :data:`SERVING_PARAM_RULES`; ``kv_heads`` None: k = tp). With expert parallelism
    ``ep`` > 1 the batch part splits into ``dp = devices / (tp ep)`` and the expert axis
    ``ep``: the batch is over (dp, ep), the experts over ep."""
    k = tp if kv_heads is None else math.gcd(tp, kv_heads)
    return RolloutLayout(
        mesh=MeshLayout(dp=devices // (tp * ep), fsdp=tp // k, tp=k, ep=ep),
        param_rules=SERVING_PARAM_RULES,
        activation_rules=SERVING_ACTIVATION_RULES,
        batch_axes=("dp", "ep") if ep > 1 else ("dp",),
        tensor_parallel=tp,
    )


@hookimpl
def register_rollout_styles(register):
    register(LegacyStyle())
    register(MaxTextStyle())
    register(ServingStyle())
