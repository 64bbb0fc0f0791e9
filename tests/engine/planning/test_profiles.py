"""Completion-length profiles (``--lengths``): the built-in one against the figures it is
built from, both file formats, and bad input as exit 2 naming the flag."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from grpo.core.cli import cli
from grpo.core.errors import UserError
from grpo.engine.planning import profiles

GSM8K = "gsm8k-qwen25-3b-v6e8"


def test_builtin_profile_matches_the_measured_run():
    p = profiles.load_profile(GSM8K)
    at_1024 = p.completions(cap=1024)
    # 2,293 valid tokens/s x 15.11 s/step over 128 sequences: 270.7 tokens per sequence.
    assert abs(at_1024.mean() - 2293 * 15.11 / 128) < 1.0
    assert abs((at_1024 == 1024).mean() - 0.03) < 0.002  # some rows at the cap
    assert at_1024.min() >= 1 and np.median(at_1024) < at_1024.mean()  # a long right tail
    # Stated as fractions of the cap: at 2,048 every row keeps its share.
    assert abs(p.completions(cap=2048).mean() - 2 * at_1024.mean()) < 1.0
    assert np.array_equal(profiles.load_profile(GSM8K).completions(cap=1024), at_1024)  # deterministic


def test_clipped_lognormal_against_sampling():
    mu, sigma = profiles.clipped_lognormal(mean=0.3, at_cap=0.05)
    x = np.exp(np.random.default_rng(0).normal(mu, sigma, 400_000))
    assert abs(np.minimum(x, 1.0).mean() - 0.3) < 0.003
    assert abs((x >= 1.0).mean() - 0.05) < 0.002


def test_integer_file_and_samples_jsonl(tmp_path):
    ints = tmp_path / "lengths.txt"
    ints.write_text("# completion lengths\n5\n\n300  # over the cap\n7\n")
    p = profiles.load_profile(str(ints))
    assert p.prompts is None and list(p.completions(cap=100)) == [5, 100, 7]  # clipped at the cap
    prompts, comps = profiles.draw(p, rows=64, cap=100, prompt_length=16, seed=3)
    assert set(prompts) == {16} and set(comps) <= {5, 7, 100}  # prompts at the config's length
    again = profiles.draw(p, rows=64, cap=100, prompt_length=16, seed=3)
    assert np.array_equal(again[1], comps)

    samples = tmp_path / "samples.jsonl"
    rows = [{"step": 1, "completions": ["a", "b"], "completion_lengths": [3, 9], "prompt_length": 11},
            {"step": 2, "completions": ["c"], "completion_lengths": [4], "prompt_length": 20}]
    samples.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    p = profiles.load_profile(str(samples))
    assert list(p.tokens) == [3, 9, 4] and list(p.prompts) == [11, 11, 20]
    prompts, comps = profiles.draw(p, rows=200, cap=8, prompt_length=16, seed=0)
    # Drawn in pairs; prompts longer than the config's are clipped to it, completions to the cap.
    assert set(zip(prompts.tolist(), comps.tolist())) == {(11, 3), (11, 8), (16, 4)}
    s = profiles.summary(p, cap=8, prompt_length=16)
    assert s["mean_completion"] == pytest.approx((3 + 8 + 4) / 3) and s["mean_prompt"] == pytest.approx(38 / 3)


@pytest.mark.parametrize("content, message", [
    ("12\nseven\n", "line 2"),
    ("0\n", "at least 1"),
    ("# nothing\n", "no lengths"),
    ('{"step": 1, "completions": ["x"]}\n', "no completion_lengths"),
    ('{"completion_lengths": [1, -2], "prompt_length": 3}\n', "positive integers"),
    ('{"completion_lengths": [1]\n', "not JSON"),
])
def test_bad_file_names_the_flag(tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(UserError, match=message) as err:
        profiles.load_profile(str(path))
    assert "--lengths" in str(err.value) and err.value.exit_code == 2


def test_plan_with_an_unknown_profile_exits_2_naming_the_flag(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"source": "random", "random": {"preset": "tiny"}},
                                   "task": {"name": "arithmetic"}}))
    res = CliRunner().invoke(cli, ["plan", str(cfg), "--topology", "v6e-8", "--lengths", "no-such-profile"])
    assert res.exit_code == 2 and "--lengths" in res.output and GSM8K in res.output
    assert "Traceback" not in res.output
