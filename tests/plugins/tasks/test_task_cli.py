"""`grpo task score` through click's CliRunner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from grpo.core.cli import cli

LINES = [
    {"question": "q1", "answer": "a\n#### 1,234", "completion": "so 1234.\n<answer>$1,234</answer>"},
    {"question": "q2", "answer": "b\n#### -3", "completion": "It is 3.\n<answer>3</answer>"},
    {"question": "q3", "answer": "c\n#### 18", "completion": "It is 18 dollars."},
]


def write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines), encoding="utf-8")
    return str(path)


def invoke(*args, input=None):
    return CliRunner().invoke(cli, list(args), input=input)


def test_score_writes_rewards_and_summary(tmp_path):
    src = write(tmp_path / "in.jsonl", LINES)
    out = tmp_path / "out.jsonl"
    res = invoke("task", "score", "gsm8k", "--input", src, "--output", str(out))
    assert res.exit_code == 0, res.output
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["rewards"]["correct"] for r in rows] == [1.0, 0.0, 0.0]
    assert [r["rewards"]["format"] for r in rows] == [1.0, 1.0, 0.0]
    assert [r["reward"] for r in rows] == pytest.approx([1.2, 0.2, 0.0])
    assert [r["correct"] for r in rows] == [True, False, False]
    for r, src_line in zip(rows, LINES):  # the input fields come back unchanged
        assert {k: r[k] for k in src_line} == src_line
    assert "correct" in res.stderr and "0.3333" in res.stderr and "scored 3 completion(s)" in res.stderr
    assert res.stdout == ""


def test_score_to_stdout_with_options(tmp_path):
    src = write(tmp_path / "in.jsonl", LINES)
    res = invoke(
        "task", "score", "gsm8k", "--input", src,
        "--set", "task.options.correct_mode=flexible", "--set", "task.options.reward_weights.format=0",
    )
    assert res.exit_code == 0, res.output
    rows = [json.loads(l) for l in res.stdout.splitlines()]
    assert [r["rewards"]["correct"] for r in rows] == [1.0, 0.0, 1.0]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0]


def test_score_from_stdin(tmp_path):
    res = invoke("task", "score", "arithmetic", "--input", "-",
                 input='{"question": "3+4=", "answer": "7", "completion": "7"}\n')
    assert res.exit_code == 0, res.output
    row = json.loads(res.stdout)
    assert row["rewards"] == {"correct": 1.0, "prefix": 1.0, "close": 1.0, "length": 1.0, "format": 1.0}
    assert row["reward"] == 1.5


def test_malformed_lines_are_named(tmp_path):
    src = write(
        tmp_path / "in.jsonl",
        [LINES[0], "", "{not json", json.dumps([1, 2]), {"question": "q", "answer": "#### 1"},
         {"question": "q", "answer": "#### one", "completion": "x"}, {"answer": "#### 1", "completion": "1"}],
    )
    res = invoke("task", "score", "gsm8k", "--input", src)
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    err = res.stderr
    assert "5 malformed line(s)" in err
    assert "line 3: not valid JSON" in err
    assert "line 4: expected a JSON object" in err
    assert "line 5: the 'completion' field is missing" in err
    assert "line 6: cannot read a number" in err and "#### one" in err
    assert "line 7: the 'question' field is missing" in err
    assert "line 1:" not in err and "line 2:" not in err


def test_skip_unparseable_applies_to_score(tmp_path):
    src = write(tmp_path / "in.jsonl", [LINES[0], {"question": "q", "answer": "#### one", "completion": "x"}])
    res = invoke("task", "score", "gsm8k", "--input", src, "--set", "task.options.skip_unparseable=true")
    assert res.exit_code == 0, res.output
    assert len(res.stdout.splitlines()) == 1 and "skipped 1 line(s)" in res.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["task", "score", "nosuchtask", "--input", "IN"], "Unknown task plugin 'nosuchtask'"),
        (["task", "score", "gsm8k", "--input", "missing.jsonl"], "is not a file"),
        (["task", "score", "gsm8k", "--input", "IN", "--set", "task.options.correct_mode=lenient"],
         "task.options.correct_mode"),
        (["task", "score", "gsm8k", "--input", "IN", "--set", "task.options.reward_weights.typo=1"], "unknown reward"),
        (["task", "score", "gsm8k", "--input", "IN", "--set", "task.name=arithmetic"], "only the task's options"),
        (["task", "score", "gsm8k", "--input", "IN", "--set", "novalue"], "KEY=VALUE"),
        (["task", "score", "gsm8k", "--input", "EMPTY"], "holds no records"),
    ],
)
def test_user_errors_exit_2(tmp_path, args, message):
    src = write(tmp_path / "in.jsonl", LINES)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    args = [{"IN": src, "EMPTY": str(empty)}.get(a, a) for a in args]
    res = invoke(*args)
    assert res.exit_code == 2, res.output
    assert message in res.stderr and "Traceback" not in res.output


def test_reward_errors_are_reported_not_fatal(tmp_path, monkeypatch):
    from grpo.plugins.tasks._gsm8k import GSM8KTask

    original = GSM8KTask.reward_functions

    def broken(self, *, options):
        fns = dict(original(self, options=options))

        def tags(completion, example):
            raise RuntimeError("tag counter bug")

        fns["tags"] = tags
        return fns

    monkeypatch.setattr(GSM8KTask, "reward_functions", broken)
    src = write(tmp_path / "in.jsonl", LINES)
    res = invoke("task", "score", "gsm8k", "--input", src)
    assert res.exit_code == 0, res.output
    rows = [json.loads(l) for l in res.stdout.splitlines()]
    assert all(r["reward_errors"] == ["tags"] and r["rewards"]["tags"] == 0.0 for r in rows)
    assert [r["rewards"]["correct"] for r in rows] == [1.0, 0.0, 0.0]
    assert "RuntimeError: tag counter bug" in res.stderr and "failed on 3 completion(s)" in res.stderr


def test_not_applicable_rewards_are_reported_not_as_errors(tmp_path, monkeypatch):
    """Issue 49 item 2: a reward returning None or NaN is "not applicable", counted as such
    in `grpo task score`'s summary and never as an error."""
    from grpo.plugins.tasks._gsm8k import GSM8KTask

    original = GSM8KTask.reward_functions

    def with_nan(self, *, options):
        fns = dict(original(self, options=options))
        fns["tags"] = lambda completion, example: float("nan")
        return fns

    monkeypatch.setattr(GSM8KTask, "reward_functions", with_nan)
    res = invoke("task", "score", "gsm8k", "--input", write(tmp_path / "in.jsonl", LINES))
    assert res.exit_code == 0, res.output
    rows = [json.loads(l) for l in res.stdout.splitlines()]
    assert all("reward_errors" not in r and r["rewards"]["tags"] == 0.0 for r in rows)
    assert "reward 'tags' was not applicable (None or NaN, scored 0) to 3 completion(s)" in res.stderr
    assert "failed on" not in res.stderr
