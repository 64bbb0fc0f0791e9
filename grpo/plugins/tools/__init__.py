"""The built-in tools, which a built-in task offers its model by name (``gsm8k``'s
``task.options.tools: [calculator]``).

::

    from grpo.plugins.tools import builtin_tools

    tools = builtin_tools(["calculator"], where="task.options.tools")   # name -> callable

The tool environment that runs them, the tool-call formats and the schemas are the
engine's (:mod:`grpo.engine.rollout.tools`). Import-light: nothing here imports JAX.
"""

from __future__ import annotations

from typing import Iterable

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


__all__ = [
    "BUILTIN_TOOLS",
    "builtin_tools",
    "calculator",
]
