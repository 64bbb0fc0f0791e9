"""Tools for multi-turn rollouts: the built-in tool environment, the tool-call formats of
the model families, tool JSON schemas, and the built-in tools.

::

    from grpo.plugins.tools import ToolEnvironment, tool_call_format, builtin_tools

    env = ToolEnvironment(tools=builtin_tools(["calculator"], where="task.options.tools"),
                          format=tool_call_format("qwen"), opening=messages, timeout_s=10)
    messages = env.reset(example)          # the prompt
    step = env.step(model_turn_text)       # tool messages, or done

A task gets the environment by returning tools from ``TaskPlugin.tools``
(:func:`task_environment` is what the engine calls); the schemas
(``env.schemas``) reach the chat template's ``tools=`` argument. Import-light: nothing here
imports JAX; transformers is imported only to build schemas.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from grpo.core.contracts import Environment, TaskPlugin, ToolCallFormat, ToolFn
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


def task_environment(task: TaskPlugin, example: Mapping[str, Any], *, options: Any, tool_format: ToolCallFormat,
                     timeout_s: float = 10.0) -> Environment | None:
    """The environment of one rollout row: the task's own (``TaskPlugin.environment``), or
    for a task with tools and none of its own a :class:`ToolEnvironment` over them opening
    with the task's prompt; None: a single-turn task."""
    env = task.environment(example, options=options, tool_format=tool_format, timeout_s=timeout_s)
    if env is not None:
        return env
    tools = task.tools(options=options)
    if not tools:
        return None
    return ToolEnvironment(tools=tools, format=tool_format, opening=task.prompt_messages(example, options=options),
                           timeout_s=timeout_s)


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
    "task_environment",
    "tool_call_format",
    "tool_schema",
    "tool_schemas",
]
