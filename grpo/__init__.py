"""grpo: GRPO reinforcement-learning post-training of LLMs in JAX.

Everything a plugin author or a script needs is importable from here; a name listed in
``__all__`` is a promise (moving it keeps a shim that warns for one minor version).

**Every plugin**: ``hookimpl`` (register from a hook), ``PluginOptions`` / ``NoOptions``
(a plugin's ``Options``), ``UserError`` (a one-paragraph error, exit 2), and
``get_plugin(kind, name)`` (an installed plugin by kind and name, e.g. the built-in
engine or loss a plugin wraps).

**By kind** (the base classes document what each must provide)::

    from grpo import MeshPolicy, Topology, MeshLayout, MESH_AXES                 # mesh policies
    from grpo import RolloutStyle, RolloutLayout, ModelDims                      # rollout styles
    from grpo import LossPlugin, LossSettings, MismatchCorrection, sequence_sum  # losses
    from grpo import ObjectivePlugin                                             # objectives
    from grpo import TaskPlugin, RewardFn, Message, batched_reward               # tasks
    from grpo import ToolFn, ToolEnvironment, builtin_tools                      # tasks with tools
    from grpo import Environment, EnvStep                                        # a task's own environment
    from grpo import ToolCallFormat, ToolCall, ParsedTurn, tool_call_format      # tool-call formats
    from grpo import tool_schema, tool_schemas                                   # tools' JSON schemas
    from grpo import ModelPlugin, DecoderFamily, DecoderConfig                   # model families
    from grpo import AttentionPlugin, auto_attention, reference_attention        # attention kernels
    from grpo import RolloutEnginePlugin, EngineContext, RolloutEngine           # rollout engines
    from grpo import Rows, Progress, FinishedRows, RolloutOutput, Sampled        # the engine's records
    from grpo import NotPlanned                                                  # an engine grpo plan cannot cost
    from grpo import target_platform                                             # the platform compiled for

**The Python API** (:mod:`grpo.api`), for notebooks and scripts::

    result = grpo.train("configs/quickstart.yaml", overrides={"train.steps": 20})
    grpo.evaluate(result.run_dir); grpo.export(result.run_dir, "out/")

This module stays import-light (no JAX) so ``grpo --help`` and ``grpo plugins list``
start fast: the API, the tool environment, ``DecoderFamily``, ``DecoderConfig`` and
``reference_attention`` are imported on first use (``DecoderConfig`` and
``reference_attention`` import JAX then).
"""

from __future__ import annotations

import logging as _logging
from typing import Any


class _NoTorchNotice(_logging.Filter):
    """Drops transformers' import-time "PyTorch was not found..." notice: grpo is a JAX
    program that uses transformers for configs and tokenizers only. (Loading an export
    with transformers' PyTorch models is another program, which needs torch.) Added here,
    before anything grpo runs imports transformers; the notice is logged on the
    ``transformers`` logger itself, so nothing else is filtered."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


_logging.getLogger("transformers").addFilter(_NoTorchNotice())

# XLA:CPU's thread pool and flags, before JAX starts a backend: CPU numerics that do not
# depend on the machine, and no collective deadlock with several virtual CPU devices.
from grpo.core import cpu as _cpu  # noqa: E402

_cpu.configure()

from grpo.core.contracts import (
    MESH_AXES,
    AttentionPlugin,
    EngineContext,
    Environment,
    FinishedRows,
    EnvStep,
    LossPlugin,
    LossSettings,
    MeshLayout,
    MeshPolicy,
    Message,
    MismatchCorrection,
    ModelDims,
    ModelPlugin,
    NoOptions,
    NotPlanned,
    ObjectivePlugin,
    ParsedTurn,
    PluginOptions,
    Progress,
    RewardFn,
    RolloutEngine,
    RolloutEnginePlugin,
    RolloutLayout,
    RolloutOutput,
    RolloutStyle,
    Rows,
    Sampled,
    TaskPlugin,
    ToolCall,
    ToolCallFormat,
    ToolFn,
    Topology,
    auto_attention,
    batched_reward,
    sequence_sum,
    target_platform,
)
from grpo.core.errors import UserError
from grpo.core.hookspecs import hookimpl

__version__ = "0.2.0"

_API = ("RunResult", "evaluate", "export", "load_config", "train")
_TOOLS = ("ToolEnvironment", "tool_call_format", "tool_schema", "tool_schemas")


def get_plugin(kind: str, name: str) -> Any:
    """The installed plugin of ``kind`` called ``name`` (built-in or third-party), e.g.
    ``get_plugin("engine", "static")`` for a plugin that wraps a built-in one. ``kind`` is
    one of ``mesh``, ``rollout``, ``loss``, ``objective``, ``task``, ``model``,
    ``attention``, ``engine``; an unknown name is a :class:`UserError` listing the
    installed ones. Call it when the plugin is used (``build``, ``compute``), not while
    plugins register: the registry is complete only after every hook has run."""
    from grpo.core.contracts import PLUGIN_KINDS
    from grpo.core.plugins import get_plugins

    if kind not in PLUGIN_KINDS:
        raise UserError(f"Unknown plugin kind {kind!r}; the kinds are: {', '.join(PLUGIN_KINDS)}.")
    return get_plugins().get(kind, name)


def __getattr__(name: str) -> Any:
    # Imported when first looked up: the Python API imports the engine (JAX); the others
    # are light but live below the engine or in the models.
    if name in _API:
        from grpo import api

        return getattr(api, name)
    if name in _TOOLS:
        from grpo.engine.rollout import tools

        return getattr(tools, name)
    if name == "builtin_tools":
        from grpo.plugins.tools import builtin_tools

        return builtin_tools
    if name == "DecoderFamily":
        from grpo.models.families import DecoderFamily

        return DecoderFamily
    if name == "DecoderConfig":
        from grpo.models.decoder import DecoderConfig

        return DecoderConfig
    if name == "reference_attention":
        from grpo.kernels.attention import reference_attention

        return reference_attention
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")


__all__ = [
    "MESH_AXES",
    "AttentionPlugin",
    "DecoderConfig",
    "DecoderFamily",
    "EngineContext",
    "EnvStep",
    "Environment",
    "FinishedRows",
    "LossPlugin",
    "LossSettings",
    "MeshLayout",
    "MeshPolicy",
    "Message",
    "MismatchCorrection",
    "ModelDims",
    "ModelPlugin",
    "NoOptions",
    "ObjectivePlugin",
    "ParsedTurn",
    "PluginOptions",
    "RewardFn",
    "NotPlanned",
    "Progress",
    "RolloutEngine",
    "RolloutEnginePlugin",
    "RolloutOutput",
    "Rows",
    "Sampled",
    "RolloutLayout",
    "RolloutStyle",
    "RunResult",
    "TaskPlugin",
    "ToolCall",
    "ToolCallFormat",
    "ToolEnvironment",
    "ToolFn",
    "Topology",
    "UserError",
    "__version__",
    "auto_attention",
    "batched_reward",
    "builtin_tools",
    "evaluate",
    "export",
    "get_plugin",
    "hookimpl",
    "load_config",
    "reference_attention",
    "sequence_sum",
    "target_platform",
    "tool_call_format",
    "tool_schema",
    "tool_schemas",
    "train",
]
