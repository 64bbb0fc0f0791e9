"""HF checkpoints in and out: sharded loads, multi-file checkpoints, export, bad input."""

from __future__ import annotations

import functools
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _model_fixtures import FAMILY_CHECKPOINTS, checkpoint, hf_logits, logits_of, mesh, padded_batch, scratch_dir
from grpo.core.config import ModelConfig
from grpo.core.errors import UserError
from grpo.models.loading import (
    CheckpointError,
    build_model,
    load_hf,
    random_init,
    resolve_checkpoint,
    save_hf,
)


@functools.cache
def _unsharded(name: str):
    return load_hf(checkpoint(name))


@functools.cache
def _reference_logits(name: str) -> np.ndarray:
    tokens, mask = padded_batch()
    return logits_of(_unsharded(name), tokens, mask)


# --------------------------------------------------------------------------- sharded load


FAMILIES = list(FAMILY_CHECKPOINTS)  # qwen3 and llama checkpoints written by transformers


@pytest.mark.parametrize("name", ["untied", *FAMILIES])
def test_fsdp8_load_shards_parameters_and_gives_the_same_logits(name):
    model = load_hf(checkpoint(name), mesh(fsdp=8))
    c = model.config
    # FSDP over the embed dimension of every large parameter; norms replicated.
    assert model.layers.q_proj[...].sharding.spec == P(None, "fsdp", None, None)
    assert model.layers.down_proj[...].sharding.spec == P(None, None, "fsdp")
    assert model.embed[...].sharding.spec == P(None, "fsdp")
    if not c.tie_word_embeddings:
        assert model.lm_head[...].sharding.spec == P("fsdp", None)
    assert model.final_norm[...].sharding.spec == P(None)
    if c.qk_norm:  # per-head norms are tiny: replicated
        assert model.layers.q_norm[...].sharding.spec == P(None, None)
    shard = model.layers.gate_proj[...].addressable_shards[0].data
    # each device holds 1/8 of it
    assert shard.shape == (c.num_hidden_layers, c.hidden_size // 8, c.intermediate_size)
    tokens, mask = padded_batch()
    ours = logits_of(model, tokens, mask)
    np.testing.assert_allclose(ours[mask], _reference_logits(name)[mask], atol=1e-5)


def test_tensor_parallel_load_is_correct_and_replicates_what_does_not_divide():
    # tp=4: 4 query heads split, 2 KV heads do not divide -> replicated over tp.
    model = load_hf(checkpoint("tied"), mesh(fsdp=2, tp=4))
    assert model.layers.q_proj[...].sharding.spec == P(None, "fsdp", "tp", None)
    assert model.layers.k_proj[...].sharding.spec == P(None, "fsdp", None, None)
    assert model.layers.gate_proj[...].sharding.spec == P(None, "fsdp", "tp")
    assert model.embed[...].sharding.spec == P("tp", "fsdp")
    tokens, mask = padded_batch()
    ours = logits_of(model, tokens, mask)
    np.testing.assert_allclose(ours[mask], _reference_logits("tied")[mask], atol=1e-5)


def test_multi_file_checkpoint_loads_like_a_single_file():
    sharded = checkpoint("tied_sharded")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-00003.safetensors"))) == 3
    model = load_hf(sharded, mesh(fsdp=8))
    single = _unsharded("tied")
    for name in ("embed", "final_norm"):
        np.testing.assert_array_equal(np.asarray(getattr(model, name)[...]), np.asarray(getattr(single, name)[...]))
    for name in ("q_proj", "o_proj", "k_bias", "down_proj"):
        np.testing.assert_array_equal(
            np.asarray(getattr(model.layers, name)[...]), np.asarray(getattr(single.layers, name)[...])
        )


def test_bfloat16_checkpoint_converts_to_the_requested_param_dtype():
    path = checkpoint("tied_bf16")
    f32 = load_hf(path)
    bf16 = load_hf(path, param_dtype="bfloat16")
    assert f32.layers.up_proj[...].dtype == np.float32
    assert bf16.layers.up_proj[...].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(f32.layers.up_proj[...]), np.asarray(bf16.layers.up_proj[...]).astype(np.float32))


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("name", ["tied", "untied", *FAMILIES])
def test_export_loads_in_transformers_with_the_same_logits(name):
    model = load_hf(checkpoint(name), mesh(fsdp=8))
    out = save_hf(model, scratch_dir(f"export-{name}"), tokenizer_dir=checkpoint(name), max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert ("lm_head.weight" in index["weight_map"]) == (not model.config.tie_word_embeddings)
    exported = json.loads((out / "config.json").read_text())
    assert exported["model_type"] == model.config.model_type == json.loads(
        (checkpoint(name) / "config.json").read_text())["model_type"]
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    tokens, mask = padded_batch()
    ref = hf_logits(out, tokens, mask)
    np.testing.assert_allclose(_reference_logits(name)[mask], ref[mask], atol=1e-4)
    # and back into grpo, bit for bit
    again = load_hf(out)
    np.testing.assert_array_equal(np.asarray(again.layers.v_proj[...]), np.asarray(model.layers.v_proj[...]))


def test_export_in_bfloat16_writes_bfloat16_tensors():
    from safetensors import safe_open

    out = save_hf(_unsharded("tied"), scratch_dir("export-bf16"), dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


# --------------------------------------------------------------------------- random init


def test_random_init_is_sharded_and_seeded():
    m8 = mesh(fsdp=8)
    a = random_init("tiny", m8, seed=0)
    b = random_init("tiny", m8, seed=1)
    c = random_init("tiny", m8, seed=0)
    q = a.layers.q_proj[...]
    assert q.sharding.spec == P(None, "fsdp", None, None)
    assert q.addressable_shards[0].data.shape == (2, 8, 4, 16)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(c.layers.q_proj[...]))
    assert not np.allclose(np.asarray(q), np.asarray(b.layers.q_proj[...]))
    assert float(np.std(np.asarray(q))) == pytest.approx(0.02, rel=0.1)  # HF's initializer_range
    np.testing.assert_array_equal(np.asarray(a.layers.attn_norm[...]), 1.0)
    np.testing.assert_array_equal(np.asarray(a.layers.q_bias[...]), 0.0)


def test_build_model_from_run_config_sections():
    from grpo.core.config import RandomModelConfig
    from grpo.models.presets import from_random_config

    # same config and mesh as test_random_init_is_sharded_and_seeded: no new compile
    random_model = build_model(ModelConfig(source="random"), mesh(fsdp=8), seed=1)
    reference = random_init("tiny", mesh(fsdp=8), seed=1)
    np.testing.assert_array_equal(np.asarray(random_model.embed[...]), np.asarray(reference.embed[...]))
    overridden = from_random_config(RandomModelConfig(preset="qwen2.5-3b", overrides={"num_hidden_layers": 2}))
    assert (overridden.num_hidden_layers, overridden.hidden_size, overridden.num_key_value_heads) == (2, 2048, 2)
    hf_model = build_model(ModelConfig(source="hf", path=str(checkpoint("tied")), param_dtype="bfloat16", remat="full"))
    assert hf_model.embed[...].dtype == ml_dtypes.bfloat16 and hf_model.remat == "full"


# --------------------------------------------------------------------------- bad input


def _copy(name: str, to: str):
    dst = scratch_dir(to)
    shutil.copytree(checkpoint(name), dst, dirs_exist_ok=True)
    return dst


def _rewrite_weights(path, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named():
    path = _copy("tied", "missing")
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(path)


def test_wrong_shape_is_named():
    path = _copy("tied", "shape")

    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]

    _rewrite_weights(path, edit)
    with pytest.raises(CheckpointError) as err:
        load_hf(path)
    assert "tensor model.layers.0.self_attn.k_proj.weight has shape [16, 64], expected [32, 64]" in str(err.value)


def test_unexpected_tensor_is_named():
    path = _copy("tied", "unexpected")
    _rewrite_weights(path, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((128, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.2\.mlp\.up_proj\.weight"):
        load_hf(path)


def test_missing_tensor_in_a_sharded_checkpoint_is_named():
    path = _copy("tied_sharded", "missing-sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.norm\.weight"):
        load_hf(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
         r"Unexpected architecture.*'gemma'.*no installed model plugin handles.*llama \(llama\), qwen2 \(qwen2\), qwen3 \(qwen3\)"),
        ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}, "Qwen2-MoE.*not implemented"),
        # a dense checkpoint relabelled Qwen3-MoE: its experts are missing, by name (issue 54)
        ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 8}, r"missing tensor model\.layers\.0\.mlp\.experts\.0\."),
        ({"architectures": ["Qwen2ForSequenceClassification"]}, "Qwen2ForSequenceClassification"),
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, "sliding-window"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}}, "yarn"),
    ],
)
def test_wrong_or_unsupported_architecture_is_refused(change, message):
    path = _copy("tied", "arch")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=message):
        load_hf(path)


def test_directory_without_safetensors_is_refused(tmp_path):
    shutil.copy(checkpoint("tied") / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_hf(tmp_path)


def test_hub_id_offline_fails_clearly(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="offline"):
        resolve_checkpoint("grpo-test-nonexistent/no-such-model")
    with pytest.raises(CheckpointError, match="No model directory"):
        resolve_checkpoint("/no/such/dir")


def test_checkpoint_errors_are_user_errors():
    assert issubclass(CheckpointError, UserError)
