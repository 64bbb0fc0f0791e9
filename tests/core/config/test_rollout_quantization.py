"""``rollout.quantization`` (issue 53): what a config may ask of a low-precision rollout,
and every refusal exits 2 naming the field."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from conftest import ROOT

from grpo.core.cli import cli
from grpo.core.config import load_config
from grpo.core.config.engine import quantization_platform_problems
from grpo.core.config.fingerprint import fingerprint

QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def _validate(*sets):
    args = ["config", "validate", QUICKSTART]
    for s in sets:
        args += ["--set", s]
    return CliRunner().invoke(cli, args)


def test_defaults_are_off_and_a_quantized_rollout_defines_another_run():
    base = load_config(QUICKSTART)
    q = base.rollout.quantization
    assert (q.weights, q.kv_cache, q.weight_scales, q.kv_scales, q.enabled) == ("none", "none", "channel", "token", False)
    int8 = load_config(QUICKSTART, ["rollout.quantization.weights=int8"])
    assert int8.rollout.quantization.enabled
    assert fingerprint(int8) != fingerprint(base)  # its samples differ: a resume must not mix them


@pytest.mark.parametrize("sets", [
    ["rollout.quantization.weights=int8"],
    ["rollout.quantization.weights=fp8"],
    ["rollout.engine=continuous", "rollout.quantization.weights=int8", "rollout.quantization.kv_cache=int8"],
    ["rollout.engine=continuous", "rollout.quantization.kv_cache=fp8"],
])
def test_what_the_built_in_engines_take(sets):
    res = _validate(*sets)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("sets, message", [
    (["rollout.quantization.kv_cache=int8"],
     "rollout.quantization.kv_cache=int8: rollout.engine='static' keeps its KV cache in the compute dtype"),
    (["rollout.quantization.weights=int4"], "rollout.quantization.weights"),
    (["rollout.quantization.kv_scales=page"], "rollout.quantization.kv_scales"),
    (["rollout.quantization.weights=int8", "model.lora.rank=4", "model.lora.base_quantization=nf4"],
     "rollout.quantization.weights=int8 with model.lora.base_quantization=nf4"),
])
def test_refusals_name_the_field_and_exit_2(sets, message):
    res = _validate(*sets)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert "Traceback" not in res.output


def test_fp8_is_refused_on_a_tpu_only():
    cfg = load_config(QUICKSTART, ["rollout.engine=continuous", "rollout.quantization.weights=fp8",
                                   "rollout.quantization.kv_cache=fp8"])
    problems = quantization_platform_problems(cfg.rollout, "tpu")
    assert [p.split(" on a TPU")[0] for p in problems] == ["rollout.quantization.weights=fp8",
                                                           "rollout.quantization.kv_cache=fp8"]
    assert quantization_platform_problems(cfg.rollout, "gpu") == []
    assert quantization_platform_problems(cfg.rollout, "cpu") == []
    int8 = load_config(QUICKSTART, ["rollout.quantization.weights=int8"])
    assert quantization_platform_problems(int8.rollout, "tpu") == []


def test_the_head_is_quantized_only_with_the_weights():
    """Issue 53, item 4: ``rollout.quantization.head`` defaults to none (the head in the
    compute dtype, as vLLM and verl keep it); int8 goes with int8/fp8 weights, and alone it
    exits 2 naming the field; it defines another run (its samples differ)."""
    assert load_config(QUICKSTART).rollout.quantization.head == "none"
    assert _validate("rollout.quantization.weights=int8", "rollout.quantization.head=int8").exit_code == 0
    bad = _validate("rollout.quantization.head=int8")
    assert bad.exit_code == 2 and "rollout.quantization.head=int8" in bad.output
    assert "set rollout.quantization.weights" in bad.output and "Traceback" not in bad.output
    weights = load_config(QUICKSTART, ["rollout.quantization.weights=int8"])
    head = load_config(QUICKSTART, ["rollout.quantization.weights=int8", "rollout.quantization.head=int8"])
    assert fingerprint(head) != fingerprint(weights)
