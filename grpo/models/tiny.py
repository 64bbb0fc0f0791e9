"""A tiny Qwen2 checkpoint and tokenizer, written entirely locally.

For tests and the quickstart: no downloads, no torch. :func:`write_tiny_tokenizer` builds
a byte-level BPE tokenizer (Qwen's kind) with the ``tokenizers`` library: the 256 byte
tokens — so every text round-trips through decode and every digit is its own token —
a few merges for chat words, and Qwen's chat special tokens, with a Qwen-style chat
template in ``tokenizer_config.json``.

Tools: given ``tools=``, the template renders exactly what Qwen2.5's does — a system block
listing each tool's JSON schema inside ``<tools></tools>`` with the instruction to answer
with ``<tool_call>...</tool_call>`` — and ``tool`` messages as Qwen2.5 does, inside
``<tool_response>`` in a ``user`` block that consecutive tool messages share. Conversations
without tools render byte-identically to the template without tool support. The tool-call
tags are single tokens, as in Qwen2.5's tokenizer; so are Qwen2.5's tool boilerplate and the
``lookup`` task's schema and call skeleton (:data:`TOOL_TOKENS`), so that the tools
quickstart's chat template and tool schema take 18 tokens and a call five: a 2-layer
random model learns to call the tool within CPU minutes, which it would not through ~400
byte tokens of prompt and a dozen tokens of JSON per call. The call's closing JSON and
``</tool_call>`` are one token (an added token ending with the call's end tag ends a turn
as the tag does): with them apart, a policy that had learnt the closing JSON would, on
some runs, repeat it where ``</tool_call>`` goes (a random model's next token leans to
its current one) until every sample of every group wrote the same unclosed call, which
no group advantage can move. These are plain (not special)
added tokens, appended after the earlier ids so that every other id, and the ``tiny``
preset's vocabulary size, stay as they were. :func:`write_tiny_checkpoint` writes a random
Qwen2 ``config.json`` + safetensors (optionally sharded with an index) with NumPy.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from grpo.models.hf import expected_tensors, hf_config_dict, write_json
from grpo.models.presets import preset_config

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Words that become single tokens (with and without a leading space where useful):
# the chat roles and a few prompt words. Digits are deliberately never merged.
MERGED_WORDS: tuple[str, ...] = (
    "system", "user", "assistant", " answer", " is", " the", "What", " What",
    "Answer", "Compute", " Solve",
)

# Qwen2.5's tool prompt, word for word (its chat template's system block when tools= is given).
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN_TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
# The lookup task's tool schema as the template renders it, and its call's fixed parts:
# <tool_call> LOOKUP_CALL_OPEN <key digits> LOOKUP_CALL_CLOSE (which ends with </tool_call>).
LOOKUP_SCHEMA = (
    '{"type": "function", "function": {"name": "lookup", "description": "The value stored under a key.", '
    '"parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "The key."}}, '
    '"required": ["key"]}, "return": {"type": "string"}}}'
)
LOOKUP_CALL_OPEN = '\n{"name": "lookup", "arguments": {"key": "'
LOOKUP_CALL_CLOSE = '"}}\n</tool_call>'
TOOL_TOKENS: tuple[str, ...] = (
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    QWEN_DEFAULT_SYSTEM, QWEN_TOOLS_HEADER, QWEN_TOOLS_FOOTER, LOOKUP_SCHEMA, LOOKUP_CALL_OPEN, LOOKUP_CALL_CLOSE,
)

# Qwen2.5's template, smaller: no message.content-is-None cases, tool calls of assistant
# messages rendered from ``tool_calls`` or left in the content as the model wrote them.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + QWEN_DEFAULT_SYSTEM + "' }}{%- endif %}"
    "{{- " + repr(QWEN_TOOLS_HEADER) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + repr(QWEN_TOOLS_FOOTER) + " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}{{- call['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _byte_to_char() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the
    others are shifted above U+0100 so every byte is a visible character."""
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    chars = _byte_to_char()
    vocab = {chars[b]: b for b in range(256)}  # byte b is token b
    merges: list[tuple[str, str]] = []
    for word in MERGED_WORDS:
        symbols = "".join(chars[b] for b in word.encode("utf-8"))
        current = symbols[0]
        for ch in symbols[1:]:
            joined = current + ch
            if joined not in vocab:
                merges.append((current, ch))
                vocab[joined] = len(vocab)
            current = joined
    return vocab, merges


def tiny_vocab_size() -> int:
    """Tokens in the tiny tokenizer (regular + special + tool tokens)."""
    vocab, _ = _vocab_and_merges()
    return len(vocab) + len(SPECIAL_TOKENS) + len(TOOL_TOKENS)


def tool_token_ids() -> dict[str, int]:
    """The id of each of :data:`TOOL_TOKENS` (after the special tokens)."""
    vocab, _ = _vocab_and_merges()
    first = len(vocab) + len(SPECIAL_TOKENS)
    return {tok: first + i for i, tok in enumerate(TOOL_TOKENS)}


def special_token_ids() -> dict[str, int]:
    vocab, _ = _vocab_and_merges()
    return {tok: len(vocab) + i for i, tok in enumerate(SPECIAL_TOKENS)}


def write_tiny_tokenizer(directory: str | os.PathLike, *, tool_tokens: bool = True) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    to ``directory`` (created if needed). ``AutoTokenizer.from_pretrained(directory)``
    loads it and ``apply_chat_template`` works. Returns the directory.

    ``tool_tokens=False`` leaves :data:`TOOL_TOKENS` out: their ids then decode to nothing,
    as before the tools existed. A random model samples every id of its vocabulary, so
    with them a single-turn task's completions read differently (an id that decoded to ""
    now decodes to a tag), and so do its rewards and its learning curve."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    vocab, merges = _vocab_and_merges()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tools = TOOL_TOKENS if tool_tokens else ()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tools])
    tok.save(str(out / "tokenizer.json"))
    ids = special_token_ids()
    tool_ids = tool_token_ids()
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "split_special_tokens": False,
            "model_max_length": 2048,
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(ids[t]): {
                    "content": t, "lstrip": False, "normalized": False, "rstrip": False,
                    "single_word": False, "special": True,
                }
                for t in SPECIAL_TOKENS
            }
            | {
                str(tool_ids[t]): {
                    "content": t, "lstrip": False, "normalized": False, "rstrip": False,
                    "single_word": False, "special": False,
                }
                for t in tools
            },
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]},
    )
    return out


def _random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], init_std: float | None) -> np.ndarray:
    if name.endswith("norm.weight"):
        # Not all ones, so a mixed-up norm would show in parity tests.
        return 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if name.endswith(".bias"):
        return 0.1 * rng.standard_normal(shape, dtype=np.float32)
    std = init_std if init_std is not None else 1.0 / math.sqrt(shape[-1])
    return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def write_tiny_checkpoint(
    directory: str | os.PathLike,
    *,
    tied: bool = True,
    seed: int = 0,
    num_shards: int = 1,
    dtype: str = "float32",
    init_std: float | None = None,
    tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Write a random Qwen2 HF checkpoint of the ``tiny`` preset to ``directory``.

    ``overrides`` are Qwen2 config fields (e.g. ``num_hidden_layers=3``). Weights are
    N(0, init_std) (default 1/sqrt(fan_in), so logits are O(1)), biases N(0, 0.1), norm
    weights 1 + N(0, 0.1). ``num_shards`` > 1 writes ``model-0000k-of-0000n.safetensors``
    and ``model.safetensors.index.json``. ``tokenizer`` also writes the tiny tokenizer,
    making the directory a complete model for ``transformers`` and ``grpo``.
    """
    import ml_dtypes
    from safetensors.numpy import save_file

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    cfg = preset_config("tiny", {"tie_word_embeddings": tied, **overrides})
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {
        name: _random_tensor(rng, name, shape, init_std).astype(np_dtype)
        for name, shape in expected_tensors(cfg).items()
    }
    write_json(out / "config.json", hf_config_dict(cfg, dtype))
    names = list(tensors)
    num_shards = max(1, min(num_shards, len(names)))
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        bounds = np.linspace(0, len(names), num_shards + 1).round().astype(int)
        for k in range(num_shards):
            fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
            chunk = names[bounds[k]:bounds[k + 1]]
            save_file({n: tensors[n] for n in chunk}, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in chunk})
        write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map},
        )
    if tokenizer:
        write_tiny_tokenizer(out)
    return out


__all__ = [
    "CHAT_TEMPLATE",
    "LOOKUP_CALL_CLOSE",
    "LOOKUP_CALL_OPEN",
    "LOOKUP_SCHEMA",
    "SPECIAL_TOKENS",
    "TOOL_TOKENS",
    "special_token_ids",
    "tiny_vocab_size",
    "tool_token_ids",
    "write_tiny_checkpoint",
    "write_tiny_tokenizer",
]
