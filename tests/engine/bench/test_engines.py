"""``grpo bench rollout --lengths``: both engines on the same rows, each stopped at its
drawn length (tiny model, 8 CPU devices)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from grpo.core.cli import cli
from grpo.engine.planning.profiles import builtin

ARGS = ["bench", "rollout", "--preset", "tiny", "--dtype", "float32", "--batch", "16", "--generations", "2",
        "--prompt-len", "8", "--new-tokens", "12", "--early-stop-chunk", "4", "--repeats", "1", "--seed", "3"]


def test_engines_on_drawn_lengths():
    result = CliRunner().invoke(cli, ARGS + ["--lengths", "gsm8k-qwen25-3b-v6e8", "--slots", "8", "--chunk", "4",
                                             "--page-size", "4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    # The rows' lengths, drawn here from the profile's pool as the bench draws them.
    pool = np.clip(np.rint(builtin("gsm8k-qwen25-3b-v6e8").fractions * 12), 1, 12).astype(int)
    drawn = pool[np.random.default_rng(3).integers(0, len(pool), size=16)]
    static, cont = data["engines"]["static"], data["engines"]["continuous"]
    assert data["drawn_tokens"] == static["valid_tokens"] == cont["valid_tokens"] == drawn.sum()
    assert data["same_tokens"] is True  # same keys: the same rows, token for token
    assert static["decode_steps"] == drawn.max()
    assert static["slot_occupancy"] == round(drawn.sum() / (16 * drawn.max()), 4)
    assert cont["slots"] == 8 and 0 < cont["peak_pages"] <= cont["pool_pages"] and cont["evictions"] == 0
    # every decoded token (all but each row's first, from its prefill) in a slot-step run
    assert 0 < cont["slot_occupancy"] <= cont["computed_occupancy"] <= 1
    assert cont["kv_tokens"] == 4 * cont["peak_pages"] < static["kv_tokens"]
    ratio = cont["valid_tokens_per_s"] / static["valid_tokens_per_s"]
    assert abs(data["continuous_over_static"] - ratio) < 1e-2
    # CPU seconds beside the wall time (a shared machine's load moves the wall time).
    for e in (static, cont):
        assert e["rollout_cpu_s"] > 0
        assert e["valid_tokens_per_cpu_s"] == pytest.approx(e["valid_tokens"] / e["rollout_cpu_s"], rel=1e-2)
    assert data["continuous_over_static_cpu"] == pytest.approx(static["rollout_cpu_s"] / cont["rollout_cpu_s"], rel=1e-2)


def test_engine_needs_lengths():
    result = CliRunner().invoke(cli, ARGS + ["--engine", "continuous"])
    assert result.exit_code == 2 and "--lengths" in result.output and "Traceback" not in result.output


def test_slots_flag_takes_auto_or_a_count():
    """Issue 49 item 7: ``--slots`` defaults to the config's ``auto``; anything but auto or
    a count is refused before any model is built."""
    result = CliRunner().invoke(cli, ARGS + ["--lengths", "gsm8k-qwen25-3b-v6e8", "--slots", "many"])
    assert result.exit_code == 2 and "--slots must be auto" in result.output and "Traceback" not in result.output
    slots = next(p for p in cli.commands["bench"].commands["rollout"].params if p.name == "slots")
    assert slots.default == "auto"
