"""Tool-call formats: how a model family writes a tool call in its turn, read back into
:class:`~grpo.core.contracts.ToolCall` s.

- ``qwen`` (Qwen2.5, Qwen3, and the tiny test model): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several per turn,
  anywhere in it; the text outside the calls is the turn's content. A rollout can stop
  decoding a turn at ``</tool_call>``.
- ``llama3`` (Llama 3.1 JSON tool calling): the whole turn is one JSON object
  ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is accepted too, as Llama's
  template renders a call back that way); anything else is a plain answer.

Parsing never raises: whatever the model wrote is either content, a call, or one error
sentence that the environment sends back to the model as a tool message.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from grpo.core.contracts import ParsedTurn, ToolCall, ToolCallFormat
from grpo.core.errors import UserError

_SHOWN = 80  # characters of a malformed call quoted back to the model


def _shorten(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _read_call(payload: str, argument_keys: tuple[str, ...]) -> ToolCall | str:
    """A call from its JSON text, or the sentence saying why it is not one."""
    try:
        obj: Any = json.loads(payload)
    except ValueError as err:
        return f"malformed tool call (invalid JSON: {err.msg}): {_shorten(payload)}"
    except RecursionError:  # "[[[[..." past the interpreter's recursion limit
        return f"malformed tool call (JSON nested too deeply to read): {_shorten(payload)}"
    if not isinstance(obj, dict):
        return f"malformed tool call (not a JSON object): {_shorten(payload)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"malformed tool call (no \"name\" string): {_shorten(payload)}"
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return f"malformed tool call to {name!r} (the {argument_keys[0]} are not a JSON object): {_shorten(payload)}"
    return ToolCall(name=name, arguments=arguments)


class QwenFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, whitespace-tolerant."""

    name: ClassVar[str] = "qwen"
    call_end: ClassVar[str] = "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[str] = []
        outside: list[str] = []
        last = 0
        for match in self._CALL.finditer(text):
            outside.append(text[last:match.start()])
            last = match.end()
            payload = match.group(1)
            if not match.group(2):
                errors.append(f"unterminated tool call (no </tool_call>): {_shorten(payload)}")
                continue
            call = _read_call(payload, ("arguments", "parameters"))
            (calls if isinstance(call, ToolCall) else errors).append(call)  # type: ignore[arg-type]
        outside.append(text[last:])
        return ParsedTurn(content="".join(outside).strip(), calls=tuple(calls), errors=tuple(errors))

    def render_call(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, "arguments": dict(call.arguments)}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"


class Llama3Format(ToolCallFormat):
    """Llama 3.1's JSON tool calling: the turn is ``{"name": ..., "parameters": {...}}``."""

    name: ClassVar[str] = "llama3"
    call_end: ClassVar[str] = ""

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return ParsedTurn(content=text.strip())
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            obj = None
        # A JSON object without a name is an answer that happens to be JSON, not a call.
        if isinstance(obj, dict) and "name" not in obj:
            return ParsedTurn(content=text.strip())
        call = _read_call(body, ("parameters", "arguments"))
        if isinstance(call, ToolCall):
            return ParsedTurn(content="", calls=(call,))
        return ParsedTurn(content="", errors=(call,))

    def render_call(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "parameters": dict(call.arguments)}, ensure_ascii=False)


FORMATS: dict[str, type[ToolCallFormat]] = {f.name: f for f in (QwenFormat, Llama3Format)}


def tool_call_format(name: str) -> ToolCallFormat:
    """The tool-call format called ``name`` (a :attr:`ModelPlugin.tool_call_format`)."""
    try:
        return FORMATS[name]()
    except KeyError:
        raise UserError(
            f"Unknown tool-call format {name!r}; the built-in formats are {', '.join(sorted(FORMATS))}."
        ) from None


__all__ = ["FORMATS", "Llama3Format", "QwenFormat", "tool_call_format"]
