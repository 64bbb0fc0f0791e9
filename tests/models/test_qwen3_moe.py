"""Qwen3-MoE as a model family (issue 54, item 1): parity with transformers'
``Qwen3MoeForCausalLM`` in logits and log-probs, export back into transformers, the HF
config round trip and refusals, the presets and ``grpo model inspect``.

The checkpoints are written by transformers itself (``_model_fixtures.MOE_CHECKPOINTS``:
8 experts, top-2, with and without ``norm_topk_prob``, tied and untied)."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest
from click.testing import CliRunner

from _model_fixtures import MOE_CHECKPOINTS, checkpoint, hf_logits, logits_of, mesh, packed_vs_alone, padded_batch, scratch_dir
from grpo.core.cli import cli
from grpo.core.errors import UserError
from grpo.models.loading import load_hf, save_hf
from grpo.models.presets import preset_config
from grpo.models.qwen3_moe import Qwen3MoeConfig


@functools.cache
def _model(name: str):
    return load_hf(checkpoint(name))


def _log_probs(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """log p(next token) [B, T-1] from float32 logits (an independent NumPy log-softmax)."""
    x = logits[:, :-1].astype(np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return np.take_along_axis(x, tokens[:, 1:, None], axis=-1)[..., 0] - lse


@pytest.mark.parametrize("name", list(MOE_CHECKPOINTS))
def test_logits_and_log_probs_match_transformers_in_f32(name):
    """Issue 54 goal: a tiny Qwen3-MoE (8 experts, top-2) within 1e-5 of transformers."""
    tokens, mask = padded_batch()
    model = _model(name)
    assert model.config.family == "qwen3_moe" and model.config.num_experts == 8
    ours, ref = logits_of(model, tokens, mask), hf_logits(checkpoint(name), tokens, mask)
    assert np.abs(ours - ref)[mask].max() <= 1e-5
    assert np.abs(ref[mask]).max() > 1.0  # not near-zero logits
    pair = mask[:, :-1] & mask[:, 1:]
    gap = np.abs(_log_probs(ours, tokens) - _log_probs(ref, tokens))[pair].max()
    assert gap <= 1e-5, gap


def test_export_loads_back_in_transformers_with_equal_outputs():
    """Sharded over fsdp=8, exported in several files with one tensor per expert (the
    published layout), read by transformers: the same logits; read back by grpo: the same
    expert weights, bit for bit."""
    name = "qwen3moe_untied"
    model = load_hf(checkpoint(name), mesh(fsdp=8))
    out = save_hf(model, scratch_dir("export-moe"), tokenizer_dir=checkpoint(name), max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index and "model.layers.0.mlp.gate.weight" in index
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"]) == ("qwen3_moe", 8, 2)
    tokens, mask = padded_batch()
    np.testing.assert_allclose(hf_logits(out, tokens, mask)[mask], hf_logits(checkpoint(name), tokens, mask)[mask],
                               atol=1e-6)
    again = load_hf(out)
    for p in ("expert_gate", "expert_up", "expert_down", "router"):
        np.testing.assert_array_equal(np.asarray(getattr(again.layers, p)[...]), np.asarray(getattr(model.layers, p)[...]))


@pytest.mark.slow  # three compiles of the model (~20 s on a shared 2-core machine)
def test_packed_sequences_equal_each_sequence_alone():
    # Routing is per token: packing sequences into bins must not change any token's experts.
    assert packed_vs_alone(_model("qwen3moe_untied"), lengths=(5, 7), bin_length=12) <= 1e-5


def test_config_round_trips_through_transformers_and_refuses_mixed_layers():
    from transformers import Qwen3MoeConfig as HF

    cfg = preset_config("tiny-moe")
    hf = cfg.to_hf()
    assert isinstance(hf, HF) and (hf.num_experts, hf.num_experts_per_tok, hf.norm_topk_prob) == (8, 2, True)
    assert Qwen3MoeConfig.from_hf(hf) == cfg and Qwen3MoeConfig.from_hf(hf.to_dict()) == cfg
    with pytest.raises(UserError, match="decoder_sparse_step=2"):
        preset_config("tiny-moe", {"decoder_sparse_step": 2})
    with pytest.raises(UserError, match=r"mlp_only_layers=\[0\]"):
        preset_config("tiny-moe", {"mlp_only_layers": [0]})
    with pytest.raises(UserError, match="num_experts_per_tok=9 exceeds num_experts=8"):
        preset_config("tiny-moe", {"num_experts_per_tok": 9})


def test_qwen3_30b_a3b_preset_has_the_published_size():
    # Model card: 30.5B parameters, 3.3B activated; 48 layers, 128 experts, 8 activated.
    cfg = preset_config("qwen3-30b-a3b")
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (48, 128, 8)
    assert cfg.num_params() == 30_532_122_624 and round(cfg.num_params() / 1e9, 1) == 30.5
    assert round(cfg.active_params() / 1e9, 1) == 3.4 and 3.3e9 < cfg.active_params() < 3.4e9


def test_inspect_shows_the_experts():
    result = CliRunner().invoke(cli, ["model", "inspect", "qwen3-30b-a3b"])
    assert result.exit_code == 0, result.output
    assert "model plugin qwen3_moe" in result.output
    assert "experts:      128, 8 per token (width 768, norm_topk_prob true); active parameters 3,353,032,704" in result.output
    data = json.loads(CliRunner().invoke(cli, ["model", "inspect", str(checkpoint("qwen3moe_tied_raw")), "--json"]).output)
    assert data["config"]["moe"]["norm_topk_prob"] is False and data["problems"] == []


def test_random_tiny_moe_runs_sharded():
    from grpo.models.loading import random_init

    model = random_init("tiny-moe", mesh(fsdp=2, tp=2))
    tokens, mask = padded_batch()
    logits = logits_of(model, tokens, mask)
    assert np.isfinite(logits).all() and logits.shape == (4, 9, 320)
    assert model.layers.expert_gate[...].sharding.spec[3] == "tp"
    assert jax.device_count() >= 4
