"""The synthetic arithmetic task: generation, prompts, shaped rewards."""

from __future__ import annotations

import pytest

from grpo.core.errors import UserError
from grpo.core.plugins import get_plugins
from grpo.engine.rollout.prompts import render_prompt
from grpo.engine.rollout.scoring import score_completions
from grpo.plugins.tasks._arithmetic import arithmetic_rewards


@pytest.fixture
def task():
    return get_plugins().get("task", "arithmetic")


def _pair(ex):
    a, b = ex["question"].rstrip("=").split("+")
    return int(a), int(b)


def test_generation_is_deterministic_in_range_and_held_out(task):
    o = task.parse_options({"seed": 3, "num_examples": 300, "num_test_examples": 50, "min_operand": 2, "max_operand": 5})
    train = task.load(split="train", options=o)
    assert train == task.load(split="train", options=o, seed=99)  # options.seed wins over the run seed
    test = task.load(split="test", options=o)
    assert len(train) == 300 and len(test) == 3  # 20% of the 16 distinct prompts, each once
    for ex in train + test:
        a, b = _pair(ex)
        assert ex["answer"] == str(a + b) and 2 <= a <= 5 and 2 <= b <= 5
    train_pairs, test_pairs = {_pair(e) for e in train}, {_pair(e) for e in test}
    assert len(train_pairs) == 13 and not train_pairs & test_pairs  # held out: never trained on
    assert {sum(p) for p in test_pairs} <= {sum(p) for p in train_pairs}  # every test answer is trainable
    other = task.parse_options({"seed": 4, "num_examples": 300, "min_operand": 2, "max_operand": 5})
    assert task.load(split="train", options=other) != train


def test_max_sum_copy_and_large_ranges(task):
    o = task.parse_options({"max_operand": 9, "max_sum": 9, "num_examples": 500})
    train, test = task.load(split="train", options=o, seed=0), task.load(split="test", options=o, seed=0)
    assert len({e["question"] for e in train}) == 44 and len(test) == 11
    assert all(int(e["answer"]) <= 9 for e in train + test)
    assert not {e["question"] for e in train} & {e["question"] for e in test}
    c = task.parse_options({"operation": "copy", "num_examples": 100})
    copies = task.load(split="train", options=c, seed=0) + task.load(split="test", options=c, seed=0)
    assert all(e["question"] == e["answer"] + "=" for e in copies)
    assert len({e["question"] for e in copies}) == 10
    # Too many prompts to list: held out by hash, still disjoint and distinct.
    big = task.parse_options({"max_operand": 10**6, "num_examples": 200, "num_test_examples": 50})
    tr, te = task.load(split="train", options=big, seed=0), task.load(split="test", options=big, seed=0)
    assert len(tr) == 200 and len(te) == len({e["question"] for e in te}) == 50
    assert not {e["question"] for e in tr} & {e["question"] for e in te}
    with pytest.raises(UserError, match="too few"):
        task.load(split="train", options=task.parse_options({"max_operand": 0}))


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


def test_chat_template_option(task, tmp_path):
    from transformers import AutoTokenizer

    from grpo.models.tiny import write_tiny_tokenizer

    tok = AutoTokenizer.from_pretrained(write_tiny_tokenizer(tmp_path))
    ex = {"question": "3+4=", "answer": "7"}
    templated = render_prompt(task, task.parse_options({}), ex, tok)
    assert templated == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(task, task.parse_options({"chat_template": False}), ex, tok) == "3+4="


# completion, truth -> (correct, close, length, format) with S = 10; prefix checked below
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
    # prefix: the leading digit run is the answer, whatever follows
    assert r["prefix"] == (1.0 if expected[1] == 1.0 and expected[2] == 1.0 else 0.0)


def test_default_reward_is_prompt_specific(task):
    """By default only the right answer scores: every wrong answer of a prompt gets 0
    whatever its format (nothing pulls all prompts towards one answer), and the right
    answer scores more once the model stops after it."""
    o = task.parse_options({})
    ex = {"question": "5+7=", "answer": "12"}
    candidates = ["12", "12+3", "13", "11", "1", "9", "x", ""]
    totals = dict(zip(candidates, score_completions(task, o, [ex] * len(candidates), candidates).totals))
    assert totals["12"] == pytest.approx(1.5) and totals["12+3"] == pytest.approx(0.5)
    assert all(totals[c] == 0.0 for c in candidates[2:])


def test_shaping_rewards_when_weighted_in(task):
    """With close/length/format weighted in, nearer answers score more and the exact answer most."""
    o = task.parse_options({"reward_weights": {"close": 0.5, "length": 0.25, "format": 0.25}})
    ex = {"question": "5+7=", "answer": "12"}
    candidates = ["12", "13", "11", "15", "19", "9", "3", "0", "12+3", "x", ""]
    totals = dict(zip(candidates, score_completions(task, o, [ex] * len(candidates), candidates).totals))
    assert max(totals, key=totals.get) == "12"
    assert totals["12"] == pytest.approx(2.5)
    assert totals["13"] == totals["11"] > totals["15"] > totals["19"] > totals["x"] == totals[""] == 0.0
    assert totals["9"] > totals["3"]  # closeness still ranks one-digit answers
    assert totals["12+3"] < totals["12"]  # stopping matters


def test_close_uses_the_operand_range(task):
    wide = task.parse_options({"min_operand": 0, "max_operand": 99})
    fns = task.reward_functions(options=wide)
    assert fns["close"]("150", {"answer": "100"}) == pytest.approx(0.5)


def test_is_correct_and_weights(task):
    o = task.parse_options({"reward_weights": {"format": 0.25, "prefix": 0.0}})
    assert task.reward_weights(options=o) == {"correct": 1.0, "prefix": 0.0, "close": 0.0, "length": 0.0,
                                              "format": 0.25}
    s = score_completions(task, o, [{"answer": "7"}] * 2, ["7", "8"])
    assert s.correct == [True, False] and s.totals == pytest.approx([1.25, 0.25])
