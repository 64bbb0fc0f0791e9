"""``grpo plan`` compiles the model rewards' programs and counts their memory on the
rollout side (issue 55: plan and bench)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("libtpu")

from conftest import ROOT  # noqa: E402

from grpo.core.config import load_config  # noqa: E402
from grpo.engine.planning.plan import Planner  # noqa: E402
from grpo.engine.planning.reward_plan import add_model_rewards, format_model_rewards  # noqa: E402
from tests._reward_models import preferring_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow


def test_plan_reports_model_rewards(monkeypatch):
    """A reward model and a policy judge on a v6e-8: each one's programs compile, its
    parameters and the judge's KV cache are counted per device, and the plan's peak
    grows by the rewards' resident parameters and their largest program."""
    rm = preferring_checkpoint("7")
    rewards = [
        {"kind": "reward_model", "name": "rm", "checkpoint": str(rm), "micro_batch": 16, "max_length": 64},
        {"kind": "judge", "name": "judge", "template": "{completion}", "max_new_tokens": 4, "max_prompt_length": 32},
        {"kind": "reward_model", "name": "hub", "checkpoint": "org/not-downloaded"},
    ]
    config = load_config(str(ROOT / "configs" / "quickstart.yaml"), ["task.model_rewards=" + json.dumps(rewards)])
    planner = Planner("v6e-8")
    # The run's own plan stands in (what `grpo plan` adds the section to): its peak and fit.
    report = add_model_rewards({"peak_bytes_per_device": 1 << 20, "fits": True}, planner, config)
    section = report["model_rewards"]
    rm_, judge, hub = (section["rewards"][n] for n in ("rm", "judge", "hub"))
    # The reward model: 1 layer of width 32 and a vocabulary of 320 (no output head), bf16, FSDP over 8 devices.
    assert rm_["parameter_bytes_per_device"] < 320 * 32 * 2
    assert list(rm_["programs"]) == ["rm/score"] and rm_["programs"]["rm/score"]["program_bytes"] > 0
    assert set(judge["programs"]) >= {"judge/prefill", "judge/decode"}
    assert judge["kv_cache_bytes_per_device"] > 0
    assert "not_planned" in hub and "org/not-downloaded" in hub["not_planned"]
    assert section["resident_bytes_per_device"] == rm_["parameter_bytes_per_device"] + \
        judge["parameter_bytes_per_device"]
    assert report["peak_bytes_per_device"] == (1 << 20) + section["resident_bytes_per_device"] + \
        section["largest_program_bytes"]
    assert report["fits"] and section["largest_program_bytes"] == max(
        p["program_bytes"] for r in (rm_, judge) for p in r["programs"].values())
    text = format_model_rewards(section)
    assert "rm (reward_model): parameters" in text and "hub (reward_model): not planned" in text
    monkeypatch.setattr("grpo.engine.planning.reward_plan.model_rewards_report", lambda *a: dict(section))
    tight = add_model_rewards({"peak_bytes_per_device": planner.hbm_bytes - 1, "fits": True}, planner, config)
    assert not tight["fits"]
