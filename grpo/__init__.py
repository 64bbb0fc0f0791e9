"""grpo: GRPO reinforcement-learning post-training of LLMs in JAX.

The public surface for plugin authors is small::

    from grpo import hookimpl, MeshPolicy, RolloutStyle, LossPlugin, ObjectivePlugin, TaskPlugin, ModelPlugin

and for notebooks and scripts, the Python API (:mod:`grpo.api`)::

    result = grpo.train("configs/quickstart.yaml", overrides={"train.steps": 20})
    grpo.evaluate(result.run_dir); grpo.export(result.run_dir, "out/")

This module stays import-light (no JAX) so ``grpo --help`` and ``grpo plugins list``
start fast: the API is imported on first use.
"""

from grpo.core.contracts import (
    AttentionPlugin,
    EngineContext,
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
    RolloutEnginePlugin,
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

_API = ("RunResult", "evaluate", "export", "load_config", "train")


def __getattr__(name: str):
    # The Python API imports the engine (JAX) when a function is first looked up.
    if name in _API:
        from grpo import api

        return getattr(api, name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")


__all__ = [
    "AttentionPlugin",
    "EngineContext",
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
    "RolloutEnginePlugin",
    "RolloutLayout",
    "RolloutStyle",
    "RunResult",
    "TaskPlugin",
    "ToolCall",
    "ToolCallFormat",
    "Topology",
    "UserError",
    "__version__",
    "evaluate",
    "export",
    "sequence_sum",
    "hookimpl",
    "load_config",
    "train",
]
