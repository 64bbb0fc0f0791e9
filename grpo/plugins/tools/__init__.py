"""Tools for multi-turn rollouts: the built-in tool environment, the tool-call formats of
the model families, tool JSON schemas, and the built-in tools.

::

    from grpo.plugins.tools import ToolEnvironment, tool_call_format, builtin_tools

    env = ToolEnvironment(tools=builtin_tools(["calculator"], where="task.options.tools"),
                          format=tool_call_format("qwen"), opening=messages, timeout_s=10)
    messages = env.reset(example)          # the prompt
    step = env.step(model_turn_text)       # tool messages, or done

A task gets the environment by returning tools from ``TaskPlugin.tools``; the schemas
(``env.schemas``) reach the chat template's ``tools=`` argument. Import-light: nothing here
imports JAX; transformers is imported only to build schemas.
"""

from __future__ import annotations

from typing import Iterable

from grpo.core.contracts import ToolFn
from grpo.core.errors import UserError
from grpo.plugins.tools._calculator import calculator
from grpo.plugins.tools._environment import MAX_RESULT_CHARS, ToolEnvironment, run_steps
from grpo.plugins.tools._formats import FORMATS, Llama3Format, QwenFormat, tool_call_format
from grpo.plugins.tools._schema import tool_schema, tool_schemas

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


__all__ = [
    "BUILTIN_TOOLS",
    "FORMATS",
    "Llama3Format",
    "MAX_RESULT_CHARS",
    "QwenFormat",
    "ToolEnvironment",
    "builtin_tools",
    "calculator",
    "run_steps",
    "tool_call_format",
    "tool_schema",
    "tool_schemas",
]
