"""Tools and environments of multi-turn rollouts: chat messages, tool calls, how a
model family writes them, and the environment a conversation runs against."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Mapping, Sequence

Message = dict[str, Any]
"""A chat message: ``{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}``
(what ``tokenizer.apply_chat_template`` takes)."""

ToolFn = Callable[..., Any]
"""A tool: a Python callable with type hints on every parameter and a docstring (its first
paragraph is the tool's description; ``name: description`` lines under ``Args:`` describe
the parameters). Its JSON schema reaches the chat template's ``tools=`` argument."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One tool call read from a model turn: the tool's name and its keyword arguments."""

    name: str
    arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A model turn as a :class:`ToolCallFormat` reads it.

    - ``content``: the turn's text outside the tool calls (stripped);
    - ``calls``: the well-formed tool calls, in order;
    - ``errors``: one sentence per malformed call (bad JSON, no name, arguments not an
      object), which the environment answers with a tool message saying so.
    """

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()


class ToolCallFormat(abc.ABC):
    """How a model family writes tool calls in its turns, e.g. Qwen's
    ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``. A
    :class:`ModelPlugin` names its format (``ModelPlugin.tool_call_format``); the built-in
    tool environment parses the model's turns with it.

    - ``name``: the format's name (``qwen``, ``llama3``, ...);
    - ``call_end``: the text that ends one tool call (``</tool_call>``), where a rollout may
      stop decoding the turn; empty: turns end only at a stop token;
    - :meth:`parse`: a turn's text -> :class:`ParsedTurn` (never raises);
    - :meth:`render_call`: a call as the model would write it (scripted transcripts, tests).
    """

    name: ClassVar[str]
    call_end: ClassVar[str] = ""

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedTurn: ...

    @abc.abstractmethod
    def render_call(self, call: ToolCall) -> str: ...


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """What :meth:`Environment.step` returns.

    - ``messages``: the messages to append after the model's turn (tool results, a user
      reply); None or empty when the conversation is over;
    - ``done``: the episode is over (the rollout stops this row);
    - ``info``: counters and notes for metrics (``tool_calls``, ``tool_errors``,
      ``tool_timeouts``, ``tool_truncated``: ints; anything else is ignored by the engine).
    """

    messages: "Sequence[Message] | None"
    done: bool
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
    """One conversation of a multi-turn rollout (one per completion row; each process
    makes the environments of its own rows).

    - :meth:`reset` gives the opening messages (the prompt) for an example;
    - :meth:`step` takes the text of the model's finished turn and answers with an
      :class:`EnvStep`. It must not raise for anything the model wrote: a bad tool call is
      a message back to the model, counted in ``info``;
    - :meth:`close` releases what the environment holds (default: nothing).

    ``tools`` (name -> :data:`ToolFn`) are rendered into the prompt by the chat template's
    ``tools=`` argument; an environment without tools leaves it empty.
    """

    tools: Mapping[str, ToolFn] = {}

    @abc.abstractmethod
    def reset(self, example: Mapping[str, Any]) -> list[Message]: ...

    @abc.abstractmethod
    def step(self, model_turn_text: str) -> EnvStep: ...

    def close(self) -> None:
        return None
