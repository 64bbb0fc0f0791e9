"""The built-in tools, which a built-in task offers its model by name (``gsm8k``'s
``task.options.tools: [calculator]``).

::

    from grpo.plugins.tools import builtin_tools

    tools = builtin_tools(["calculator"], where="task.options.tools")   # name -> callable

The tool environment that runs them, the tool-call formats and the schemas are the
engine's (:mod:`grpo.engine.rollout.tools`; ``from grpo import ToolEnvironment,
tool_call_format``). Their old names here (``grpo.plugins.tools.ToolEnvironment``, ...)
still resolve, with a :class:`DeprecationWarning`, until grpo 0.3. Import-light: nothing
here imports JAX.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

from grpo.core.contracts import ToolFn
from grpo.core.errors import UserError
from grpo.plugins.tools._calculator import calculator

BUILTIN_TOOLS: dict[str, ToolFn] = {"calculator": calculator}


def builtin_tools(names: Iterable[str], *, where: str = "tools") -> dict[str, ToolFn]:
    """The built-in tools called ``names`` (name -> callable), checked: an unknown name is
    a :class:`grpo.UserError` naming ``where`` and listing the built-in tools."""
    out: dict[str, ToolFn] = {}
    for name in names:
        if name not in BUILTIN_TOOLS:
            raise UserError(f"{where}: unknown tool {name!r}; the built-in tools are: {', '.join(sorted(BUILTIN_TOOLS))}.")
        out[name] = BUILTIN_TOOLS[name]
    return out


# Moved in 0.2 to grpo.engine.rollout.tools: name -> the import that replaces it. The old
# path warns and forwards for one minor version.
_MOVED = {
    "ToolEnvironment": "from grpo import ToolEnvironment",
    "tool_call_format": "from grpo import tool_call_format",
    "tool_schema": "from grpo import tool_schema",
    "tool_schemas": "from grpo import tool_schemas",
    "FORMATS": "from grpo.engine.rollout.tools import FORMATS",
    "Llama3Format": "from grpo.engine.rollout.tools import Llama3Format",
    "QwenFormat": "from grpo.engine.rollout.tools import QwenFormat",
    "MAX_RESULT_CHARS": "from grpo.engine.rollout.tools import MAX_RESULT_CHARS",
    "run_steps": "from grpo.engine.rollout.tools import run_steps",
    "task_environment": "from grpo.engine.rollout.tools import task_environment",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(f"grpo.plugins.tools.{name} is deprecated and goes in grpo 0.3: use `{_MOVED[name]}`.",
                      DeprecationWarning, stacklevel=2)
        from grpo.engine.rollout import tools

        return getattr(tools, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILTIN_TOOLS",
    "builtin_tools",
    "calculator",
]
