"""Tool JSON schemas: the OpenAI/Hugging Face ``{"type": "function", "function": {...}}``
shape that ``tokenizer.apply_chat_template(tools=...)`` renders, built from a tool's
type hints and Google-style docstring by ``transformers.utils.get_json_schema``.

A tool the schema cannot describe (a parameter without a type hint, no docstring, a
parameter the ``Args:`` section does not describe) is a user error naming the tool and
where it came from, raised when the run starts rather than when the model first calls it.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Mapping

from grpo.core.contracts import ToolFn
from grpo.core.errors import UserError


# fn -> its schema: every rollout row builds an environment over the same tool functions,
# and parsing a docstring costs ~0.1 ms. Weak keys: a tool made per run (a closure over
# its table) is dropped with it. Callables that cannot be weakly referenced are not cached.
_SCHEMAS: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


def _described(fn: ToolFn, *, fresh: bool = True) -> dict[str, Any]:
    """``get_json_schema(fn)``, cached per function object; ``fresh``: a copy the caller
    may edit (otherwise the cached dict itself, read-only)."""
    from transformers.utils import get_json_schema

    try:
        schema = _SCHEMAS.get(fn)
    except TypeError:  # not weakly referenceable (a bound method, a builtin)
        return get_json_schema(fn)
    if schema is None:
        schema = get_json_schema(fn)
        _SCHEMAS[fn] = schema
    return copy.deepcopy(schema) if fresh else schema


def _schema(fn: ToolFn, name: str | None, where: str, fresh: bool) -> dict[str, Any]:
    label = name or getattr(fn, "__name__", repr(fn))
    if not callable(fn):
        raise UserError(f"{where}: tool {label!r} is not callable (got {type(fn).__name__}).")
    try:
        return _described(fn, fresh=fresh)
    except Exception as err:  # transformers' TypeHintParsingException / DocstringParsingException
        raise UserError(
            f"{where}: tool {label!r} cannot be described to the model: {err}. A tool needs a type hint on every "
            "parameter and a Google-style docstring: a first paragraph saying what it does and an 'Args:' section "
            "with a 'name: description' line per parameter."
        ) from None


def tool_schema(fn: ToolFn, *, name: str | None = None, where: str = "tools") -> dict[str, Any]:
    """The JSON schema of ``fn``, under ``name`` (default: the function's own name): parsed
    once per function object, a fresh copy on every call."""
    schema = _schema(fn, name, where, fresh=True)
    if name is not None:
        schema["function"]["name"] = name
    return schema


def tool_schemas(tools: Mapping[str, ToolFn], *, where: str = "tools") -> list[dict[str, Any]]:
    """The schemas of ``tools`` (name -> callable), in order: the chat template's ``tools=``."""
    return [tool_schema(fn, name=name, where=where) for name, fn in tools.items()]


def check_tools(tools: Mapping[str, ToolFn], *, where: str = "tools") -> None:
    """Raise what :func:`tool_schemas` would for a tool the template cannot describe, at
    the cost of a dict lookup for a tool described before (every rollout row checks its
    environment's tools)."""
    for name, fn in tools.items():
        _schema(fn, name, where, fresh=False)


__all__ = ["check_tools", "tool_schema", "tool_schemas"]
