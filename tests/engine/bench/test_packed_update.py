"""``grpo bench update``: the rows it draws, and its JSON (tiny, one timed update each way)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from grpo.core.cli import cli
from grpo.engine.bench.packed_update import synthetic_rows
from grpo.engine.programs import RunPrograms


def test_synthetic_rows_have_the_drawn_lengths():
    prompts, completions = np.array([3, 8, 1]), np.array([5, 1, 12])
    rows = synthetic_rows(prompts=prompts, completions=completions, prompt_len=8, new_tokens=12, vocab=50, seed=0)
    assert rows["prompt_mask"].sum(1).tolist() == [3, 8, 1] and rows["mask"].sum(1).tolist() == [5, 1, 12]
    assert rows["prompt_mask"][0].tolist() == [0] * 5 + [1] * 3  # left-padded, as the rollout pads prompts
    assert rows["mask"][0].tolist() == [1] * 5 + [0] * 7
    for tok, mask in ((rows["prompt_tokens"], rows["prompt_mask"]), (rows["tokens"], rows["mask"])):
        assert ((tok > 0) == (mask > 0)).all() and tok.max() < 50


def test_bad_lengths_exit_2_naming_the_flag(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("ten\n")
    res = CliRunner().invoke(cli, ["bench", "update", "--lengths", str(bad)])
    assert res.exit_code == 2 and "--lengths" in res.output and "Traceback" not in res.output


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(RunPrograms, "pack_plan"), reason="needs the builder's packed update (packing branch)")
def test_bench_update_json(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("4\n12\n")
    res = CliRunner().invoke(cli, ["bench", "update", "--lengths", str(lengths), "--rows", "16", "--prompt-len", "8",
                                   "--new-tokens", "24", "--micro-batch", "16", "--iters", "1", "--json"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ("padded_s", "packed_s", "pack_s", "ratio", "valid_tokens_per_s_padded", "valid_tokens_per_s_packed",
                "bins", "efficiency"):
        assert out[key] > 0, key
    # 16 sequences of 12 or 20 real tokens in bins of 32: at most 2 a bin, at least 16 x 12 / 32.
    assert 6 <= out["bins_used"] <= out["bins"] <= 16 and out["bin_length"] == 32
    assert out["valid_tokens"] in range(16 * 4, 16 * 12 + 1) and out["padded_tokens"] == 16 * 32
    assert out["efficiency"] == pytest.approx(out["real_tokens"] / (out["bins"] * 32))
    # The same rows, the same parameters: the same loss (f32).
    assert out["loss_packed"] == pytest.approx(out["loss_padded"], abs=1e-5)
    assert out["ratio"] == pytest.approx((out["pack_s"] + out["packed_s"]) / out["padded_s"])
    # The trainer's schedule: m micro-batches of per bins on each device, no more bins than that.
    assert out["bins"] == out["micro_batches_packed"] * out["bins_per_device"] * out["devices"]
    # The head runs on the completion slots (at most 12 of a sequence's 20 real tokens), rounded up.
    assert out["head_width"] < out["bins_per_device"] * 32
    assert out["cpu_ratio"] == pytest.approx(out["cpu_s"]["packed"] / out["cpu_s"]["padded"])
    # XLA's count of the compiled work: fewer flops and bytes packed (32-slot bins for 32-slot rows).
    assert set(out["compiled"]["padded"]) == {"flops", "bytes_accessed", "transcendentals"}
    assert out["flops_ratio"] == pytest.approx(out["compiled"]["packed"]["flops"] / out["compiled"]["padded"]["flops"])
    assert 0 < out["flops_ratio"] < 1 and 0 < out["bytes_ratio"] < 1
