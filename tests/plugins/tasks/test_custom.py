"""The ``custom`` task: TRL-convention reward functions by import path on a named-column
dataset; bad references and missing columns exit 2 naming the field."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml
from click.testing import CliRunner

from grpo.core.cli import cli
from grpo.core.errors import UserError
from grpo.core.references import forget, register
from grpo.engine.rollout.prompts import render_prompt
from grpo.engine.rollout.scoring import score_completions
from grpo.plugins.tasks import CustomOptions, CustomTask

# Written for TRL's GRPOTrainer, as its docs show them; used here unchanged.
TRL_REWARDS = '''
import re

def think_format(completions, **kwargs):
    """TRL's think_format_reward shape: conversational completions (lists of one message)."""
    pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
    return [1.0 if re.match(pattern, c[0]["content"], re.DOTALL) else 0.0 for c in completions]

def match_solution(completions, prompts, solution, **kwargs):
    return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]

def only_long(completions, **kwargs):
    """None: not applicable (TRL: NaN, left out of the nansum)."""
    return [None if len(c) < 3 else 0.5 for c in completions]

def named_only(completions, prompts, level):
    return [float(v) for v in level]

def needs_ids(completions, completion_ids, **kwargs):
    return [0.0 for _ in completions]

def wrong(text):
    return [0.0]

not_callable = 3
'''


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "trl_style.py").write_text(textwrap.dedent(TRL_REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _options(**kw):
    return CustomOptions.model_validate(kw)


def test_trl_reward_functions_work_unchanged_plain_text(rewards_module):
    task = CustomTask()
    opts = _options(rewards=["trl_style:match_solution", "trl_style:only_long", "trl_style:named_only"],
                    reward_weights=[1.0, 2.0, 0.5], chat_template=False)
    examples = [{"prompt": "2+2=", "solution": "4", "level": 3}, {"prompt": "1+1=", "solution": "2", "level": 1}]
    scores = score_completions(task, opts, examples, ["4", "wrong"])
    assert scores.names == ("match_solution", "only_long", "named_only")
    assert scores.rewards == [
        {"match_solution": 1.0, "only_long": 0.0, "named_only": 3.0},  # None -> 0 (TRL's nansum)
        {"match_solution": 0.0, "only_long": 0.5, "named_only": 1.0},
    ]
    assert scores.totals == [1.0 + 0.0 + 1.5, 0.0 + 1.0 + 0.5]
    assert sum(scores.errors.values()) == 0
    assert scores.correct == [True, False]  # judged by the first function (correct_reward unset)
    shaped = opts.model_copy(update={"correct_reward": "only_long"})
    assert score_completions(task, shaped, examples, ["4", "wrong"]).correct == [False, False]
    assert render_prompt(task, opts, examples[0]) == "2+2="


def test_trl_reward_functions_work_unchanged_conversational(rewards_module):
    task = CustomTask()
    opts = _options(rewards=["trl_style:think_format"], system_prompt="Think first.")
    prompt = [{"role": "user", "content": "Why?"}]
    ex = task.prepare_example({"prompt": prompt}, options=opts)
    assert task.prompt_messages(ex, options=opts) == [{"role": "system", "content": "Think first."}, *prompt]
    scores = score_completions(task, opts, [ex, ex], ["<think>because</think> so", "no tags"])
    assert [r["think_format"] for r in scores.rewards] == [1.0, 0.0] and scores.correct == [True, False]


def test_in_memory_data_and_callables_by_session_name(rewards_module):
    seen = []

    def reward(completions, prompts, **columns):
        seen.append((completions, prompts, columns))
        return [1.0]

    opts = _options(rewards=[register("t_reward", reward)], data_files={"train": register("t_rows", [{"q": "a", "x": 1}])},
                    prompt_column="q")
    try:
        examples = CustomTask().load(split="train", options=opts)
        score_completions(CustomTask(), opts, examples, ["out"])
    finally:
        forget("session:t_reward"), forget("session:t_rows")
    assert seen == [(["out"], ["a"], {"x": [1]})]


def _validate(tmp_path, options):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"source": "random", "random": {"preset": "tiny"}},
                                    "task": {"name": "custom", "options": options}}))
    return CliRunner().invoke(cli, ["config", "validate", str(path)])


@pytest.mark.parametrize("ref, message", [
    ("no_such_module:fn", "cannot import module 'no_such_module'"),
    ("trl_style:missing", "has no attribute 'missing'"),
    ("not a path", "is not an import path"),
    ("trl_style:not_callable", "is a int, not a function"),
    ("trl_style:wrong", "wrong signature: it cannot take completions and prompts by keyword"),
])
def test_bad_reward_references_exit_2_naming_the_field(rewards_module, ref, message):
    result = _validate(rewards_module, {"rewards": ["trl_style:only_long", ref],
                                        "data_files": {"train": "x.jsonl"}})
    assert result.exit_code == 2, result.output
    assert "task.options.rewards[1]:" in result.output and message in result.output
    assert "Traceback" not in result.output


def test_missing_columns_exit_2_naming_the_field(rewards_module, tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "2+2=", "answer": "4"}) + "\n")
    base = {"rewards": ["trl_style:only_long"], "data_files": {"train": "d.jsonl"}}
    cases = [
        (dict(base), "task.options.prompt_column: the column 'prompt' is not in split 'train' (d.jsonl)"),
        (dict(base, prompt_column="question", answer_column="solution"), "task.options.answer_column: the column"),
        (dict(base, prompt_column="question", rewards=["trl_style:match_solution"]),
         "task.options.rewards[0]: match_solution requires the argument(s) 'solution'"),
        (dict(base, prompt_column="question", correct_reward="nope"), "task.options.correct_reward: no reward named"),
        (dict(base, prompt_column="question", rewards=["trl_style:needs_ids"]),
         # Issue 49 item 8: named as what grpo does not pass, not as a missing column.
         "task.options.rewards[0]: needs_ids requires 'completion_ids', which TRL's GRPOTrainer passes and grpo "
         "does not"),
    ]
    for options, message in cases:
        with pytest.raises(UserError) as err:
            CustomTask().load(split="train", options=_options(**options))
        assert message in str(err.value), str(err.value)
    # One weight per function, checked at load.
    assert _validate(tmp_path, dict(base, reward_weights=[1.0, 2.0])).exit_code == 2
    assert CustomTask().load(split="train", options=_options(**dict(base, prompt_column="question")))[0] == {
        "question": "2+2=", "answer": "4"}


def test_missing_column_through_grpo_run_exits_2(rewards_module, tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "2+2=", "answer": "4"}) + "\n")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"source": "random", "random": {"preset": "tiny"}},
        "rollout": {"num_generations": 2, "max_prompt_length": 16, "max_new_tokens": 2},
        "task": {"name": "custom", "options": {"rewards": ["trl_style:only_long"], "data_files": {"train": "d.jsonl"}}},
        "train": {"steps": 1, "prompts_per_step": 8}, "logging": {"progress_bar": False, "plot": False},
    }))
    result = CliRunner().invoke(cli, ["run", str(path), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "task.options.prompt_column: the column 'prompt' is not in split 'train'" in result.output


class FakeTensor:
    """What a torch tensor offers a reward's caller (torch is not needed): ``tolist()``,
    iteration over 0-d tensors (which are not floats), and ``len``."""

    def __init__(self, values):
        self.values = [float(v) for v in values]

    def tolist(self):
        return list(self.values)

    def __iter__(self):
        return iter(FakeScalar(v) for v in self.values)

    def __len__(self):
        return len(self.values)


class FakeScalar:
    def __init__(self, v):
        self.v = v

    def __float__(self):
        return self.v


def _by_length(completions):
    return [min(len(c), 4) / 4 for c in completions]


def test_any_iterable_of_numbers_is_a_reward_return(rewards_module):
    """Issue 49 item 2: a TRL reward function returning a list, a tuple, a NumPy array or a
    tensor (anything with tolist()) scores the same; before, only a Sequence was accepted
    and every other return scored 0 as an error on every completion."""
    import numpy as np

    returns = {
        "as_list": lambda completions, **kw: list(_by_length(completions)),
        "as_tuple": lambda completions, **kw: tuple(_by_length(completions)),
        "as_ndarray": lambda completions, **kw: np.asarray(_by_length(completions), np.float32),
        "as_tensor": lambda completions, **kw: FakeTensor(_by_length(completions)),
        "as_generator": lambda completions, **kw: (v for v in _by_length(completions)),
    }
    examples, completions = [{"prompt": "2+2="}] * 3, ["4", "four", "forty-four"]
    got = {}
    for name, fn in returns.items():
        fn.__name__ = name
        opts = _options(rewards=[register(f"t_{name}", fn)])
        try:
            scores = score_completions(CustomTask(), opts, examples, completions)
        finally:
            forget(f"session:t_{name}")
        assert scores.errors == {name: 0}, scores.first_errors
        got[name] = scores.totals
    assert all(v == [0.25, 1.0, 1.0] for v in got.values()), got


def test_nan_in_an_array_is_not_applicable_and_a_wrong_length_is_an_error(rewards_module):
    """Issue 49 item 2: NaN (here inside a NumPy array) means "not applicable", like None:
    0 in the total and counted as not applicable, not as an error; a wrong length is an
    error naming the function."""
    import numpy as np

    def nan_for_short(completions, **kw):
        return np.asarray([np.nan if len(c) < 3 else 1.0 for c in completions])

    def two_values(completions, **kw):  # one too many, in the step's call and row by row alike (issue 55)
        return np.zeros(len(completions) + 1)

    def text(completions, **kw):
        return "1.0"

    opts = _options(rewards=[register("t_nan", nan_for_short), register("t_two", two_values),
                             register("t_text", text)])
    try:
        scores = score_completions(CustomTask(), opts, [{"prompt": "q"}] * 2, ["ab", "abcd"])
    finally:
        for n in ("t_nan", "t_two", "t_text"):
            forget(f"session:{n}")
    assert [r["nan_for_short"] for r in scores.rewards] == [0.0, 1.0]
    assert scores.not_applicable["nan_for_short"] == 1 and scores.errors["nan_for_short"] == 0
    assert scores.errors["two_values"] == 2 and scores.errors["text"] == 2
    assert ("task.options.rewards[1] (two_values) returned 2 value(s) for 1 completion(s)"
            in scores.first_errors["two_values"])
    assert "task.options.rewards[2] (text) returned str" in scores.first_errors["text"]


class TemplateTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt, **kwargs):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_chat_template_auto_is_trls_rule(rewards_module):
    """Issue 49 item 8: by default (``auto``) a plain-text prompt is used verbatim and a
    conversational one goes through the chat template, as TRL does; true and false still
    template every prompt or none. Before, the default templated plain text too."""
    task, tok = CustomTask(), TemplateTokenizer()
    text = task.prepare_example({"prompt": "2+2="}, options=_options(rewards=["trl_style:only_long"]))
    chat = {"prompt": [{"role": "user", "content": "2+2="}]}
    expected = {
        None: ("2+2=", "<user>2+2=<assistant>"),
        "auto": ("2+2=", "<user>2+2=<assistant>"),
        True: ("<user>2+2=<assistant>", "<user>2+2=<assistant>"),
        False: ("2+2=", "2+2="),
    }
    for setting, (plain, conversational) in expected.items():
        extra = {} if setting is None else {"chat_template": setting}
        opts = _options(rewards=["trl_style:only_long"], **extra)
        assert render_prompt(task, opts, text, tok) == plain, setting
        assert render_prompt(task, opts, chat, tok) == conversational, setting
    assert _options(rewards=["trl_style:only_long"]).chat_template == "auto"
    assert task.uses_chat_template(options=_options(rewards=["trl_style:only_long"]))  # multi-turn may template
