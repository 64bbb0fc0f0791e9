"""Model families as plugins: the qwen3 and llama built-ins' configs and refusals, the
llama3 RoPE frequencies, presets, choosing a family (auto / model.architecture), a
third-party family from an entry point, and the chat-template thinking switch.

Numerical parity of every family with transformers (logits, KV-cache decode, fsdp=8,
export) is in test_decoder.py and test_loading.py, parametrized over
``_model_fixtures.FAMILY_CHECKPOINTS``; a GRPO step per family is in
tests/engine/test_trainer.py.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from _model_fixtures import (
    FAMILY_CHECKPOINTS,
    checkpoint,
    hf_logits,
    logits_of,
    padded_batch,
    scratch_dir,
)
from click.testing import CliRunner

from grpo.core.cli import cli
from grpo.core.config import load_config
from grpo.core.errors import ConfigError, UserError
from grpo.models.llama import LlamaConfig
from grpo.models.loading import CheckpointError, load_hf, read_family
from grpo.models.presets import preset_config, preset_hf_dict
from grpo.models.qwen3 import Qwen3Config

# --------------------------------------------------------------------------- configs


def test_family_configs_round_trip_through_transformers():
    from transformers import LlamaConfig as HFLlama
    from transformers import Qwen3Config as HFQwen3

    q = Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=24, tie_word_embeddings=False, eos_token_id=(3, 4))
    hf = q.to_hf()
    assert isinstance(hf, HFQwen3) and hf.head_dim == 24
    assert Qwen3Config.from_hf(hf) == q and Qwen3Config.from_hf(hf.to_dict()) == q
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    ll = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=1, rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=1024,
                     tie_word_embeddings=True, rope_scaling=tuple(sorted(scaling.items())))
    hf = ll.to_hf()
    assert isinstance(hf, HFLlama) and hf.rope_parameters["rope_type"] == "llama3"
    assert LlamaConfig.from_hf(hf) == ll and LlamaConfig.from_hf(hf.to_dict()) == ll
    # the switches the shared decoder reads
    assert (Qwen3Config.qk_norm, Qwen3Config.qkv_bias, LlamaConfig.qk_norm, LlamaConfig.qkv_bias) == (
        True, False, False, False)
    assert "layers.q_norm" in q.param_specs() and "layers.q_bias" not in q.param_specs()
    assert not {"layers.q_norm", "layers.q_bias"} & set(ll.param_specs())


_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096)
_QWEN3 = dict(_LLAMA, head_dim=16)


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, "sliding-window"),
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}},
         "'yarn'.*not implemented"),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "'linear'.*not implemented"),
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'.*not implemented"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unimplemented_features_are_refused(family, change, message):
    import transformers

    hf_cls, ours, base = {
        "qwen3": (transformers.Qwen3Config, Qwen3Config, _QWEN3),
        "llama": (transformers.LlamaConfig, LlamaConfig, _LLAMA),
    }[family]
    hf = hf_cls(**base, **change)  # through transformers' own class, as config.json would come
    with pytest.raises(UserError, match=message):
        ours.from_hf(hf)


# --------------------------------------------------------------------------- llama3 rope


@pytest.mark.parametrize("source", ["llama_tied_rope3", "llama-3.1-8b", "llama-3.2-1b"])
def test_llama3_rope_frequencies_equal_transformers(source):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if source in FAMILY_CHECKPOINTS:
        hf = transformers.AutoConfig.from_pretrained(checkpoint(source))
    else:
        hf = transformers.LlamaConfig(**{k: v for k, v in preset_hf_dict(source).items() if k != "model_type"})
    ours = LlamaConfig.from_hf(hf)
    assert dict(ours.rope_scaling)["factor"] == hf.rope_parameters["factor"]
    expected, scale = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert scale == 1.0
    np.testing.assert_allclose(ours.inv_freq(), expected.numpy(), rtol=1e-6, atol=0)
    # the scaling really changes frequencies (else the logits test could not see it)
    plain = LlamaConfig.from_hf({**hf.to_dict(), "rope_parameters": None, "rope_scaling": None,
                                 "rope_theta": ours.rope_theta})
    assert not np.allclose(plain.inv_freq(), ours.inv_freq())


# --------------------------------------------------------------------------- presets


def test_qwen3_and_llama3_presets_have_the_published_shapes():
    # Parameter counts of the published checkpoints: Llama 3.2 1B/3B and 3.1 8B as
    # reported by transformers' num_parameters(); Qwen3-8B as on its model card (8.2B).
    expected = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
                "qwen3-8b": 8_190_735_360}
    assert {name: preset_config(name).num_params() for name in expected} == expected
    # Qwen3 model cards: 0.6B (0.44B non-embedding), 1.7B (1.4B), 4B (3.6B)
    for name, total, non_embedding in (("qwen3-0.6b", 0.6e9, 0.44e9), ("qwen3-1.7b", 1.7e9, 1.4e9),
                                       ("qwen3-4b", 4.0e9, 3.6e9)):
        cfg = preset_config(name)
        assert isinstance(cfg, Qwen3Config) and cfg.tie_word_embeddings and cfg.head_dim == 128
        assert cfg.num_params() == pytest.approx(total, rel=0.05)
        assert cfg.num_params() - cfg.vocab_size * cfg.hidden_size == pytest.approx(non_embedding, rel=0.05)
    l1 = preset_config("llama-3.2-1b")
    assert isinstance(l1, LlamaConfig) and l1.tie_word_embeddings and l1.head_dim == 64
    assert l1.eos_token_id == (128001, 128008, 128009)
    assert dict(preset_config("llama-3.1-8b").rope_scaling)["factor"] == 8.0
    assert preset_config("qwen3-8b").tie_word_embeddings is False


def test_preset_inspect_names_the_family():
    result = CliRunner().invoke(cli, ["model", "inspect", "llama-3.2-1b"])
    assert result.exit_code == 0, result.output
    assert "LlamaForCausalLM (model plugin llama)" in result.output and "1,235,814,400" in result.output
    assert "llama3" in result.output


# --------------------------------------------------------------------------- choosing a family


def test_auto_and_named_architecture_pick_the_checkpoints_family():
    plugin, cfg = read_family(checkpoint("qwen3_tied"))
    assert plugin.name == "qwen3" and isinstance(cfg, Qwen3Config)
    plugin, cfg = read_family(checkpoint("llama_untied"), architecture="llama")
    assert plugin.name == "llama" and isinstance(cfg, LlamaConfig)


def test_a_family_the_checkpoint_is_not_is_refused_with_exit_2():
    with pytest.raises(CheckpointError, match=r"model.architecture='llama'.*model_type='qwen3'.*set model.architecture to 'qwen3'"):
        load_hf(checkpoint("qwen3_tied"), architecture="llama")
    with pytest.raises(CheckpointError, match=r"Unknown model plugin 'gemma'.*llama, qwen2, qwen3"):
        read_family(checkpoint("qwen3_tied"), architecture="gemma")
    result = CliRunner().invoke(cli, ["model", "inspect", str(checkpoint("llama_untied")), "--architecture", "qwen3"])
    assert result.exit_code == 2
    assert "asks for the qwen3 model family" in result.output and "'llama'" in result.output
    assert "Traceback" not in result.output and result.output.count("\n") <= 2  # one paragraph


def test_a_model_type_no_plugin_handles_is_refused_with_exit_2():
    path = scratch_dir("gemma")
    shutil.copytree(checkpoint("llama_untied"), path, dirs_exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma", "architectures": ["GemmaForCausalLM"]}))
    result = CliRunner().invoke(cli, ["model", "inspect", str(path)])
    assert result.exit_code == 2
    assert "model_type='gemma'" in result.output and "no installed model plugin handles" in result.output
    assert "llama (llama), qwen2 (qwen2), qwen3 (qwen3)" in result.output
    assert "Traceback" not in result.output and result.output.count("\n") <= 2


def test_run_config_architecture_is_validated():
    base = {"model": {"source": "random", "random": {"preset": "qwen3-0.6b"}}}
    assert load_config(base).model.architecture == "auto"
    assert load_config(base, ["model.architecture=qwen3"]).model.architecture == "qwen3"
    with pytest.raises(ConfigError, match=r"model.architecture: Unknown model plugin 'qwen4'.*Did you mean 'qwen3'"):
        load_config(base, ["model.architecture=qwen4"])
    with pytest.raises(ConfigError, match=r"model.architecture='llama' but model.random.preset='qwen3-0.6b' is a qwen3"):
        load_config(base, ["model.architecture=llama"])


def test_grpo_run_with_the_wrong_family_exits_2(tmp_path):
    import yaml

    cfg = {
        "model": {"source": "hf", "path": str(checkpoint("llama_untied")), "architecture": "qwen2"},
        "task": {"name": "arithmetic", "options": {"num_examples": 8, "num_test_examples": 8}},
        "train": {"steps": 1, "prompts_per_step": 8},
        "rollout": {"num_generations": 2},
        "logging": {"progress_bar": False, "plot": False},
    }
    path = tmp_path / "wrong.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(cli, ["run", str(path), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "asks for the qwen2 model family" in result.output and "Traceback" not in result.output


# --------------------------------------------------------------------------- third party


@pytest.fixture(scope="module")
def mistral_checkpoint():
    """A tiny MistralForCausalLM written by transformers (full attention)."""
    import torch
    import transformers

    config = transformers.MistralConfig(
        vocab_size=320, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, sliding_window=None, rms_norm_eps=1e-5, max_position_embeddings=512,
        bos_token_id=306, eos_token_id=308, pad_token_id=306,
    )
    torch.manual_seed(3)
    model = transformers.MistralForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if name.endswith("norm.weight")
                        else torch.randn_like(param) / param.shape[-1] ** 0.5)
    path = scratch_dir("mistral")
    model.save_pretrained(path)
    return path


def test_third_party_model_family_is_listed_and_chosen(example_plugin, mistral_checkpoint):
    result = CliRunner().invoke(cli, ["plugins", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = [r for r in json.loads(result.output) if r["kind"] == "model"]
    assert {r["name"]: r["provider"] for r in rows} == {
        "qwen2": "built-in", "qwen3": "built-in", "qwen3_moe": "built-in", "llama": "built-in",
        "mistral": "grpo-example-plugin==0.3.1",
    }
    tokens, mask = padded_batch()
    ref = hf_logits(mistral_checkpoint, tokens, mask)
    for architecture in ("mistral", "auto"):
        model = load_hf(mistral_checkpoint, architecture=architecture)
        assert model.config.family == "mistral"
        np.testing.assert_allclose(logits_of(model, tokens, mask)[mask], ref[mask], atol=1e-4)
    cfg = load_config({"model": {"source": "hf", "path": str(mistral_checkpoint), "architecture": "mistral"}})
    assert cfg.model.architecture == "mistral"
    # a built-in family does not take the third party's checkpoint
    with pytest.raises(CheckpointError, match="it is a mistral checkpoint"):
        load_hf(mistral_checkpoint, architecture="llama")


def test_third_party_family_refuses_what_it_does_not_implement(example_plugin, mistral_checkpoint):
    path = scratch_dir("mistral-sliding")
    shutil.copytree(mistral_checkpoint, path, dirs_exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "sliding_window": 4096}))
    with pytest.raises(CheckpointError, match="sliding_window=4096: only full attention"):
        read_family(path)


# --------------------------------------------------------------------------- prompts and stops

# The generation-prompt part of Qwen3's chat template (Qwen/Qwen3-1.7B tokenizer_config.json).
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def test_gsm8k_thinking_switch_reaches_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from grpo.core.plugins import get_plugins
    from grpo.models.tiny import write_tiny_tokenizer
    from grpo.engine.rollout.prompts import render_prompt

    directory = write_tiny_tokenizer(tmp_path / "tok")
    tok_cfg = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": QWEN3_TEMPLATE}))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    task = get_plugins().get("task", "gsm8k")
    example = {"question": "What is 2+3?", "answer": "#### 5"}
    off = render_prompt(task, task.parse_options({}), example, tokenizer)  # GSM8K default: off
    on = render_prompt(task, task.parse_options({"enable_thinking": True}), example, tokenizer)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on
    # a template without the switch renders the same either way
    plain = AutoTokenizer.from_pretrained(write_tiny_tokenizer(tmp_path / "plain"))
    assert render_prompt(task, task.parse_options({}), example, plain) == render_prompt(
        task, task.parse_options({"enable_thinking": True}), example, plain)


def test_llama3_instruct_stops_on_every_generation_config_eos(tmp_path):
    from types import SimpleNamespace

    from grpo.models.policy import stop_token_ids

    # meta-llama/Llama-3.2-1B-Instruct: tokenizer eos <|eot_id|>, generation_config.json
    # eos_token_id [128001 <|end_of_text|>, 128008 <|eom_id|>, 128009 <|eot_id|>]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    ids = stop_token_ids(SimpleNamespace(eos_token_id=128009), str(tmp_path), preset_config("llama-3.2-1b").eos_token_id)
    assert set(ids) == {128001, 128008, 128009}
    # Qwen3: <|im_end|> from the tokenizer, <|endoftext|> from generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    ids = stop_token_ids(SimpleNamespace(eos_token_id=151645), str(tmp_path), preset_config("qwen3-1.7b").eos_token_id)
    assert ids[0] == 151645 and set(ids) == {151645, 151643}


def test_decoder_config_fields_match_the_presets_field_list():
    import dataclasses

    from grpo.models.decoder import DecoderConfig
    from grpo.models.presets import CONFIG_FIELDS

    assert tuple(f.name for f in dataclasses.fields(DecoderConfig)) == CONFIG_FIELDS


def test_random_init_of_a_family_preset_is_sharded_and_runs():
    """`model.source: random` with a Qwen3 preset (shrunk by overrides): parameters are born
    in their shardings, q/k norms at one, and the forward pass runs (Llama presets go
    through the same plugin.build; their config is checked in the presets test)."""
    from _model_fixtures import mesh
    from jax.sharding import PartitionSpec as P

    from grpo.core.config import ModelConfig, RandomModelConfig
    from grpo.models.loading import build_model

    small = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    tokens, mask = padded_batch(vocab=128)
    for preset, family in (("qwen3-0.6b", "qwen3"),):
        cfg = ModelConfig(source="random", architecture=family, random=RandomModelConfig(preset=preset, overrides=small))
        model = build_model(cfg, mesh(fsdp=8), seed=0)
        assert model.config.family == family and model.config.head_dim == 8
        assert model.layers.q_proj[...].sharding.spec == P(None, "fsdp", None, None)
        np.testing.assert_array_equal(np.asarray(model.layers.k_norm[...]), 1.0)
        assert np.isfinite(logits_of(model, np.where(mask, tokens, 0), mask)).all()
    with pytest.raises(UserError, match="is a qwen3 model"):
        build_model(ModelConfig(source="random", architecture="llama",
                                random=RandomModelConfig(preset="qwen3-0.6b", overrides=small)))
