"""The plugin contracts: what a mesh policy, rollout style, loss, task or model family must provide.

Every plugin is a small object with

- ``name``: unique within its kind, lower-case (``[a-z][a-z0-9_.-]*``);
- ``Options``: a pydantic model with ``extra="forbid"``. The core validates the config
  section of the chosen plugin against it, so a typo fails at load time with its path;
- ``description``: one line for ``grpo plugins list``;
- its behaviour (the abstract methods of its kind's base class).

One module per kind: :mod:`~grpo.core.contracts.mesh`, :mod:`~grpo.core.contracts.rollout`,
:mod:`~grpo.core.contracts.loss`, :mod:`~grpo.core.contracts.objective`,
:mod:`~grpo.core.contracts.task` (with :mod:`~grpo.core.contracts.tools`: tool calls and
environments), :mod:`~grpo.core.contracts.model`, :mod:`~grpo.core.contracts.attention`,
:mod:`~grpo.core.contracts.engine`; :mod:`~grpo.core.contracts.base` holds what they
share and :mod:`~grpo.core.contracts.platform` the compile target. Everything is
importable from here.

This package is import-light: no JAX. Loss and task behaviour receives JAX arrays, but
implementations import JAX inside their methods or private modules.
"""

from __future__ import annotations

from grpo.core.contracts.attention import ATTENTION_PLATFORMS, AUTO_ATTENTION, AttentionPlugin, auto_attention
from grpo.core.contracts.base import NoOptions, PluginOptions, _PluginBase
from grpo.core.contracts.engine import (
    EngineContext,
    FinishedRows,
    NotPlanned,
    Progress,
    RolloutEngine,
    RolloutEnginePlugin,
    RolloutOutput,
    Rows,
    Sampled,
    as_engine,
)
from grpo.core.contracts.loss import (
    Aggregation,
    LossPlugin,
    LossSettings,
    MismatchCorrection,
    MismatchLevel,
    MismatchMode,
    sequence_sum,
)
from grpo.core.contracts.mesh import EXPERT_AXIS, MESH_AXES, MeshLayout, MeshPolicy, Topology
from grpo.core.contracts.model import ModelPlugin
from grpo.core.contracts.objective import ObjectivePlugin
from grpo.core.contracts.platform import _TARGET_PLATFORM, compiling_for, target_platform
from grpo.core.contracts.rollout import ModelDims, RolloutLayout, RolloutStyle, Rules
from grpo.core.contracts.task import RewardFn, TaskPlugin, batched_reward, reward_batch
from grpo.core.contracts.tools import EnvStep, Environment, Message, ParsedTurn, ToolCall, ToolCallFormat, ToolFn

PLUGIN_KINDS: dict[str, tuple[str, type[_PluginBase]]] = {
    "mesh": ("register_mesh_policies", MeshPolicy),
    "rollout": ("register_rollout_styles", RolloutStyle),
    "loss": ("register_losses", LossPlugin),
    "objective": ("register_objectives", ObjectivePlugin),
    "task": ("register_tasks", TaskPlugin),
    "model": ("register_models", ModelPlugin),
    "attention": ("register_attention", AttentionPlugin),
    "engine": ("register_rollout_engines", RolloutEnginePlugin),
}
"""kind -> (hook name, base class). The order is the order of ``grpo plugins list``."""

__all__ = [
    "ATTENTION_PLATFORMS",
    "AUTO_ATTENTION",
    "EXPERT_AXIS",
    "MESH_AXES",
    "PLUGIN_KINDS",
    "Aggregation",
    "AttentionPlugin",
    "EngineContext",
    "EnvStep",
    "Environment",
    "LossPlugin",
    "LossSettings",
    "Message",
    "MeshLayout",
    "MeshPolicy",
    "MismatchCorrection",
    "MismatchLevel",
    "MismatchMode",
    "ModelDims",
    "ModelPlugin",
    "NoOptions",
    "ObjectivePlugin",
    "ParsedTurn",
    "PluginOptions",
    "RewardFn",
    "FinishedRows",
    "NotPlanned",
    "Progress",
    "RolloutEngine",
    "RolloutEnginePlugin",
    "RolloutOutput",
    "Rows",
    "Sampled",
    "as_engine",
    "RolloutLayout",
    "RolloutStyle",
    "Rules",
    "TaskPlugin",
    "Topology",
    "ToolCall",
    "ToolCallFormat",
    "ToolFn",
    "auto_attention",
    "batched_reward",
    "compiling_for",
    "reward_batch",
    "sequence_sum",
    "target_platform",
]
