"""A low-precision rollout in the plan (issue 53, item 5): the roofs by hand, and on the
TPU compiler the tiny plan's quantized decode reads int8 codes and its section compares
the variants (slow: compiles)."""

from __future__ import annotations

import types

import pytest
import yaml
from click.testing import CliRunner

from grpo.engine.planning.engine import ChipRoof
from grpo.engine.planning.quantized import quantized_roof, scale_params

DIMS = types.SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, num_hidden_layers=3, vocab_size=1000)


def test_quantized_roofs_by_hand():
    """bf16 (itemsize 2), tp 2: int8 weights save Wm bytes less the float32 scales; int8 KV
    reads E + 4 bytes a head vector instead of 2 E."""
    Wm = 3 * (2 * 64 * 4 * 16 + 2 * 64 * 2 * 16 + 3 * 64 * 128)
    assert scale_params(DIMS) == 3 * (4 * 16 + 2 * 2 * 16 + 2 * 64 + 2 * 128)
    roof = ChipRoof(weight_bytes=1e6, row_flops=1.0, token_flops=1.0, row_bytes=40.0, token_bytes=2 * 3 * 2 * 16 * 2,
                    peak=1.0, bw=1.0)
    kw = dict(itemsize=2, tp=2, kv_split=1)
    w = quantized_roof(roof, DIMS, weights="int8", kv_cache="none", **kw)
    assert w.weight_bytes == pytest.approx(1e6 - Wm / 2 + 4 * scale_params(DIMS) / 2)
    assert (w.token_bytes, w.row_flops) == (roof.token_bytes, roof.row_flops)  # FLOPs stay
    kv = quantized_roof(roof, DIMS, weights="none", kv_cache="int8", **kw)
    assert kv.weight_bytes == roof.weight_bytes and kv.token_bytes == pytest.approx(2 * 3 * 2 * (16 + 4))
    pre = quantized_roof(roof, DIMS, weights="none", kv_cache="fp8", prefill=True, **kw)
    assert pre.row_bytes == pytest.approx(40.0 * 20 / 32) and pre.token_bytes == roof.token_bytes
    # head: int8 (issue 53, item 4): the [D, V] head's bytes less one float32 scale a vocabulary row
    head = quantized_roof(roof, DIMS, weights="int8", kv_cache="none", head="int8", **kw)
    assert head.weight_bytes == pytest.approx(w.weight_bytes - 64 * 1000 / 2 + 4 * 1000 / 2)


@pytest.mark.slow
def test_the_plan_compiles_the_quantized_rollout_and_compares_variants(tmp_path):
    """``grpo plan`` of the tiny model, continuous engine, int8 weights and pages: the
    page pool's bytes are the int8 codes and float32 scales (2 E / (E + 4) fewer than
    bf16), the decode and prefill compile, and the quantization section orders the
    variants; fp8 on the TPU exits 2 naming the field."""
    pytest.importorskip("libtpu")
    from grpo.core.cli import cli

    cfg = {"model": {"source": "random", "random": {"preset": "tiny"}, "param_dtype": "bfloat16",
                     "compute_dtype": "bfloat16"},
           "task": {"name": "arithmetic"}, "loss": {"impl": "jax"},
           "rollout": {"num_generations": 4, "max_prompt_length": 16, "max_new_tokens": 16, "engine": "continuous"},
           "train": {"prompts_per_step": 8, "micro_batch_size": 8}, "eval": {"every_n_steps": 0}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("4\n9\n")

    def plan(*sets):
        args = ["plan", str(path), "--topology", "v6e:2x2", "--lengths", str(lengths), "--json"]
        for s in sets:
            args += ["--set", s]
        return CliRunner().invoke(cli, args, catch_exceptions=False)

    import json

    res = plan("rollout.quantization.weights=int8", "rollout.quantization.kv_cache=int8")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    E = 16  # the tiny preset's head_dim
    # One plan (its unquantized twin compiled the same programs again, over a minute more):
    # a token's pages cost int8 codes and a float32 scale per KV head, (E + 4) / 2E of bf16's.
    assert rep["programs"]["decode"]["roofline_s"] > 0 and rep["programs"]["prefill"]["roofline_s"] > 0
    q = rep["rollout_engine"]["quantization"]
    assert set(q) == {"none", "int8_weights", "int8_weights_kv", "int8_weights_kv_head"}
    assert 1 > q["int8_weights"]["bytes_ratio"] > q["int8_weights_kv"]["bytes_ratio"] > q["int8_weights_kv_head"]["bytes_ratio"]
    assert rep["programs"]["quantize"]["roofline_s"] > 0  # the once-per-sync quantize, compiled (item 6)
    assert q["int8_weights_kv"]["kv_bytes_per_token"] / q["none"]["kv_bytes_per_token"] == pytest.approx((E + 4) / (2 * E))
    assert q["int8_weights_kv"]["pool_rows_ratio"] == pytest.approx(2 * E / (E + 4), rel=0.05)
    assert q["none"]["step_ratio"] == 1 and q["int8_weights_kv"]["roofline_step_s"] <= q["none"]["roofline_step_s"]
    bad = plan("rollout.quantization.weights=fp8")
    assert bad.exit_code == 2 and "rollout.quantization.weights=fp8 on a TPU" in bad.output
