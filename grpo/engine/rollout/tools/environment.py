"""The engine's tool environment: parse the model's tool calls, run them, answer with
tool messages; and :func:`task_environment`, the environment of one rollout row.

Running untrusted calls
    Every call runs on a daemon thread and is waited on for ``timeout_s`` seconds at
    most: an idle thread of an earlier call, or a new one when none is idle (a rollout
    makes a call per row, so threads are reused rather than started per call). Python
    cannot kill a thread, so a call that hangs past its timeout keeps its thread until it
    returns; since a call never waits for a busy thread, it never blocks a later call,
    and since the threads are daemons, nor the process's exit, which a
    ``ThreadPoolExecutor`` worker would. The calls of one turn start together, so a turn
    with several calls waits for the slowest, not the sum. :func:`run_steps` steps the
    environments of many rows at once from a shared thread pool (the engine's per-process
    batch of rows): a step itself is bounded by its calls' timeouts, so that pool never
    fills with hung work.

Nothing the model writes or a tool does is fatal. Each of these becomes a tool message
back to the model, and is counted in the step's ``info``:

- a malformed call (bad JSON, no name, arguments not an object) or an unknown tool name:
  ``error: ...``, counted in ``tool_errors``;
- a tool that raises (wrong arguments included): ``error: ValueError: ...``,
  ``tool_errors``; ``SystemExit`` (argparse on bad input) and ``KeyboardInterrupt``
  raised by a tool alike: only a signal to the process (which Python delivers to the
  main thread, never to a tool's) stops the run;
- a tool still running after ``timeout_s``: ``error: the tool did not answer within X s``,
  ``tool_timeouts``;
- a result that is not a string: JSON (``str()`` when it is not JSON-serialisable or is
  nested too deeply), rendered on the tool's thread inside its timeout; a result whose
  ``str()`` raises, or recurses too deeply: ``error: ...``, ``tool_errors``; a result longer than :data:`MAX_RESULT_CHARS`: cut there, with a note saying how long it
  was (``tool_truncated``), so one tool cannot flood the context.

``tool_calls`` counts every call the model attempted, malformed ones included.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import threading
import time
from typing import Any, Mapping, Sequence

from grpo.core.contracts import Environment, EnvStep, Message, TaskPlugin, ToolCall, ToolCallFormat, ToolFn
from grpo.engine.rollout.tools.formats import tool_call_format
from grpo.engine.rollout.tools.schema import check_tools, tool_schemas

log = logging.getLogger(__name__)

MAX_RESULT_CHARS = 1000
_STEP_WORKERS = 32


def _as_text(result: Any) -> str:
    """The tool message's text of a result: a string as is, else JSON, else ``str()``.
    Runs the result's own code (``__str__``, a ``default`` encoder's walk of a deep
    structure), so it runs on the tool's thread, inside its timeout and its ``try``."""
    if isinstance(result, str):
        return str.__str__(result)  # a plain str: a subclass's own methods never run again
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return str.__str__(str(result))


def _describe(err: BaseException) -> str:
    """``error: Type: message``; an exception whose ``str()`` itself raises (or recurses)
    is named by its type alone."""
    try:
        text = str.__str__(str(err))
    except BaseException:  # noqa: BLE001 - the tool's own object, never trusted
        text = "(its message could not be read)"
    try:
        kind = str.__str__(type(err).__name__)
    except BaseException:  # noqa: BLE001
        kind = "exception"
    return f"error: {kind}: {text}" if text else f"error: {kind}"


class _Failed(str):
    """A tool call's error message (a call that raised, even ``SystemExit`` or
    ``KeyboardInterrupt``): the worker hands the model its description instead of
    re-raising it in the rollout's thread, where it would end the run."""


def _call(fn: ToolFn, arguments: Mapping[str, Any]) -> str:
    """Run one call and render its result on the tool's thread: the text for the model,
    or a :class:`_Failed` message. Nothing the tool or its result does escapes (a
    ``SystemExit`` from argparse, a ``KeyboardInterrupt`` raised by the tool, a ``str()``
    that raises, a result nested past the recursion limit)."""
    try:
        return _as_text(fn(**arguments))
    except BaseException as err:  # noqa: BLE001 - reported to the model, never raised
        try:
            return _Failed(_describe(err))
        except BaseException:  # noqa: BLE001
            return _Failed("error: the tool failed")


class _Workers:
    """Daemon threads that run tool calls: :meth:`submit` hands a call to an idle thread,
    or starts one when every thread is busy (or hung), so no call waits behind another.
    ``idle`` counts the threads waiting for work that no submitted call has claimed; a
    thread idle for ``linger_s`` exits."""

    def __init__(self, linger_s: float = 60.0) -> None:
        self.linger_s = linger_s
        self.idle = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, fn: ToolFn, arguments: Mapping[str, Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            start = self.idle == 0
            if not start:
                self.idle -= 1  # claimed: that thread takes this call (or one as new as it)
        self._queue.put((future, fn, arguments))
        if start:
            threading.Thread(target=self._work, name="grpo-tool", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            try:
                future, fn, arguments = self._queue.get(timeout=self.linger_s)
            except queue.Empty:
                with self._lock:
                    if self.idle > 0:  # unclaimed: every queued call still has a thread
                        self.idle -= 1
                        return
                continue
            future.set_result(_call(fn, arguments))  # never raises: see _call
            del future, fn, arguments
            with self._lock:
                self.idle += 1


_WORKERS = _Workers()


def _start(fn: ToolFn, arguments: Mapping[str, Any]) -> concurrent.futures.Future:
    return _WORKERS.submit(fn, arguments)


class ToolEnvironment(Environment):
    """One row's conversation with tools.

    - ``tools``: name -> typed, documented callable (checked here: a tool the chat
      template cannot describe is a :class:`grpo.UserError`);
    - ``format``: the model family's :class:`ToolCallFormat`, or its name;
    - ``opening``: the opening messages, which :meth:`reset` returns;
    - ``timeout_s``: the most a call may take before it is answered as timed out.

    ``schemas`` are the tools' JSON schemas for ``apply_chat_template(tools=...)``.
    :meth:`step` answers a turn without calls with ``done=True`` (the model answered),
    a turn with calls with one tool message per call and ``done=False``; how many turns
    a row may take is the rollout's limit (``rollout.max_turns``), not the environment's.
    """

    def __init__(
        self, *, tools: Mapping[str, ToolFn], format: ToolCallFormat | str, opening: Sequence[Message],
        timeout_s: float = 10.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.tools = dict(tools)
        check_tools(self.tools)
        self.format = tool_call_format(format) if isinstance(format, str) else format
        self.opening = [dict(m) for m in opening]
        self.timeout_s = float(timeout_s)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas (``apply_chat_template(tools=...)``)."""
        return tool_schemas(self.tools)

    def reset(self, example: Mapping[str, Any]) -> list[Message]:
        return [dict(m) for m in self.opening]

    def step(self, model_turn_text: str) -> EnvStep:
        parsed = self.format.parse(model_turn_text)
        info = {
            "tool_calls": len(parsed.calls) + len(parsed.errors),
            "tool_errors": len(parsed.errors),
            "tool_timeouts": 0,
            "tool_truncated": 0,
        }
        if not parsed.calls and not parsed.errors:
            return EnvStep(messages=None, done=True, info=info)
        started = time.monotonic()
        pending = [(call, self._launch(call)) for call in parsed.calls]
        messages: list[Message] = []
        for call, future in pending:
            if isinstance(future, str):  # unknown tool: answered without running anything
                content, kind = future, "tool_errors"
            else:
                content, kind = self._collect(future, deadline=started + self.timeout_s)
            if kind:
                info[kind] += 1
            messages.append({"role": "tool", "name": call.name, "content": content})
        for error in parsed.errors:
            messages.append({"role": "tool", "name": "error", "content": f"error: {error}"})
        return EnvStep(messages=messages, done=False, info=info)

    def _launch(self, call: ToolCall) -> concurrent.futures.Future | str:
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}; the tools are: {', '.join(self.tools) or 'none'}"
        return _start(fn, call.arguments)

    def _collect(self, future: concurrent.futures.Future, *, deadline: float) -> tuple[str, str]:
        """(the tool message's content, the info counter it adds to or '')."""
        # Only a timeout can be raised here: the worker hands back text, never the tool's
        # exception. A KeyboardInterrupt raised while waiting is the process's own SIGINT
        # (signals reach the main thread only), and ends the run as it should.
        try:
            text = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            return f"error: the tool did not answer within {self.timeout_s:g} s", "tool_timeouts"
        if isinstance(text, _Failed):
            return str.__str__(text), "tool_errors"
        if len(text) > MAX_RESULT_CHARS:
            note = f"... [cut: the result has {len(text)} characters, only the first {MAX_RESULT_CHARS} are shown]"
            return text[:MAX_RESULT_CHARS] + note, "tool_truncated"
        return text, ""


_WARNED: set[str] = set()


def safe_step(env: Environment, text: str) -> EnvStep:
    """``env.step(text)`` on a worker thread, where an environment's own failure (a task's
    :class:`Environment` that raises, ``SystemExit`` included) ends that row's episode,
    counted in ``tool_errors`` and logged once per kind, instead of the run. Never call
    it on the main thread: there a ``KeyboardInterrupt`` is the process's SIGINT."""
    try:
        return env.step(text)
    except BaseException as err:  # noqa: BLE001 - one row's environment, not the run
        message = _describe(err)
        key = f"{type(env).__name__}:{type(err).__name__}"
        if key not in _WARNED:
            _WARNED.add(key)
            log.warning("the environment %s failed (%s): its row's episode ends there, counted in tools/errors",
                        type(env).__name__, message[len("error: "):])
        return EnvStep(messages=None, done=True, info={"tool_errors": 1})


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def run_steps(environments: Sequence[Environment], texts: Sequence[str]) -> list[EnvStep]:
    """``[env.step(text) for env, text in zip(environments, texts)]``, the rows stepped
    concurrently (their tools run in parallel) from a shared thread pool, each through
    :func:`safe_step` (a row whose environment fails ends its episode)."""
    if len(environments) != len(texts):
        raise ValueError(f"{len(environments)} environments but {len(texts)} turns")
    if not environments:
        return []
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(_STEP_WORKERS, thread_name_prefix="grpo-env-step")
    return list(_POOL.map(lambda pair: safe_step(*pair), zip(environments, texts)))


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


__all__ = ["MAX_RESULT_CHARS", "ToolEnvironment", "run_steps", "safe_step", "task_environment"]
