"""Host side of multi-turn tool use: the calculator, tool-call formats, tool schemas and
the built-in tool environment (errors, timeouts, huge and non-string results). No JAX."""

from __future__ import annotations

import ast
import json
import threading
import time

import pytest

from grpo.core.contracts import ToolCall
from grpo.core.errors import UserError
from grpo.engine.rollout.tools import (
    MAX_RESULT_CHARS,
    ToolEnvironment,
    run_steps,
    tool_call_format,
    tool_schema,
)
from grpo.plugins.tools import builtin_tools, calculator


# ----------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, expected",
    [("1+2*3", "7"), ("(3 + 4) * 12 / 5", "16.8"), ("7/2", "3.5"), ("2**10", "1024"), ("-3//2", "-2"),
     ("17 % 5", "2"), ("+-4", "-4"), ("1.5*2", "3"), (" 48/2 ", "24")],
)
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected
    reference = eval(compile(ast.parse(expression.strip(), mode="eval"), "<test>", "eval"))  # trusted literals only
    assert float(calculator(expression)) == pytest.approx(reference)


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('true')", "not Call"),
        ("x + 1", "not Name"),
        ("(1).real", "not Attribute"),
        ("True + 1", "not Constant"),
        ("1 << 3", "not LShift"),
        ("9**9**9", "exponent"),
        ("10**20", "exceeds"),
        ("1e15 * 10", "exceeds"),
        ("1e15**64.0", "exceeds"),
        ("1/0", "division by zero"),
        ("0**-1", "division by zero"),
        ("(-8)**0.5", "not a real number"),
        ("1+", "not an arithmetic expression"),
        ("1" * 201, "at most 200"),
    ],
)
def test_calculator_refuses(expression, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        calculator(expression)


# ----------------------------------------------------------------------------- formats


def test_qwen_format_parses_calls_content_and_errors():
    fmt = tool_call_format("qwen")
    assert fmt.call_end == "</tool_call>"
    text = (
        'Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "12"}}\n</tool_call>'
        '<tool_call>{"name":"calculator","arguments":"{\\"expression\\": \\"1+1\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call> and <tool_call>[1]</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": 3}</tool_call>'
        '<tool_call>{"name": "g"'
    )
    parsed = fmt.parse(text)
    assert parsed.calls == (ToolCall("lookup", {"key": "12"}), ToolCall("calculator", {"expression": "1+1"}))
    assert parsed.content == "Let me check.\n and"
    assert len(parsed.errors) == 5
    for err, word in zip(parsed.errors, ["invalid JSON", "not a JSON object", "no \"name\"", "not a JSON object", "unterminated"]):
        assert word in err
    assert fmt.parse("The answer is 7.") == type(parsed)(content="The answer is 7.")
    call = ToolCall("lookup", {"key": "7"})
    rendered = fmt.render_call(call)
    assert rendered == '<tool_call>\n{"name": "lookup", "arguments": {"key": "7"}}\n</tool_call>'
    assert fmt.parse(rendered).calls == (call,)


def test_llama3_format():
    fmt = tool_call_format("llama3")
    assert fmt.call_end == ""
    call = ToolCall("calculator", {"expression": "2*3"})
    assert fmt.parse(fmt.render_call(call)).calls == (call,)
    assert fmt.parse('<|python_tag|>{"name": "calculator", "arguments": {"expression": "1"}}').calls == (
        ToolCall("calculator", {"expression": "1"}),
    )
    assert fmt.parse("The answer is 6.").calls == ()
    assert fmt.parse('{"answer": 6}').content == '{"answer": 6}'  # JSON without a name: an answer
    bad = fmt.parse('{"name": "calculator", "parameters": [1]}')
    assert bad.calls == () and "not a JSON object" in bad.errors[0]
    assert "invalid JSON" in fmt.parse('{"name": "calculator", ').errors[0]


def test_unknown_format_lists_choices():
    with pytest.raises(UserError, match="'hermes'.*llama3, qwen"):
        tool_call_format("hermes")


def test_llama_family_names_its_format():
    from grpo.core.plugins import get_plugins

    plugins = get_plugins()
    assert plugins.get("model", "llama").tool_call_format == "llama3"
    assert plugins.get("model", "qwen2").tool_call_format == "qwen"


# ----------------------------------------------------------------------------- schemas


def test_schema_from_hints_and_docstring():
    schema = tool_schema(calculator)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "calculator" and fn["description"].startswith("Evaluate an arithmetic expression")
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"
    assert fn["parameters"]["required"] == ["expression"]
    assert tool_schema(calculator, name="calc")["function"]["name"] == "calc"
    # Schemas are cached per function; a renamed or edited copy leaves the cached one alone.
    tool_schema(calculator)["function"]["parameters"]["required"].append("x")
    assert tool_schema(calculator) == schema and schema["function"]["name"] == "calculator"


def _no_hint(x):
    """Do something.

    Args:
        x: The thing.
    """


def _no_doc(x: int) -> int:
    return x


def _no_args_section(x: int) -> int:
    """Do something."""
    return x


@pytest.mark.parametrize(
    "fn, words", [(_no_hint, "missing a type hint"), (_no_doc, "no docstring"), (_no_args_section, "no description for the argument 'x'")]
)
def test_schema_errors_name_the_tool(fn, words):
    with pytest.raises(UserError, match=rf"task.options.tools: tool '{fn.__name__}' cannot be described.*{words}"):
        tool_schema(fn, where="task.options.tools")


def test_builtin_tools_unknown_name():
    assert builtin_tools(["calculator"]) == {"calculator": calculator}
    with pytest.raises(UserError, match="task.options.tools: unknown tool 'search'; the built-in tools are: calculator"):
        builtin_tools(["calculator", "search"], where="task.options.tools")


# ----------------------------------------------------------------------------- environment

_RELEASE = threading.Event()


def hang(seconds: float) -> str:
    """Wait until the test releases it.

    Args:
        seconds: Ignored.
    """
    _RELEASE.wait(30)
    return "late"


def boom(reason: str) -> str:
    """Raise.

    Args:
        reason: The error message.
    """
    raise ValueError(reason)


def huge(n: int) -> str:
    """A long text.

    Args:
        n: Its length.
    """
    return "x" * n


def structured(key: str) -> dict:
    """A dict, and an object JSON cannot hold.

    Args:
        key: Which.
    """
    return {"key": key, "values": [1, 2]} if key == "json" else {"obj": object()}


def _env(timeout_s: float = 0.2) -> ToolEnvironment:
    tools = {"calculator": calculator, "hang": hang, "boom": boom, "huge": huge, "structured": structured}
    return ToolEnvironment(
        tools=tools, format="qwen", opening=[{"role": "user", "content": "hi"}], timeout_s=timeout_s
    )


def _turn(*calls: ToolCall) -> str:
    fmt = tool_call_format("qwen")
    return "thinking " + "".join(fmt.render_call(c) for c in calls)


def test_environment_answers_every_kind_of_call_and_counts():
    env = _env()
    opening = env.reset({"ignored": 1})
    assert opening == [{"role": "user", "content": "hi"}]
    opening[0]["content"] = "changed"  # reset hands out copies
    assert env.reset({}) == [{"role": "user", "content": "hi"}]
    assert [s["function"]["name"] for s in env.schemas] == ["calculator", "hang", "boom", "huge", "structured"]

    _RELEASE.clear()
    started = time.monotonic()
    step = env.step(
        _turn(
            ToolCall("calculator", {"expression": "6*7"}),
            ToolCall("hang", {"seconds": 1}),
            ToolCall("hang", {"seconds": 2}),
            ToolCall("boom", {"reason": "no luck"}),
            ToolCall("calculator", {"expr": "1"}),
            ToolCall("nope", {}),
            ToolCall("huge", {"n": 5000}),
            ToolCall("structured", {"key": "json"}),
            ToolCall("structured", {"key": "obj"}),
        )
        + "<tool_call>{oops}</tool_call>"
    )
    elapsed = time.monotonic() - started
    _RELEASE.set()
    # The calls of a turn run together: two hung calls cost one timeout, not two.
    assert elapsed < 0.2 + 0.15, elapsed
    assert step.done is False
    contents = [m["content"] for m in step.messages]
    assert [m["role"] for m in step.messages] == ["tool"] * 10
    assert [m["name"] for m in step.messages] == [
        "calculator", "hang", "hang", "boom", "calculator", "nope", "huge", "structured", "structured", "error"
    ]
    assert contents[0] == "42"
    assert contents[1] == contents[2] == "error: the tool did not answer within 0.2 s"
    assert contents[3] == "error: ValueError: no luck"
    assert contents[4].startswith("error: TypeError:") and "expr" in contents[4]
    assert contents[5] == "error: unknown tool 'nope'; the tools are: calculator, hang, boom, huge, structured"
    assert contents[6].startswith("x" * MAX_RESULT_CHARS + "... [cut: the result has 5000 characters")
    assert json.loads(contents[7]) == {"key": "json", "values": [1, 2]}
    assert contents[8].startswith("{'obj': <object object")
    assert contents[9].startswith("error: malformed tool call (invalid JSON")
    assert dict(step.info) == {"tool_calls": 10, "tool_errors": 4, "tool_timeouts": 2, "tool_truncated": 1}


def test_environment_done_without_calls_and_after_hung_tools():
    env = _env(timeout_s=0.05)
    _RELEASE.clear()
    for _ in range(3):  # hung threads from earlier calls never block later ones
        assert env.step(_turn(ToolCall("hang", {"seconds": 1}))).info["tool_timeouts"] == 1
    assert env.step(_turn(ToolCall("calculator", {"expression": "2+2"}))).messages[0]["content"] == "4"
    _RELEASE.set()
    final = env.step("The value is 4.")
    assert final.done is True and not final.messages
    assert dict(final.info) == {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_truncated": 0}


def test_tool_threads_are_reused_and_hung_ones_never_claimed():
    env = _env(timeout_s=0.05)
    env.step(_turn(ToolCall("calculator", {"expression": "1+1"})))
    tool_threads = lambda: sum(t.name == "grpo-tool" for t in threading.enumerate())  # noqa: E731
    before = tool_threads()
    for i in range(50):  # one call at a time: the idle thread of the last call takes the next
        assert env.step(_turn(ToolCall("calculator", {"expression": f"{i}+1"}))).messages[0]["content"] == str(i + 1)
    assert tool_threads() == before
    _RELEASE.clear()
    assert env.step(_turn(ToolCall("hang", {"seconds": 1}))).info["tool_timeouts"] == 1
    # The hung call keeps its thread: the next call gets another one and answers at once.
    started = time.monotonic()
    assert env.step(_turn(ToolCall("calculator", {"expression": "2*3"}))).messages[0]["content"] == "6"
    assert time.monotonic() - started < 0.05
    _RELEASE.set()


def test_run_steps_matches_stepping_one_by_one():
    envs = [_env() for _ in range(5)]
    texts = [_turn(ToolCall("calculator", {"expression": f"{i}*{i}"})) if i % 2 else "done" for i in range(5)]
    together = run_steps(envs, texts)
    assert together == [env.step(text) for env, text in zip(envs, texts)]
    with pytest.raises(ValueError, match="5 environments but 4 turns"):
        run_steps(envs, texts[:4])


def test_environment_rejects_undescribable_tools():
    with pytest.raises(UserError, match="tool 'bad' cannot be described"):
        ToolEnvironment(tools={"bad": _no_doc}, format="qwen", opening=[])


class _BadStr:
    def __str__(self):
        raise RuntimeError("no text")

    __repr__ = __str__


class _BadMessage(Exception):
    def __str__(self):
        raise ValueError("nor a message")


def _deep(n: int = 100_000) -> list:
    out: list = []
    for _ in range(n):
        out = [out]
    return out


class _SneakyStr(str):
    def __len__(self):
        raise RuntimeError("len")


def misbehave(how: str) -> object:
    """A tool that fails in ways that end a process unless caught.

    Args:
        how: exit, interrupt, badstr, badmessage, deep or sneaky.
    """
    if how == "exit":
        raise SystemExit(2)  # what argparse does on bad input
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "badmessage":
        raise _BadMessage()
    return {"badstr": lambda: _BadStr(), "deep": _deep, "sneaky": lambda: _SneakyStr("ok")}[how]()


MISBEHAVIOURS = ("exit", "interrupt", "badstr", "badmessage", "deep", "sneaky")


def test_nothing_a_tool_or_its_result_does_ends_the_rollout():
    """SystemExit, KeyboardInterrupt, a result whose str() raises, an exception whose
    message raises, a result nested past the recursion limit: each is an error message to
    the model and a count in ``tool_errors``, through one step and through ``run_steps``'
    pool alike; a str subclass is answered as plain text."""
    env = ToolEnvironment(tools={"misbehave": misbehave}, format="qwen", opening=[], timeout_s=5.0)
    text = _turn(*(ToolCall("misbehave", {"how": h}) for h in MISBEHAVIOURS))
    for step in (env.step(text), *run_steps([env, env], [text, text])):
        contents = [m["content"] for m in step.messages]
        assert contents[0] == "error: SystemExit: 2"
        assert contents[1] == "error: KeyboardInterrupt"
        assert contents[2] == "error: RuntimeError: no text"
        assert contents[3] == "error: _BadMessage: (its message could not be read)"
        assert contents[4].startswith("error: RecursionError")
        assert contents[5] == "ok" and type(contents[5]) is str
        assert dict(step.info) == {"tool_calls": 6, "tool_errors": 5, "tool_timeouts": 0, "tool_truncated": 0}


@pytest.mark.parametrize("fmt", ["qwen", "llama3"])
def test_deeply_nested_call_from_the_model_is_a_malformed_call(fmt):
    deep = '{"name": "calculator", "arguments": {"expression": ' + "[" * 100_000 + "}}"
    text = f"<tool_call>{deep}</tool_call>" if fmt == "qwen" else deep
    parsed = tool_call_format(fmt).parse(text)
    assert not parsed.calls and len(parsed.errors) == 1 and "malformed tool call" in parsed.errors[0]


class _FailingEnvironment(ToolEnvironment):
    def step(self, model_turn_text):
        raise SystemExit("a task's own environment gave up")


def test_an_environment_that_raises_ends_its_row_not_the_run():
    good = _env()
    bad = _FailingEnvironment(tools={}, format="qwen", opening=[])
    steps = run_steps([bad, good, bad], ["a", "b", "c"])
    assert steps[1].done is True and steps[1].messages is None
    for step in (steps[0], steps[2]):
        assert step.done is True and not step.messages and step.info == {"tool_errors": 1}
