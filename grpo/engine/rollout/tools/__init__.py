"""Tools in multi-turn rollouts: the tool environment and the threads its calls run on,
the tool-call formats of the model families, and tool JSON schemas.

- ``environment``: :class:`ToolEnvironment` (parse a turn's calls, run them with a
  timeout on reused daemon threads, answer with tool messages), :func:`run_steps` (many
  rows' environments stepped at once) and :func:`task_environment` (one rollout row's
  environment: the task's own, or a :class:`ToolEnvironment` over its tools).
- ``formats``: how a family writes a call (``qwen``, ``llama3``): :func:`tool_call_format`.
- ``schema``: a tool's JSON schema for the chat template's ``tools=``, parsed once per function.

::

    from grpo.engine.rollout.tools import ToolEnvironment, tool_call_format

    env = ToolEnvironment(tools={"calculator": calculator}, format=tool_call_format("qwen"),
                          opening=messages, timeout_s=10)
    messages = env.reset(example)          # the prompt
    step = env.step(model_turn_text)       # tool messages, or done

A task gets the environment by returning tools from ``TaskPlugin.tools``; the schemas
(``env.schemas``) reach the chat template's ``tools=`` argument. Import-light: nothing here
imports JAX; transformers is imported only to build schemas.
"""

from __future__ import annotations

from grpo.engine.rollout.tools.environment import MAX_RESULT_CHARS, ToolEnvironment, run_steps, task_environment
from grpo.engine.rollout.tools.formats import FORMATS, Llama3Format, QwenFormat, tool_call_format
from grpo.engine.rollout.tools.schema import tool_schema, tool_schemas

__all__ = [
    "FORMATS",
    "Llama3Format",
    "MAX_RESULT_CHARS",
    "QwenFormat",
    "ToolEnvironment",
    "run_steps",
    "task_environment",
    "tool_call_format",
    "tool_schema",
    "tool_schemas",
]
