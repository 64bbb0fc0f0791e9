"""The rollout style contract: how the rollout programs lie on the devices, in the
training layout or a :class:`RolloutLayout` of their own."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Mapping

from pydantic import BaseModel

from grpo.core.contracts.base import _PluginBase
from grpo.core.contracts.mesh import MeshLayout, Topology


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The sizes of the policy a rollout layout must divide (no JAX, no weights)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_hidden_layers: int

    @classmethod
    def of(cls, config: Any) -> "ModelDims":
        """From a model family's config (any object with these attributes)."""
        return cls(**{f.name: int(getattr(config, f.name)) for f in dataclasses.fields(cls)})


Rules = Mapping[str, "str | tuple[str, ...] | None"]


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """The layout the rollout programs (prefill, decode) run in, when it is not training's.

    - ``mesh``: sizes of the rollout mesh's (dp, fsdp, tp) axes. Its devices are the
      training mesh's, in the same order, reshaped: no device is added or dropped, and a
      run's arrays on either mesh can meet in one program.
    - ``param_rules``: logical parameter axis -> rollout mesh axes (like
      :data:`grpo.sharding.PARAM_RULES`). The engine reshards the policy into them once
      per step, before prefill, and frees the copy after decode.
    - ``activation_rules``: logical activation axis -> rollout mesh axes, ``batch``
      included (like :data:`grpo.sharding.ACTIVATION_RULES`).
    - ``cache_rules``: logical axes of the KV cache (``layers``, ``batch``,
      ``cache_length``, ``kv_heads``, ``head_dim``) -> rollout mesh axes; None: the
      activation rules.
    - ``batch_axes``: the rollout mesh axes the rollout batch is sharded over.
    - ``tensor_parallel``: how many ways heads, MLP and vocabulary are split (for reports).

    A dimension that does not divide over its mesh axes is replicated (e.g. 2 KV heads
    on tp=8), as everywhere in grpo.
    """

    mesh: MeshLayout
    param_rules: Rules
    activation_rules: Rules
    batch_axes: tuple[str, ...]
    cache_rules: "Rules | None" = None
    tensor_parallel: int = 1

    @property
    def shards(self) -> int:
        """How many ways the rollout batch is split."""
        return self.mesh.axis_size(self.batch_axes)

    def describe(self) -> dict[str, Any]:
        return {"mesh": self.mesh.shape, "tensor_parallel": self.tensor_parallel,
                "batch_axes": list(self.batch_axes)}


class RolloutStyle(_PluginBase):
    """How the rollout programs lie on the devices.

    ``batch_axes`` names the training-mesh axes the batch dimension of prompts/completions
    is sharded over when the rollout runs in the training layout; every other mesh axis
    replicates it.

    ``rollout_layouts`` may instead give the rollout its own layout
    (:class:`RolloutLayout`): the parameters are resharded into it once per step and
    decode reads them there. Empty (the default): the rollout runs on the training
    layout, the parameters as they are (with FSDP, XLA gathers each layer's weights for
    every generated token). Several: candidates; the engine runs the fastest that fits
    by its roofline for the chip (any valid one where it has no chip figures, e.g. CPU).
    Raise :class:`grpo.UserError` naming the option when none can be built for this
    model and topology.
    """

    @abc.abstractmethod
    def batch_axes(self, layout: MeshLayout, options: BaseModel) -> tuple[str, ...]: ...

    def check(self, *, layout: MeshLayout, topology: Topology, options: BaseModel) -> list[str]:
        """Problems with this layout, one sentence each (empty: fine)."""
        return []

    def rollout_shards(self, *, layout: MeshLayout, topology: Topology, options: BaseModel) -> int:
        """How many ways the rollout batch is split, known before the model is (config
        validation checks the batch divides). Default: the size of ``batch_axes``."""
        return layout.axis_size(self.batch_axes(layout, options))

    def rollout_layouts(
        self, *, layout: MeshLayout, topology: Topology, options: BaseModel, model: ModelDims
    ) -> tuple[RolloutLayout, ...]:
        """The rollout's own layout(s); empty: the training layout (see the class doc)."""
        return ()
