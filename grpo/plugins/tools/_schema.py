"""Tool JSON schemas: the OpenAI/Hugging Face ``{"type": "function", "function": {...}}``
shape that ``tokenizer.apply_chat_template(tools=...)`` renders, built from a tool's
type hints and Google-style docstring by ``transformers.utils.get_json_schema``.

A tool the schema cannot describe (a parameter without a type hint, no docstring, a
parameter the ``Args:`` section does not describe) is a user error naming the tool and
where it came from, raised when the run starts rather than when the model first calls it.
"""

from __future__ import annotations

from typing import Any, Mapping

from grpo.core.contracts import ToolFn
from grpo.core.errors import UserError


def tool_schema(fn: ToolFn, *, name: str | None = None, where: str = "tools") -> dict[str, Any]:
    """The JSON schema of ``fn``, under ``name`` (default: the function's own name)."""
    from transformers.utils import get_json_schema

    label = name or getattr(fn, "__name__", repr(fn))
    if not callable(fn):
        raise UserError(f"{where}: tool {label!r} is not callable (got {type(fn).__name__}).")
    try:
        schema = get_json_schema(fn)
    except Exception as err:  # transformers' TypeHintParsingException / DocstringParsingException
        raise UserError(
            f"{where}: tool {label!r} cannot be described to the model: {err}. A tool needs a type hint on every "
            "parameter and a Google-style docstring: a first paragraph saying what it does and an 'Args:' section "
            "with a 'name: description' line per parameter."
        ) from None
    if name is not None:
        schema["function"]["name"] = name
    return schema


def tool_schemas(tools: Mapping[str, ToolFn], *, where: str = "tools") -> list[dict[str, Any]]:
    """The schemas of ``tools`` (name -> callable), in order: the chat template's ``tools=``."""
    return [tool_schema(fn, name=name, where=where) for name, fn in tools.items()]


__all__ = ["tool_schema", "tool_schemas"]
