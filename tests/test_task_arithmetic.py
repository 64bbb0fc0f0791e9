"""The synthetic arithmetic task: generation, prompts, shaped rewards."""

from __future__ import annotations

import pytest

from grpo.core.errors import UserError
from grpo.core.plugins import get_plugins
from grpo.plugins.tasks import render_prompt, score_completions
from grpo.plugins.tasks._arithmetic import arithmetic_rewards


@pytest.fixture
def task():
    return get_plugins().get("task", "arithmetic")


def test_generation_is_deterministic_and_in_range(task):
    o = task.parse_options({"seed": 3, "num_examples": 300, "num_test_examples": 50, "min_operand": 2, "max_operand": 5})
    train = task.load(split="train", options=o)
    assert train == task.load(split="train", options=o, seed=99)  # options.seed wins over the run seed
    assert len(train) == 300 and len(task.load(split="test", options=o)) == 50
    pairs = set()
    for ex in train:
        a, b = ex["question"].rstrip("=").split("+")
        assert ex["question"] == f"{a}+{b}=" and ex["answer"] == str(int(a) + int(b))
        assert 2 <= int(a) <= 5 and 2 <= int(b) <= 5
        pairs.add((a, b))
    assert len(pairs) == 16  # every pair of the 4x4 grid shows up in 300 draws
    other = task.parse_options({"seed": 4, "num_examples": 300, "min_operand": 2, "max_operand": 5})
    assert task.load(split="train", options=other) != train
    assert task.load(split="test", options=o) != train[:50]


def test_run_seed_is_used_when_options_have_none(task):
    o = task.parse_options({"num_examples": 20})
    assert task.load(split="train", options=o, seed=1) == task.load(split="train", options=o, seed=1)
    assert task.load(split="train", options=o, seed=1) != task.load(split="train", options=o, seed=2)


def test_options_and_split_errors(task):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="min_operand"):
        task.parse_options({"min_operand": 5, "max_operand": 2})
    with pytest.raises(ValidationError, match="unknown reward"):
        task.parse_options({"reward_weights": {"exact": 1}})
    with pytest.raises(UserError, match="splits"):
        task.load(split="validation", options=task.parse_options({}))


def test_prompt_is_the_bare_sum(task):
    o = task.parse_options({})
    ex = task.load(split="train", options=o)[0]
    assert task.prompt_messages(ex, options=o) == [{"role": "user", "content": ex["question"]}]
    assert render_prompt(task, o, {"question": "3+4=", "answer": "7"}, None) == "3+4="


# completion, truth -> (correct, close, length, format) with S = 10
REWARD_TABLE = [
    ("7", "7", (1.0, 1.0, 1.0, 1.0)),
    ("1 2", "12", (1.0, 1.0, 1.0, 1.0)),  # a word-level tokenizer's spacing
    (" 12 \n", "12", (1.0, 1.0, 1.0, 1.0)),
    ("8", "7", (0.0, 0.9, 1.0, 1.0)),
    ("17", "7", (0.0, 0.0, 0.0, 1.0)),
    ("13", "12", (0.0, 0.9, 1.0, 1.0)),
    ("2", "12", (0.0, 0.0, 0.0, 1.0)),
    ("7+", "7", (0.0, 1.0, 1.0, 0.5)),  # right, but did not stop
    ("07", "7", (0.0, 1.0, 0.0, 1.0)),
    ("+7", "7", (0.0, 0.0, 0.0, 0.0)),
    ("", "7", (0.0, 0.0, 0.0, 0.0)),
    ("=", "7", (0.0, 0.0, 0.0, 0.0)),
    ("9" * 40, "7", (0.0, 0.0, 0.0, 1.0)),  # absurdly long: no huge ints, no closeness
]


@pytest.mark.parametrize("completion,truth,expected", REWARD_TABLE)
def test_reward_table(completion, truth, expected):
    r = arithmetic_rewards(completion, truth, scale=10)
    assert (r["correct"], r["close"], r["length"], r["format"]) == pytest.approx(expected)


def test_reward_is_shaped_towards_the_answer(task):
    """Nearer answers score more, the exact answer most; every wrong answer scores less
    than the right one, so no shaping term can be gamed against correctness."""
    o = task.parse_options({})
    ex = {"question": "5+7=", "answer": "12"}
    candidates = ["12", "13", "11", "15", "19", "9", "3", "0", "12+3", "x", ""]
    totals = dict(zip(candidates, score_completions(task, o, [ex] * len(candidates), candidates).totals))
    assert max(totals, key=totals.get) == "12"
    assert totals["12"] == pytest.approx(2.0)
    assert totals["13"] == totals["11"] > totals["15"] > totals["19"] > totals["x"] == totals[""] == 0.0
    assert totals["9"] > totals["3"]  # closeness still ranks one-digit answers
    assert totals["12+3"] < totals["12"]  # stopping matters
    # a random model's group (digits, junk, wrong lengths) gets distinct rewards: non-zero advantages
    group = ["3", "+", "47", "=5", "9", "", "12", "1"]
    assert len(set(score_completions(task, o, [ex] * 8, group).totals)) >= 6


def test_close_uses_the_operand_range(task):
    wide = task.parse_options({"min_operand": 0, "max_operand": 99})
    fns = task.reward_functions(options=wide)
    assert fns["close"]("150", {"answer": "100"}) == pytest.approx(0.5)


def test_is_correct_and_weights(task):
    o = task.parse_options({"reward_weights": {"close": 0.0}})
    assert task.reward_weights(options=o) == {"correct": 1.0, "close": 0.0, "length": 0.25, "format": 0.25}
    s = score_completions(task, o, [{"answer": "7"}] * 2, ["7", "8"])
    assert s.correct == [True, False] and s.totals == pytest.approx([1.5, 0.5])
