"""grpo: GRPO reinforcement-learning post-training of LLMs in JAX.

The public surface for plugin authors is small::

    from grpo import hookimpl, MeshPolicy, RolloutStyle, LossPlugin, ObjectivePlugin, TaskPlugin, ModelPlugin

This module stays import-light (no JAX) so ``grpo --help`` and ``grpo plugins list``
start fast.
"""

from grpo.core.contracts import (
    AttentionPlugin,
    Environment,
    EnvStep,
    LossPlugin,
    LossSettings,
    MeshLayout,
    MeshPolicy,
    MismatchCorrection,
    ModelDims,
    ModelPlugin,
    NoOptions,
    ObjectivePlugin,
    ParsedTurn,
    PluginOptions,
    RolloutLayout,
    RolloutStyle,
    TaskPlugin,
    ToolCall,
    ToolCallFormat,
    Topology,
    sequence_sum,
)
from grpo.core.errors import UserError
from grpo.core.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "AttentionPlugin",
    "EnvStep",
    "Environment",
    "LossPlugin",
    "LossSettings",
    "MeshLayout",
    "MeshPolicy",
    "MismatchCorrection",
    "ModelDims",
    "ModelPlugin",
    "NoOptions",
    "ObjectivePlugin",
    "ParsedTurn",
    "PluginOptions",
    "RolloutLayout",
    "RolloutStyle",
    "TaskPlugin",
    "ToolCall",
    "ToolCallFormat",
    "Topology",
    "UserError",
    "__version__",
    "sequence_sum",
    "hookimpl",
]
