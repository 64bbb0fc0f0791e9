"""The tiny tokenizer and checkpoint writers, presets, and `grpo model inspect`."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from _model_fixtures import checkpoint, scratch_dir
from grpo.core.cli import cli
from grpo.core.config import PRESETS as CONFIG_PRESETS
from grpo.core.errors import UserError
from grpo.models.presets import PRESETS, preset_config
from grpo.plugins.tasks._lookup import make_lookup_tool
from grpo.models.tiny import (
    LOOKUP_CALL_CLOSE,
    LOOKUP_CALL_OPEN,
    special_token_ids,
    tiny_vocab_size,
    tool_token_ids,
    write_tiny_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(write_tiny_tokenizer(scratch_dir("tokenizer"))))


# --------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["12+7=19", "What is -3 - 45?\n Answer: 1,234.", "naïve café 🤖 \t tabs"])
def test_text_round_trips_through_the_tokenizer(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_digits_are_single_tokens(tokenizer):
    ids = tokenizer("9081726354", add_special_tokens=False)["input_ids"]
    assert len(ids) == 10
    assert [tokenizer.decode([i]) for i in ids] == list("9081726354")
    assert len(tokenizer(" 12", add_special_tokens=False)["input_ids"]) == 3  # " ", "1", "2"


def test_chat_template_and_special_tokens(tokenizer):
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+7="}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    special = special_token_ids()
    assert ids[0] == special["<|im_start|>"] and ids.count(special["<|im_end|>"]) == 2
    assert tokenizer.eos_token_id == special["<|im_end|>"] == PRESETS["tiny"]["eos_token_id"]
    assert tokenizer.pad_token_id == special["<|endoftext|>"] == PRESETS["tiny"]["pad_token_id"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "system\nAdd.\nuser\n12+7=\nassistant\n"


def test_tiny_vocab_fits_the_tiny_preset(tokenizer):
    assert len(tokenizer) == tiny_vocab_size() <= PRESETS["tiny"]["vocab_size"]
    # Tool tokens come after every earlier id, which stay as they were.
    assert min(tool_token_ids().values()) == max(special_token_ids().values()) + 1 == 309


# The template before tool support: conversations without tools must render the same.
_TOOLLESS_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_without_tools_is_unchanged(tokenizer, generation_prompt):
    conversations = [
        [{"role": "user", "content": "3+4="}],
        [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"},
         {"role": "user", "content": "and 1+1?"}],
    ]
    for messages in conversations:
        new = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        old = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=_TOOLLESS_TEMPLATE
        )
        assert new == old


# The lookup task's own tool: its schema must stay the single token the tokenizer holds.
_lookup = make_lookup_tool({"37": "52"})


def test_chat_template_renders_tools_and_tool_messages_like_qwen25(tokenizer):
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "37"}}\n</tool_call>'
    messages = [
        {"role": "user", "content": "What is the value of 37?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "lookup", "content": "52"},
        {"role": "tool", "name": "lookup", "content": "53"},
        {"role": "assistant", "content": "52"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[_lookup], tokenize=False)
    schema = (
        '{"type": "function", "function": {"name": "lookup", "description": "The value stored under a key.", '
        '"parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "The key."}}, '
        '"required": ["key"]}, "return": {"type": "string"}}}'
    )
    # Qwen2.5's rendering: default system prompt, tools block, consecutive tool messages in one user block.
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
        "signatures within <tools></tools> XML tags:\n<tools>\n" + schema + "\n</tools>\n\nFor each function call, "
        "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is the value of 37?<|im_end|>\n"
        "<|im_start|>assistant\n" + call + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n52\n</tool_response>\n<tool_response>\n53\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n52<|im_end|>\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    # A given system message replaces the default one; tool_calls render as Qwen2.5 writes them.
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, messages[0],
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"key": "37"}}}]}],
        tools=[_lookup], tokenize=False,
    )
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and with_system.count("Be brief.") == 1
    assert with_system.endswith("<|im_start|>assistant\n" + call + "<|im_end|>\n")


def test_tool_prompt_and_lookup_call_are_a_few_tokens(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the value of 37?"}], tools=[_lookup], tokenize=False, add_generation_prompt=True
    )
    # 10 tokens of system block with the tools listed, 24 of the question and turn markers.
    assert len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) == 34
    ids = tokenizer('<tool_call>\n{"name": "lookup", "arguments": {"key": "37"}}\n</tool_call>', add_special_tokens=False)[
        "input_ids"
    ]
    tool = tool_token_ids()
    assert ids == [tool["<tool_call>"], tool[LOOKUP_CALL_OPEN], ord("3"), ord("7"), tool[LOOKUP_CALL_CLOSE]]
    assert tokenizer("a</tool_call>", add_special_tokens=False)["input_ids"] == [ord("a"), tool["</tool_call>"]]
    # The model's own tokens decode back to the call (plain added tokens: kept by skip_special_tokens).
    assert tokenizer.decode(ids, skip_special_tokens=True).endswith("</tool_call>")


# --------------------------------------------------------------------------- presets


def test_presets_match_the_config_schema_and_qwen25_numbers():
    assert set(PRESETS) == set(CONFIG_PRESETS)
    c3 = preset_config("qwen2.5-3b")
    assert (c3.hidden_size, c3.num_hidden_layers, c3.num_attention_heads, c3.num_key_value_heads) == (2048, 36, 16, 2)
    assert (c3.intermediate_size, c3.vocab_size, c3.tie_word_embeddings, c3.rope_theta) == (11008, 151936, True, 1e6)
    assert c3.head_dim == 128 and c3.kv_bytes_per_token() == 36_864  # DESIGN.md's figure
    # Published parameter counts of the Qwen2.5 family.
    expected = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-3b": 3_085_938_688,
                "qwen2.5-7b": 7_615_616_512}
    assert {name: preset_config(name).num_params() for name in expected} == expected
    assert preset_config("qwen2.5-7b").tie_word_embeddings is False


def test_overrides_apply_and_unknown_ones_are_refused():
    cfg = preset_config("tiny", {"num_hidden_layers": 4, "hidden_size": 96, "num_attention_heads": 6})
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (4, 96, 16)
    with pytest.raises(UserError, match="num_layers"):
        preset_config("tiny", {"num_layers": 4})
    with pytest.raises(UserError, match="sliding-window"):
        preset_config("tiny", {"use_sliding_window": True})
    with pytest.raises(UserError, match="Unknown model preset"):
        preset_config("qwen3-32b")


# --------------------------------------------------------------------------- checkpoint writer


def test_sharded_tiny_checkpoint_has_a_consistent_index():
    from safetensors import safe_open

    path = checkpoint("tied_sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    total = 0
    for name, fname in index["weight_map"].items():
        with safe_open(str(path / fname), framework="numpy") as f:
            total += f.get_tensor(name).nbytes
    assert total == index["metadata"]["total_size"]
    assert "lm_head.weight" not in index["weight_map"]
    assert len(index["weight_map"]) == 2 + 12 * 2  # embed, final norm + 12 per layer
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True


# --------------------------------------------------------------------------- CLI


def test_inspect_a_checkpoint_directory():
    result = CliRunner().invoke(cli, ["model", "inspect", str(checkpoint("untied"))])
    assert result.exit_code == 0, result.output
    assert "tied embeddings: no" in result.output
    assert "layers 3, hidden 64" in result.output
    assert "bytes float32:" in result.output


def test_inspect_json_counts_parameters_and_bytes():
    result = CliRunner().invoke(cli, ["model", "inspect", str(checkpoint("tied_bf16")), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    n = preset_config("tiny").num_params()
    assert report["parameters"] == n and report["config"]["tied_embeddings"] is True
    assert report["bytes_by_dtype"] == {"bfloat16": 2 * n}
    assert report["problems"] == []


def test_inspect_a_preset():
    result = CliRunner().invoke(cli, ["model", "inspect", "qwen2.5-3b"])
    assert result.exit_code == 0, result.output
    assert "3,085,938,688" in result.output and "tied embeddings: yes" in result.output


def test_inspect_reports_a_broken_checkpoint_and_exits_2():
    import shutil

    path = scratch_dir("inspect-broken")
    shutil.copytree(checkpoint("untied"), path, dirs_exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    result = CliRunner().invoke(cli, ["model", "inspect", str(path)])
    assert result.exit_code == 2
    assert "tensor model.layers.0.mlp.gate_proj.weight has shape [128, 64], expected [96, 64]" in result.output


def test_inspect_missing_path_is_a_user_error():
    result = CliRunner().invoke(cli, ["model", "inspect", "/no/such/model"])
    assert result.exit_code == 2
    assert "No model directory" in result.output
    assert "Traceback" not in result.output
