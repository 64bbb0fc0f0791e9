"""pluggy hook specifications: one collector hook per plugin kind.

Each hook receives a ``register`` callback; an implementation calls it once per plugin
object it provides::

    from grpo import hookimpl

    @hookimpl
    def register_mesh_policies(register):
        register(MyPolicy())

The hook names are public API. Specs only ever gain parameters; implementations
may accept a subset (pluggy passes only the arguments an implementation names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, TypeVar

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from grpo.core.contracts import (
        AttentionPlugin, LossPlugin, MeshPolicy, ModelPlugin, ObjectivePlugin, RolloutEnginePlugin, RolloutStyle,
        TaskPlugin,
    )

PROJECT = "grpo"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

P = TypeVar("P")
Register = Callable[[P], None]


@hookspec
def register_mesh_policies(register: "Register[MeshPolicy]") -> None:
    """Register mesh policies (topology -> dp/fsdp/tp layout), each under a unique name."""


@hookspec
def register_rollout_styles(register: "Register[RolloutStyle]") -> None:
    """Register rollout sharding styles (how the rollout batch lies on the mesh)."""


@hookspec
def register_losses(register: "Register[LossPlugin]") -> None:
    """Register GRPO loss implementations (hidden states + head weight in, loss out)."""


@hookspec
def register_objectives(register: "Register[ObjectivePlugin]") -> None:
    """Register policy-gradient objectives (per-token log-probs + advantages -> surrogate)."""


@hookspec
def register_tasks(register: "Register[TaskPlugin]") -> None:
    """Register tasks (data, prompts, reward functions, evaluation)."""


@hookspec
def register_models(register: "Register[ModelPlugin]") -> None:
    """Register model families (HF checkpoints of some ``model_type`` -> a Flax causal LM)."""


@hookspec
def register_attention(register: "Register[AttentionPlugin]") -> None:
    """Register attention kernels (whole-sequence causal attention: update, reference, prefill)."""


@hookspec
def register_rollout_engines(register: "Register[RolloutEnginePlugin]") -> None:
    """Register rollout engines (``rollout.engine``: weights + prompts + per-row keys in,
    rows with tokens and both log-probs out; see :class:`grpo.RolloutEnginePlugin`)."""
