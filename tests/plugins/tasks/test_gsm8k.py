"""The gsm8k task: loading local GSM8K-format files, prompts, rewards, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from grpo.core.errors import UserError
from grpo.core.plugins import get_plugins
from grpo.engine.rollout.scoring import score_completions
from grpo.plugins.tasks import (
    GSM8KTask,
    extract_answer,
    parse_ground_truth,
)

# Synthetic GSM8K rows: reasoning with calculator annotations, then '#### N'.
ROWS = [
    {"question": "Janet has 16 eggs, eats 3 and bakes 4. She sells the rest at $2. How much?",
     "answer": "16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n9 * 2 = $<<9*2=18>>18.\n#### 18"},
    {"question": "A car costs 1,234 dollars. What does it cost?", "answer": "It costs 1,234.\n#### 1,234"},
    {"question": "It is 5 degrees and falls by 8. What is it now?", "answer": "5 - 8 = <<5-8=-3>>-3\n#### -3"},
    {"question": "Half of 5?", "answer": "5 / 2 = 2.5\n#### 2.50"},
    {"question": "How much is a million?", "answer": "#### $1,000,000"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def task() -> GSM8KTask:
    return get_plugins().get("task", "gsm8k")


@pytest.fixture
def files(tmp_path):
    return {
        "train": write_jsonl(tmp_path / "train.jsonl", ROWS),
        "test": write_jsonl(tmp_path / "test.jsonl", ROWS[:2]),
    }


def opts(task, **kw):
    return task.parse_options(kw)


# --------------------------------------------------------------------------- ground truth


@pytest.mark.parametrize(
    "answer,truth",
    [
        ("x\n#### 18", "18"),
        ("x\n#### 1,234", "1234"),
        ("#### -3", "-3"),
        ("#### \u22123", "-3"),
        ("#### 2.50", "2.5"),
        ("#### $1,000,000", "1000000"),
        ("#### 18.", "18"),
        ("first #### 5\nthen\n#### 7", "7"),  # the last '####' line counts
        ("#### 12\n", "12"),
        ("42", "42"),  # a bare number is accepted too
    ],
)
def test_parse_ground_truth(answer, truth):
    assert parse_ground_truth(answer) == truth


@pytest.mark.parametrize("answer", ["no hashes here", "#### ", "#### eighteen", "#### 3 or 4", "#### 1,23"])
def test_unreadable_ground_truth(answer):
    with pytest.raises(UserError, match="####|number"):
        parse_ground_truth(answer)


# --------------------------------------------------------------------------- loading


def test_load_local_jsonl(task, files):
    o = opts(task, data_files=files)
    train = task.load(split="train", options=o)
    assert [ex["ground_truth"] for ex in train] == ["18", "1234", "-3", "2.5", "1000000"]
    assert train[0]["question"] == ROWS[0]["question"] and train[0]["answer"] == ROWS[0]["answer"]
    assert [ex["index"] for ex in train] == list(range(5)) and {ex["split"] for ex in train} == {"train"}
    assert len(task.load(split="test", options=o)) == 2
    assert task.load(split="train", options=opts(task, data_files=files, max_examples=3)) == train[:3]


def test_load_local_parquet(task, tmp_path):
    import datasets

    path = tmp_path / "test.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    got = task.load(split="test", options=opts(task, data_files={"test": str(path)}))
    assert [ex["ground_truth"] for ex in got] == ["18", "1234", "-3", "2.5", "1000000"]


def test_several_files_per_split(task, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    b = write_jsonl(tmp_path / "b.jsonl", ROWS[2:])
    got = task.load(split="train", options=opts(task, data_files={"train": [a, b]}))
    assert len(got) == 5


def test_bad_row_names_split_row_and_text(task, tmp_path):
    rows = ROWS[:2] + [{"question": "q", "answer": "so the answer is\n#### eighteen"}] + ROWS[2:]
    o = opts(task, data_files={"train": write_jsonl(tmp_path / "train.jsonl", rows)})
    with pytest.raises(UserError) as err:
        task.load(split="train", options=o)
    msg = str(err.value)
    assert "row 2" in msg and "'train'" in msg and "#### eighteen" in msg and "skip_unparseable" in msg


def test_skip_unparseable_skips_and_counts(task, tmp_path):
    rows = [ROWS[0], {"question": "q", "answer": "no answer line"}, ROWS[1], {"question": "q", "answer": "#### ?"}]
    o = opts(task, data_files={"train": write_jsonl(tmp_path / "train.jsonl", rows)}, skip_unparseable=True)
    examples, stats = task.load_with_stats(split="train", options=o)
    assert [ex["ground_truth"] for ex in examples] == ["18", "1234"]
    assert [ex["index"] for ex in examples] == [0, 2]  # indices of the original rows
    assert (stats.rows_read, stats.kept, stats.skipped) == (4, 2, 2)
    assert "row 1" in stats.skipped_examples[0] and "row 3" in stats.skipped_examples[1]


@pytest.mark.parametrize(
    "row,field",
    [({"answer": "#### 1"}, "question"), ({"question": "q"}, "answer"), ({"question": "q", "answer": None}, "answer")],
)
def test_missing_field_names_the_row(task, tmp_path, row, field):
    rows = [ROWS[0], row]
    o = opts(task, data_files={"test": write_jsonl(tmp_path / "test.jsonl", rows)}, skip_unparseable=True)
    with pytest.raises(UserError, match=rf"row 1: the '{field}' field is missing"):
        task.load(split="test", options=o)


def test_missing_split_file_and_extension(task, tmp_path, files):
    with pytest.raises(UserError, match="no 'validation' split"):
        task.load(split="validation", options=opts(task, data_files=files))
    with pytest.raises(UserError, match="is not a file"):
        task.load(split="test", options=opts(task, data_files={"test": str(tmp_path / "nope.jsonl")}))
    txt = tmp_path / "test.txt"
    txt.write_text("x")
    with pytest.raises(UserError, match="unsupported extension"):
        task.load(split="test", options=opts(task, data_files={"test": str(txt)}))


def test_malformed_jsonl_file_is_a_user_error(task, tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(UserError, match="Could not read task.options.data_files"):
        task.load(split="test", options=opts(task, data_files={"test": str(path)}))


def test_unreachable_hub_dataset_says_to_use_data_files(task):
    o = opts(task, dataset="grpo-tests/no-such-dataset-anywhere")
    with pytest.raises(UserError, match="data_files"):
        task.load(split="test", options=o)


def test_options_are_validated(task):
    from pydantic import ValidationError

    assert opts(task, reward_weights={"format": 0.5}).reward_weights == {"correct": 1.0, "format": 0.5, "tags": 0.0}
    for bad in (
        {"reward_weights": {"corect": 1.0}},
        {"reward_weights": {"correct": float("nan")}},
        {"correct_mode": "lenient"},
        {"answer_format": "boxed"},
        {"answer_tag": "<answer>"},
        {"max_examples": 0},
        {"data_files": {}},
        {"typo": 1},
    ):
        with pytest.raises(ValidationError):
            task.parse_options(bad)


def test_bad_option_in_run_config_names_the_field():
    from grpo.core.config import load_config
    from grpo.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"task.options.reward_weights"):
        load_config({"task": {"name": "gsm8k", "options": {"reward_weights": {"typo": 1}}}})


# --------------------------------------------------------------------------- prompts


def test_prompt_messages(task):
    ex = {"question": "What is 2+2?"}
    msgs = task.prompt_messages(ex, options=opts(task))
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert "<answer>" in msgs[0]["content"] and msgs[1]["content"] == "What is 2+2?"
    hashes = task.prompt_messages(ex, options=opts(task, answer_format="hashes"))
    assert "####" in hashes[0]["content"] and "<answer>" not in hashes[0]["content"]
    assert "<final>" in task.prompt_messages(ex, options=opts(task, answer_tag="final"))[0]["content"]
    assert task.prompt_messages(ex, options=opts(task, system_prompt="Be brief."))[0]["content"] == "Be brief."
    assert task.prompt_messages(ex, options=opts(task, system_prompt="")) == [{"role": "user", "content": "What is 2+2?"}]


# --------------------------------------------------------------------------- rewards

EXTRACT_TABLE = [
    # completion, strict (tag), flexible
    ("so 18\n<answer>18</answer>", 18, 18),
    ("reasoning <answer> $18.00 </answer>", 18, 18),
    ("<answer>18 dollars per day</answer>", 18, 18),
    ("<answer>3 + 4 = 7</answer>", None, 7),
    ("<answer></answer> it is 5", None, 5),
    ("The answer is 18", None, 18),
    ("<answer>5</answer> no wait <answer>7</answer>", 7, 7),
    ("<answer>5</answer> no wait <answer>7", 5, 7),  # the last *complete* block
    ("<answer>1<answer>2</answer>", 2, 2),
    ("<answer>1,234</answer>", 1234, 1234),
    ("<answer>\u22123</answer>", -3, -3),
    ("<Answer>18</Answer>", None, 18),
    ("<answer>18", None, 18),
    ("<answer>18</answer> (rounded to 2 places)", 18, 2),
]


@pytest.mark.parametrize("completion,strict,flexible", EXTRACT_TABLE)
def test_extract_answer_tag(completion, strict, flexible):
    got = extract_answer(completion, mode="strict", answer_format="tag")
    assert (got.value if got else None) == strict
    got = extract_answer(completion, mode="flexible", answer_format="tag")
    assert (got.value if got else None) == flexible


@pytest.mark.parametrize(
    "completion,strict",
    [
        ("9 * 2 = 18\n#### 18", 18),
        ("#### $1,234", 1234),
        ("####-3", -3),
        ("#### 18\nQuestion: next 19", 18),
        ("the answer is 18", None),
        ("#### 3 + 4", None),
    ],
)
def test_extract_answer_hashes(completion, strict):
    got = extract_answer(completion, mode="strict", answer_format="hashes")
    assert (got.value if got else None) == strict


def score_one(task, o, answer, completion):
    example = task.prepare_example({"question": "q", "answer": answer}, options=o)
    return score_completions(task, o, [example], [completion]).rewards[0]


@pytest.mark.parametrize(
    "answer,completion,correct",
    [
        ("#### 1,234", "Adding up.\n<answer>1234</answer>", 1.0),
        ("#### 1234", "Adding up.\n<answer>1,234</answer>", 1.0),
        ("#### 18", "Adding up.\n<answer>$18</answer>", 1.0),
        ("#### 18", "Adding up.\n<answer>18.00</answer>", 1.0),
        ("#### -3", "Adding up.\n<answer>3</answer>", 0.0),
        ("#### 3", "Adding up.\n<answer>-3</answer>", 0.0),
        ("#### -3", "Adding up.\n<answer>\u22123</answer>", 1.0),
        ("#### 18", "Adding up.\n<answer>18.5</answer>", 0.0),
        ("#### 18", "The answer is 18.", 0.0),  # strict: not in the required format
        ("#### 18", "", 0.0),
        ("#### 18", "<answer>" + "9" * 5000 + "</answer>", 0.0),
    ],
)
def test_correct_reward_strict(task, answer, completion, correct):
    assert score_one(task, opts(task), answer, completion)["correct"] == correct


def test_strict_and_flexible_differ_as_documented(task):
    completion = "16 - 3 - 4 = 9 eggs; 9 * 2 = 18 dollars. The answer is 18."
    assert score_one(task, opts(task), "#### 18", completion)["correct"] == 0.0
    assert score_one(task, opts(task, correct_mode="flexible"), "#### 18", completion)["correct"] == 1.0
    # flexible reads the *last* number, wherever it is
    late = "<answer>18</answer> That is 2 more than 16."
    assert score_one(task, opts(task, correct_mode="flexible"), "#### 18", late)["correct"] == 0.0
    assert score_one(task, opts(task), "#### 18", late)["correct"] == 1.0


@pytest.mark.parametrize(
    "completion,fmt,tags",
    [
        ("Reasoning.\n<answer>18</answer>", 1.0, 1.0),
        ("Reasoning.\n<answer>18</answer>\n\n", 1.0, 1.0),
        ("<answer>18</answer>", 0.0, 1.0),  # no reasoning
        ("Reasoning.\n<answer>18</answer> and more", 0.0, 0.75),
        ("Reasoning.\n<answer>eighteen</answer>", 0.0, 1.0),
        ("Reasoning.\n<answer>1</answer><answer>2</answer>", 0.0, 0.25),
        ("Reasoning.\n</answer>18<answer>", 0.0, 0.5),
        ("Reasoning. 18", 0.0, 0.0),
    ],
)
def test_format_and_tags_rewards_tag(task, completion, fmt, tags):
    r = score_one(task, opts(task, reward_weights={"tags": 1.0}), "#### 18", completion)
    assert (r["format"], r["tags"]) == (fmt, tags)


@pytest.mark.parametrize(
    "completion,fmt,tags,correct",
    [
        ("9 * 2 = 18\n#### 18", 1.0, 1.0, 1.0),
        ("9 * 2 = 18\n#### 18\n", 1.0, 1.0, 1.0),
        ("9 * 2 = 18 #### 18", 0.0, 1.0, 1.0),  # not on its own line
        ("#### 18", 0.0, 1.0, 1.0),  # no reasoning
        ("9 * 2 = 18\n#### 18\nQ: next?", 0.0, 0.5, 1.0),
        ("work\n#### 17\n#### 18", 0.0, 0.5, 1.0),
        ("9 * 2 = 18", 0.0, 0.0, 0.0),
    ],
)
def test_format_and_tags_rewards_hashes(task, completion, fmt, tags, correct):
    r = score_one(task, opts(task, answer_format="hashes"), "#### 18", completion)
    assert (r["format"], r["tags"], r["correct"]) == (fmt, tags, correct)


def test_custom_tag(task):
    o = opts(task, answer_tag="final")
    assert score_one(task, o, "#### 7", "ok\n<final>7</final>")["correct"] == 1.0
    assert score_one(task, o, "#### 7", "ok\n<answer>7</answer>")["correct"] == 0.0


def test_rewards_on_loaded_rows_and_weights(task, files):
    o = opts(task, data_files=files, reward_weights={"format": 0.5, "tags": 0.1})
    examples = task.load(split="train", options=o)
    good = [task.reference_completion(ex, options=o) for ex in examples]
    scores = score_completions(task, o, examples, good)
    assert all(r == {"correct": 1.0, "format": 1.0, "tags": 1.0} for r in scores.rewards)
    assert scores.totals == pytest.approx([1.6] * len(examples))
    assert all(scores.correct)
    # the same answers written the way people write them still score
    written = ["Ok.\n<answer>$18</answer>", "Ok.\n<answer>1234</answer>", "Ok.\n<answer>\u22123</answer>",
               "Ok.\n<answer>2.5</answer>", "Ok.\n<answer>1,000,000.00</answer>"]
    assert score_completions(task, o, examples, written).correct == [True] * 5
    wrong = ["Ok.\n<answer>18.01</answer>", "Ok.\n<answer>123</answer>", "Ok.\n<answer>3</answer>",
             "Ok.\n<answer>25</answer>", "Ok.\n<answer>1000</answer>"]
    s = score_completions(task, o, examples, wrong)
    assert s.correct == [False] * 5 and s.totals == pytest.approx([0.6] * 5)


def test_is_correct_follows_the_correct_reward(task):
    o = opts(task)
    assert task.is_correct({"correct": 1.0, "format": 0.0, "tags": 0.0}, options=o)
    assert not task.is_correct({"correct": 0.0, "format": 1.0, "tags": 1.0}, options=o)


def test_package_import_is_light():
    code = (
        "import sys, grpo.plugins.tasks, grpo.plugins.tasks.cli\n"
        "heavy = [m for m in ('datasets', 'jax', 'transformers', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tiny_cpu_recipe_prompt_limit_keeps_its_sample():
    """configs/gsm8k_tiny_cpu.yaml (validated with every config in tests/core/test_config.py;
    its 2-step run, ~80 s on 2 shared cores, is too slow for the suite): every prompt of the
    shipped GSM8K sample fits its rollout.max_prompt_length in the tiny byte-level
    tokenizer with the chat template, and 256 would keep none of them."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from grpo.core.config import load_config
    from grpo.engine.rollout.prompts import render_prompt
    from grpo.plugins.tasks import GSM8KOptions
    from grpo.models.tiny import write_tiny_tokenizer

    root = Path(__file__).parents[3]
    cfg = load_config(root / "configs" / "gsm8k_tiny_cpu.yaml")
    task, opts = GSM8KTask(), GSM8KOptions.model_validate(cfg.task.options)
    files = {split: str(root / path) for split, path in opts.data_files.items()}
    opts = opts.model_copy(update={"data_files": files})
    import tempfile

    tok = AutoTokenizer.from_pretrained(write_tiny_tokenizer(tempfile.mkdtemp()))
    for split in ("train", "test"):
        lengths = [len(tok(render_prompt(task, opts, ex, tok))["input_ids"]) for ex in task.load(split=split, options=opts)]
        assert max(lengths) <= cfg.rollout.max_prompt_length and min(lengths) > 256, (split, max(lengths))
