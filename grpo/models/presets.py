"""Architecture presets, named as in :data:`grpo.core.config.PRESETS`.

Each preset is a set of transformers ``Qwen2Config`` fields. The Qwen2.5 ones carry the
numbers of the published ``Qwen/Qwen2.5-*-Instruct`` checkpoints, so a randomly
initialised preset has exactly the shapes (and cost) of the real model. ``tiny`` is a
two-layer model for CPU tests and the quickstart; its vocabulary covers the tiny
tokenizer of :mod:`grpo.models.tiny`.

``RandomModelConfig.overrides`` (HF field names, e.g. ``num_hidden_layers: 2``) apply on
top through :func:`preset_config`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from grpo.core.errors import UserError
from grpo.models.qwen2 import Qwen2Config

_QWEN25_COMMON: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_act": "silu",
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "use_sliding_window": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model_type": "qwen2",
        "hidden_act": "silu",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 10_000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        # ids of <|endoftext|> and <|im_end|> in the tiny tokenizer
        "bos_token_id": 306,
        "eos_token_id": 308,
        "pad_token_id": 306,
        "use_sliding_window": False,
    },
    "qwen2.5-0.5b": {
        **_QWEN25_COMMON,
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        **_QWEN25_COMMON,
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-3b": {
        **_QWEN25_COMMON,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        **_QWEN25_COMMON,
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
}

# Hugging Face hub ids whose architecture is a preset: `grpo plan` sizes a run on these
# without downloading anything (the Instruct and base checkpoints share the shapes).
HUB_PRESETS: dict[str, str] = {
    f"Qwen/Qwen2.5-{size}{suffix}": f"qwen2.5-{size.lower()}"
    for size in ("0.5B", "1.5B", "3B", "7B")
    for suffix in ("", "-Instruct")
}


def hub_preset(hub_id: str) -> str | None:
    """The preset name of a known hub id (case-insensitive), or None."""
    lowered = {k.lower(): v for k, v in HUB_PRESETS.items()}
    return lowered.get(str(hub_id).strip().lower())


# Fields an override may set: the architecture, plus the HF switches that from_hf
# checks (so e.g. `use_sliding_window: true` is refused there, not ignored here).
OVERRIDABLE: frozenset[str] = frozenset(f.name for f in dataclasses.fields(Qwen2Config)) | {
    "hidden_act",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "rope_scaling",
    "rope_parameters",
    "attention_dropout",
}


def preset_hf_dict(name: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The HF config fields of preset ``name`` with ``overrides`` applied."""
    if name not in PRESETS:
        raise UserError(f"Unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - OVERRIDABLE)
    if unknown:
        raise UserError(
            f"Unknown Qwen2 config field(s) in model.random.overrides: {', '.join(unknown)}. "
            f"Known fields: {', '.join(sorted(OVERRIDABLE))}."
        )
    return {**PRESETS[name], **overrides}


def preset_config(name: str, overrides: Mapping[str, Any] | None = None) -> Qwen2Config:
    """The :class:`Qwen2Config` of preset ``name`` with ``overrides`` applied."""
    return Qwen2Config.from_hf(preset_hf_dict(name, overrides))


def from_random_config(random_config: Any) -> Qwen2Config:
    """From a :class:`grpo.core.config.RandomModelConfig` (``preset`` + ``overrides``)."""
    return preset_config(random_config.preset, random_config.overrides)


__all__ = ["HUB_PRESETS", "OVERRIDABLE", "PRESETS", "hub_preset", "from_random_config", "preset_config", "preset_hf_dict"]
