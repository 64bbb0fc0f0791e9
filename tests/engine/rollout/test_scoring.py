"""Task-independent helpers: exception-safe scoring, pass@k / mean@n, prompt rendering, the
overlong penalty."""

from __future__ import annotations

import itertools
import math
from typing import ClassVar

import numpy as np
import pytest

from grpo.core.contracts import NoOptions, TaskPlugin
from grpo.engine.eval_metrics import evaluate_completions, group_metrics, pass_at_k
from grpo.engine.rollout.prompts import render_messages, render_prompt
from grpo.engine.rollout.scoring import score_completions


class FlakyTask(TaskPlugin):
    """Rewards: `len` (always works), `boom` (raises on 'x'), `nan` (NaN on 'n': not applicable), `text` (wrong
    type on 't')."""

    name: ClassVar[str] = "flaky"
    Options = NoOptions

    def load(self, *, split, options, seed=0):
        return [{"question": "q"}]

    def prompt_messages(self, example, *, options):
        return [{"role": "system", "content": "sys"}, {"role": "user", "content": example["question"]}]

    def reward_functions(self, *, options):
        def length(c, ex):
            return min(len(c), 4) / 4

        def boom(c, ex):
            if "x" in c:
                raise ZeroDivisionError("boom on x")
            return True

        def nan(c, ex):
            return float("nan") if "n" in c else 1

        def text(c, ex):
            return "1.0" if "t" in c else 0.5

        return {"len": length, "boom": boom, "nan": nan, "text": text}

    def reward_weights(self, *, options):
        return {"len": 2.0, "boom": 1.0, "nan": 1.0}  # `text` defaults to 1.0


def test_failing_rewards_score_zero_and_are_counted():
    task = FlakyTask()
    completions = ["ab", "xx", "nx", "abcdef", "t"]
    s = score_completions(task, NoOptions(), [{"question": "q"}] * 5, completions)
    assert s.names == ("len", "boom", "nan", "text")
    assert s.weights == {"len": 2.0, "boom": 1.0, "nan": 1.0, "text": 1.0}
    assert s.rewards[0] == {"len": 0.5, "boom": 1.0, "nan": 1.0, "text": 0.5}
    assert s.rewards[1] == {"len": 0.5, "boom": 0.0, "nan": 1.0, "text": 0.5}
    assert s.rewards[2] == {"len": 0.5, "boom": 0.0, "nan": 0.0, "text": 0.5}
    assert s.rewards[4]["text"] == 0.0
    assert s.errors == {"len": 0, "boom": 2, "nan": 0, "text": 1}
    assert s.first_errors["boom"] == "ZeroDivisionError: boom on x" and s.first_error_rows["boom"] == 1
    assert "nan" not in s.first_errors and "str" in s.first_errors["text"] and s.first_error_rows["text"] == 4
    assert s.failed == [(), ("boom",), ("boom",), (), ("text",)]
    assert s.not_applicable == {"len": 0, "boom": 0, "nan": 1, "text": 0}
    assert s.inapplicable == [(), (), ("nan",), (), ()]
    assert s.totals == pytest.approx([3.5, 2.5, 1.5, 4.5, 0.5 + 1 + 1 + 0])
    assert s.correct == [False, False, False, False, False]
    m = s.metrics()
    assert m["reward/boom/errors"] == 2.0 and m["reward/len/errors"] == 0.0 and m["reward/nan/errors"] == 0.0
    assert m["reward/nan/not_applicable"] == 1.0 and "reward/len/not_applicable" not in m
    assert m["reward/boom/mean"] == pytest.approx(3 / 5)
    assert m["reward/total/mean"] == pytest.approx(sum(s.totals) / 5)
    assert m["reward/total/std"] == pytest.approx(math.sqrt(sum((t - sum(s.totals) / 5) ** 2 for t in s.totals) / 5))
    assert m["reward/accuracy"] == 0.0


class _OneReward(TaskPlugin):
    name: ClassVar[str] = "one"
    Options = NoOptions

    def __init__(self, fn):
        self.fn = fn

    def load(self, *, split, options, seed=0):
        return []

    def prompt_messages(self, example, *, options):
        return [{"role": "user", "content": "q"}]

    def reward_functions(self, *, options):
        return {"r": self.fn}


def test_none_and_nan_are_not_applicable_and_infinity_is_an_error():
    """Issue 49 item 2: None and NaN mean "not applicable" (0 in the total, as TRL's nansum
    adds them), counted as such and never as errors; an infinity stays an error."""
    values = {"a": None, "b": float("nan"), "c": np.float32("nan"), "d": float("inf"), "e": 0.5}
    s = score_completions(_OneReward(lambda c, ex: values[c]), NoOptions(), [{}] * 5, list("abcde"))
    assert s.totals == [0.0, 0.0, 0.0, 0.0, 0.5]
    assert s.not_applicable == {"r": 3} and s.errors == {"r": 1}
    assert s.inapplicable == [("r",), ("r",), ("r",), (), ()] and s.failed == [(), (), (), ("r",), ()]
    assert "inf" in s.first_errors["r"] and s.first_error_rows["r"] == 3


def test_scoring_rejects_mismatched_inputs_and_bad_weights():
    task = FlakyTask()
    with pytest.raises(ValueError, match="2 examples but 1 completions"):
        score_completions(task, NoOptions(), [{}, {}], ["a"])

    class Stray(FlakyTask):
        def reward_weights(self, *, options):
            return {"lenn": 1.0}

    with pytest.raises(ValueError, match="lenn"):
        score_completions(Stray(), NoOptions(), [{}], ["a"])


def test_empty_batch():
    s = score_completions(FlakyTask(), NoOptions(), [], [])
    assert len(s) == 0 and s.metrics()["reward/total/mean"] == 0.0


# --------------------------------------------------------------------------- pass@k


def brute_pass_at_k(n, c, k):
    """Fraction of k-subsets of n samples (c correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n=n, c=c, k=k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)
            assert pass_at_k(n=n, c=c, k=k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_edge_cases():
    assert pass_at_k(n=200, c=0, k=100) == 0.0
    assert pass_at_k(n=200, c=101, k=100) == 1.0
    assert pass_at_k(n=1000, c=1, k=1) == pytest.approx(0.001)
    assert 0.0 < pass_at_k(n=1000, c=3, k=10) < 1.0
    for bad in ({"n": 4, "c": 5, "k": 1}, {"n": 4, "c": 1, "k": 5}, {"n": 4, "c": 1, "k": 0}, {"n": 0, "c": 0, "k": 1}):
        with pytest.raises(ValueError):
            pass_at_k(**bad)


def test_group_metrics():
    groups = [[True, False, False, False], [False] * 4, [True] * 4]
    m = group_metrics(groups, ks=[1, 2, 4])
    assert m["pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert m["mean@4"] == pytest.approx(m["pass@1"])  # pass@1 from n samples is mean@n
    assert m["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["num_prompts"] == 3 and m["num_samples"] == 4
    assert set(group_metrics(groups)) == {"pass@1", "pass@4", "mean@4", "num_prompts", "num_samples"}
    greedy = group_metrics([[True], [False], [True], [True]])
    assert greedy["pass@1"] == 0.75 and greedy["mean@1"] == 0.75
    with pytest.raises(ValueError, match="same number"):
        group_metrics([[True], [True, False]])
    with pytest.raises(ValueError, match="1 <= k <= n"):
        group_metrics([[True, False]], ks=[3])


def test_evaluate_completions_on_arithmetic():
    from grpo.core.plugins import get_plugins

    task = get_plugins().get("task", "arithmetic")
    o = task.parse_options({})
    examples = [{"question": "1+1=", "answer": "2"}, {"question": "4+5=", "answer": "9"}, {"question": "9+9=", "answer": "18"}]
    samples = [["2", "3", "2"], ["8", "8", "x"], ["18", "18", "18"]]
    res = evaluate_completions(task, o, examples, samples, ks=[1, 3])
    assert res.groups == [[True, False, True], [False, False, False], [True, True, True]]
    assert res.metrics["pass@1"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert res.metrics["pass@3"] == pytest.approx(2 / 3)
    assert res.metrics["mean@3"] == pytest.approx(res.metrics["pass@1"])
    assert res.metrics["reward/correct/mean"] == pytest.approx(5 / 9)
    assert len(res.scores) == 9 and res.scores.rewards[3]["close"] == pytest.approx(0.9)


# --------------------------------------------------------------------------- prompts


def test_render_without_chat_template_joins_contents():
    task = FlakyTask()
    assert render_prompt(task, NoOptions(), {"question": "3+4="}, None) == "sys\n\n3+4="
    assert render_messages([{"role": "user", "content": "3+4="}], object()) == "3+4="


def test_render_with_a_chat_template():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "3": 1, "+": 2, "4": 3, "=": 4}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    assert render_prompt(FlakyTask(), NoOptions(), {"question": "3+4="}, tok) == "sys\n\n3+4="  # no template yet
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    got = render_prompt(FlakyTask(), NoOptions(), {"question": "3+4="}, tok)
    assert got == "<|system|>sys\n<|user|>3+4=\n<|assistant|>"


def test_overlong_penalty_matches_the_dapo_formula():
    from grpo.engine.rollout.scoring import overlong_penalty

    lengths = np.arange(0, 17)
    got = overlong_penalty(lengths, max_new_tokens=16, buffer=4, factor=0.5)
    want = [min(-(L - (16 - 4)) / 4 * 0.5, 0.0) for L in lengths]  # 0 up to 12 tokens, -0.5 at 16
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
    assert got.dtype == np.float32 and got[12] == 0.0 and got[16] == -0.5
    with pytest.raises(ValueError, match="buffer=16"):
        overlong_penalty(lengths, max_new_tokens=16, buffer=16, factor=1.0)
