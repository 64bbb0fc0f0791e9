"""The synthetic ``lookup`` task (values only its tool knows) and GSM8K's ``tools`` option.
Host only: no JAX."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from grpo.core.cli import cli
from grpo.core.contracts import ToolCall
from grpo.core.errors import UserError
from grpo.core.plugins import get_plugins
from grpo.engine.rollout.scoring import score_completions
from grpo.engine.rollout.tools import task_environment, tool_call_format
from grpo.plugins.tasks import LookupOptions, LookupTask
from grpo.plugins.tasks._lookup import call_progress, make_table, split_keys
from grpo.plugins.tools import calculator

QWEN = tool_call_format("qwen")


@pytest.fixture
def task() -> LookupTask:
    return get_plugins().get("task", "lookup")


def test_table_splits_and_examples(task):
    options = LookupOptions(num_keys=50, num_examples=300, num_test_examples=1000, seed=3)
    table = make_table(seed=3, num_keys=50, key_digits=2, value_digits=2)
    assert len(table) == 50 and all(len(k) == 2 == len(v) and k.isdigit() and v.isdigit() for k, v in table.items())
    assert table == make_table(seed=3, num_keys=50, key_digits=2, value_digits=2)
    assert table != make_table(seed=4, num_keys=50, key_digits=2, value_digits=2)
    train = task.load(split="train", options=options)
    test = task.load(split="test", options=options)
    assert task.load(split="train", options=options) == train
    assert len(train) == 300 and len(test) == 10  # 20% of 50 keys, each once
    train_keys, test_keys = {e["key"] for e in train}, {e["key"] for e in test}
    assert not train_keys & test_keys and len(train_keys) == 40
    assert all(e["value"] == table[e["key"]] and e["seed"] == 3 for e in train + test)
    assert (sorted(train_keys), sorted(test_keys)) == tuple(map(sorted, split_keys(table, seed=3, test_fraction=0.2)))
    # The run's seed picks the table when the options give none.
    assert task.load(split="test", options=LookupOptions(), seed=7)[0]["seed"] == 7
    with pytest.raises(UserError, match="splits train, test"):
        task.load(split="valid", options=options)


def test_options_are_checked():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="num_keys=200 exceeds the 100 possible keys"):
        LookupOptions(num_keys=200)
    with pytest.raises(ValidationError, match="num_keys=40 exceeds the 30 possible keys"):
        LookupOptions(num_keys=40, key_alphabets=["ABC", "0123456789"])
    with pytest.raises(ValidationError, match="distinct ASCII letters or digits"):
        LookupOptions(value_alphabet="aab")
    with pytest.raises(ValidationError, match="unknown reward name"):
        LookupOptions(reward_weights={"format": 1.0})
    assert LookupOptions(reward_weights={"call": 0.0}).reward_weights == {
        "correct": 1.0, "prefix": 0.5, "call": 0.0, "answer": 0.0
    }


def test_environment_answers_the_call_from_the_examples_table(task):
    options = LookupOptions(num_keys=20, seed=None)
    example = task.load(split="test", options=options, seed=5)[0]
    env = task_environment(task, example, options=options, tool_format=QWEN, timeout_s=1.0)
    assert env.reset(example) == [{"role": "user", "content": f"What is the value of {example['key']}?"}]
    assert [s["function"]["name"] for s in env.schemas] == ["lookup"]
    step = env.step(QWEN.render_call(ToolCall("lookup", {"key": example["key"]})))
    assert step.messages == [{"role": "tool", "name": "lookup", "content": example["value"]}] and not step.done
    missing = env.step(QWEN.render_call(ToolCall("lookup", {"key": "x"})))
    assert missing.messages[0]["content"] == "error: KeyError: \"no key 'x' in the table\""
    assert missing.info["tool_errors"] == 1
    assert env.step(example["value"]).done
    assert set(task.tools(options=options)) == {"lookup"}


def test_call_progress_climbs_part_by_part():
    ideal = QWEN.render_call(ToolCall("lookup", {"key": "37"}))
    assert call_progress(ideal, "37") == 1.0
    assert call_progress(ideal + "52", "37") == 1.0
    assert call_progress('<tool_call>{"name":"lookup","arguments":{"key":"37"}}</tool_call>', "37") == 1.0
    assert call_progress(ideal.replace("37", "38"), "37") == pytest.approx(5.5 / 6)  # "8": a digit, not the key's
    assert call_progress(ideal.replace("37", "4x"), "37") == pytest.approx(2.5 / 6)  # no closing credit either
    assert call_progress('<tool_call>\n{"name": "lookup", "arguments": {"key": "37', "37") == pytest.approx(4 / 6)
    assert call_progress("<tool_call>\n{", "37") == pytest.approx(1 / 6)
    assert call_progress("52", "37") == 0.0
    assert call_progress(" " + ideal, "37") == 1.0


def test_rewards_read_the_last_turn_and_the_first_call(task):
    options = LookupOptions()
    example = {"key": "37", "value": "52"}
    call = QWEN.render_call(ToolCall("lookup", {"key": "37"}))
    trajectory = [
        {"role": "user", "content": "What is the value of 37?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "lookup", "content": "52"},
        {"role": "assistant", "content": " 52"},
    ]
    fns = task.reward_functions(options=options)
    rewards = {n: fn(" 52", {**example, "messages": trajectory}) for n, fn in fns.items()}
    assert rewards == {"correct": 1.0, "prefix": 1.0, "call": 1.0, "answer": 1.0}
    # `answer` reads the tool's reply: the last turn repeats it, right key or not.
    assert fns["answer"]("7 and", {**example, "messages": trajectory}) == 0.0
    wrong = [*trajectory[:2], {"role": "tool", "name": "lookup", "content": "61"}, {"role": "assistant", "content": "61"}]
    assert {n: fn("61", {**example, "messages": wrong}) for n, fn in fns.items()} == {
        "correct": 0.0, "prefix": 0.0, "call": 1.0, "answer": 1.0}
    error = [*trajectory[:2], {"role": "tool", "name": "lookup", "content": "error: KeyError"}]
    assert fns["answer"]("error", {**example, "messages": error}) == 0.0
    # Answered from memory, no call: correct but no call credit; single-turn scoring reads the completion.
    assert {n: fn("52", example) for n, fn in fns.items()} == {"correct": 1.0, "prefix": 1.0, "call": 0.0, "answer": 0.0}
    assert {n: fn("52<|x", example) for n, fn in fns.items()} == {"correct": 0.0, "prefix": 1.0, "call": 0.0, "answer": 0.0}
    assert {n: fn(call, example) for n, fn in fns.items()} == {"correct": 0.0, "prefix": 0.0, "call": 1.0, "answer": 0.0}
    scores = score_completions(task, options, [example, example], ["52", "53"])
    assert scores.correct == [True, False] and scores.totals == [1.5, 0.0]
    assert task.reward_weights(options=options) == {"correct": 1.0, "prefix": 0.5, "call": 0.5, "answer": 0.0}


def test_call_progress_credits_and_strict_calls():
    ideal = QWEN.render_call(ToolCall("lookup", {"key": "37"}))
    assert call_progress(ideal.replace("37", "73"), "37", other=0.0, misplaced=0.5) == pytest.approx(5 / 6)
    assert call_progress(ideal.replace("37", "38"), "37", other=0.0) == pytest.approx(5 / 6)
    assert call_progress(ideal.replace("37", "38"), "37", other=0.0, strict=True) == pytest.approx(3 / 6)
    assert call_progress(ideal, "37", strict=True) == 1.0
    letters = ("ABC", "0123456789")
    c7 = ideal.replace("37", "C7")
    assert call_progress(c7, "C7", alphabets=letters) == 1.0
    assert call_progress(c7.replace("C7", "A7"), "C7", other=0.25, alphabets=letters) == pytest.approx(5.25 / 6)
    assert call_progress(c7.replace("C7", "7C"), "C7", alphabets=letters) == pytest.approx(3 / 6)  # out of alphabet


def test_alphabets_make_the_table_the_prompt_and_the_rewards(task):
    options = LookupOptions(key_alphabets=["ABCDE", "0123456789"], value_alphabet="abcdefghij", value_digits=1,
                            num_keys=50, question="{key}")
    train = task.load(split="train", options=options, seed=1)
    keys = {e["key"] for e in train}
    assert all(len(k) == 2 and k[0] in "ABCDE" and k[1].isdigit() for k in keys)
    assert all(len(e["value"]) == 1 and e["value"] in "abcdefghij" for e in train)
    assert task.prompt_messages(train[0], options=options) == [{"role": "user", "content": train[0]["key"]}]
    fns = task.reward_functions(options=options)
    example = {"key": "C7", "value": "d"}
    assert {n: fn("d", example) for n, fn in fns.items()} == {"correct": 1.0, "prefix": 1.0, "call": 0.0, "answer": 0.0}
    assert fns["prefix"]("d7", example) == 1.0 and fns["prefix"]("da", example) == 0.0
    assert task.prepare_example({"key": "C7", "value": "d"}, options=options) == example
    with pytest.raises(UserError, match="row: the 'key' of a lookup example must be 2 characters of 'ABCDE', '0123"):
        task.prepare_example({"key": "7C", "value": "d"}, options=options)


def test_question_and_reply_templates(task):
    from pydantic import ValidationError

    options = LookupOptions(key_alphabets=["ABC", "0123456789"], value_alphabet="abcdefghij", value_digits=1,
                            num_keys=30, question="{key} {key}", reply="{value} {value}", seed=2)
    example = task.load(split="test", options=options, seed=2)[0]
    assert task.prompt_messages(example, options=options) == [{"role": "user", "content": f"{example['key']} {example['key']}"}]
    env = task_environment(task, example, options=options, tool_format=QWEN, timeout_s=1.0)
    env.reset(example)
    step = env.step(QWEN.render_call(ToolCall("lookup", {"key": example["key"]})))
    assert step.messages[0]["content"] == f"{example['value']} {example['value']}"
    assert task.tools(options=options)["lookup"](key=example["key"]) == f"{example['value']} {example['value']}"
    # `answer` reads the value out of the reply's template; a reply that is not one pays nothing.
    answer = task.reward_functions(options=options)["answer"]
    call = {"role": "assistant", "content": QWEN.render_call(ToolCall("lookup", {"key": "A1"}))}
    def said(reply: str, completion: str) -> float:
        return answer(completion, {**example, "messages": [call, {"role": "tool", "name": "lookup", "content": reply}]})
    assert said("c c", "c") == 1.0 and said(" c c\n", "c ") == 1.0
    assert said("c c", "cc") == 0.0 and said("c d", "c") == 0.0 and said("error: KeyError", "c") == 0.0
    for field, bad, message in [
        ("question", "{value}", "must use {key} and nothing else"),
        ("question", "What is {key} of {x}?", "must use {key} and nothing else"),
        ("reply", "{value", "not a format template"),
        ("reply", "the value", "must use {value} and nothing else"),
    ]:
        with pytest.raises(ValidationError, match=field) as info:
            LookupOptions(**{field: bad})
        assert message in str(info.value)


def test_prepare_example(task):
    assert task.prepare_example({"key": " 07", "value": "42"}, options=LookupOptions()) == {"key": "07", "value": "42"}
    with pytest.raises(UserError, match="line 3: the 'value' of a lookup example must be digits"):
        task.prepare_example({"key": "07", "value": "four"}, options=LookupOptions(), where="line 3")


def test_gsm8k_tools_option(tmp_path):
    gsm8k = get_plugins().get("task", "gsm8k")
    options = gsm8k.Options(tools=["calculator"])
    assert gsm8k.tools(options=options) == {"calculator": calculator}
    assert gsm8k.tools(options=gsm8k.Options()) == {}
    env = task_environment(gsm8k, {"question": "1+1?", "answer": "2"}, options=options, tool_format=QWEN)
    assert env.reset({})[-1] == {"role": "user", "content": "1+1?"}
    config = tmp_path / "bad.yaml"
    config.write_text(
        "name: t\nmodel: {source: random, random: {preset: tiny}}\n"
        "task: {name: gsm8k, options: {tools: [calculator, search]}}\n"
    )
    result = CliRunner().invoke(cli, ["config", "validate", str(config)])
    assert result.exit_code == 2
    assert "task.options.tools: unknown tool(s) 'search'; the built-in tools are: calculator" in result.output
