"""Architecture presets, named as in :data:`grpo.core.config.PRESETS`.

Each preset is a set of transformers config fields with its ``model_type``, which picks
the model plugin (``qwen2``, ``qwen3``, ``llama``) exactly as a checkpoint's
``config.json`` does. The named ones carry the numbers of the published checkpoints'
``config.json`` files, so a randomly initialised preset has exactly the shapes (and
cost) of the real model:

- ``qwen2.5-*``: https://huggingface.co/Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}-Instruct/blob/main/config.json
- ``qwen3-*``: https://huggingface.co/Qwen/Qwen3-{0.6B,1.7B,4B,8B}/blob/main/config.json
- ``llama-3.2-1b``/``-3b``: https://huggingface.co/meta-llama/Llama-3.2-{1B,3B}-Instruct/blob/main/config.json
- ``llama-3.1-8b``: https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json
- ``qwen3-30b-a3b``: https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (Qwen3-MoE)

``tiny`` is a two-layer Qwen2 for CPU tests and the quickstart; its vocabulary covers the
tiny tokenizer of :mod:`grpo.models.tiny`; ``tiny-moe`` is the same with a Qwen3-MoE block
(8 experts, top-2) in place of each MLP.

``RandomModelConfig.overrides`` (HF field names, e.g. ``num_hidden_layers: 2``) apply on
top through :func:`preset_config`.
"""

from __future__ import annotations

from typing import Any, Mapping

from grpo.core.errors import UserError

# The fields of grpo.models.decoder.DecoderConfig (spelled out so that this module, which
# config validation imports, does not import JAX; a test keeps the two lists equal).
CONFIG_FIELDS: tuple[str, ...] = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
    "max_position_embeddings", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "rope_scaling",
)

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

# Qwen3 (dense), every size: head_dim 128 (not hidden/heads), 8 KV heads, no qkv bias,
# q/k RMSNorm, 40960 positions, rope_theta 1e6; the head is tied up to 4B.
_QWEN3_COMMON: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_act": "silu",
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "initializer_range": 0.02,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "use_sliding_window": False,
}
PRESETS.update({
    "qwen3-0.6b": {**_QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    "qwen3-1.7b": {**_QWEN3_COMMON, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    "qwen3-4b": {**_QWEN3_COMMON, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False},
})

# Qwen3-MoE: Qwen3 attention (head_dim 128, 4 KV heads for 30B-A3B) with every MLP a
# mixture of 128 experts, 8 routed per token, top-k renormalised (norm_topk_prob).
# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
PRESETS.update({
    "qwen3-30b-a3b": {**_QWEN3_COMMON, "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "router_aux_loss_coef": 0.001},
    # `tiny` with a mixture of 8 experts (top-2) in place of each MLP: CPU tests and the
    # MoE quickstart (the tiny tokenizer's vocabulary).
    "tiny-moe": {**PRESETS["tiny"], "model_type": "qwen3_moe", "head_dim": 16, "attention_bias": False,
                 "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": []},
})

# Llama 3.x Instruct: 128256-token vocabulary, 8 KV heads, no biases, rope_theta 5e5 with
# llama3 scaling (factor 32 for 3.2, 8 for 3.1), 131072 positions; instruct checkpoints
# stop on <|end_of_text|>, <|eom_id|> and <|eot_id|>.
_LLAMA3_COMMON: dict[str, Any] = {
    "model_type": "llama",
    "hidden_act": "silu",
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "rope_theta": 500_000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


PRESETS.update({
    "llama-3.2-1b": {**_LLAMA3_COMMON, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "head_dim": 64, "tie_word_embeddings": True,
                     "rope_scaling": _llama3_rope(32.0)},
    "llama-3.2-3b": {**_LLAMA3_COMMON, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                     "num_attention_heads": 24, "head_dim": 128, "tie_word_embeddings": True,
                     "rope_scaling": _llama3_rope(32.0)},
    "llama-3.1-8b": {**_LLAMA3_COMMON, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "head_dim": 128, "tie_word_embeddings": False,
                     "rope_scaling": _llama3_rope(8.0)},
})

# Hugging Face hub ids whose architecture is a preset: `grpo plan` sizes a run on these
# without downloading anything (the Instruct and base checkpoints share the shapes).
HUB_PRESETS: dict[str, str] = {
    **{f"Qwen/Qwen2.5-{size}{suffix}": f"qwen2.5-{size.lower()}"
       for size in ("0.5B", "1.5B", "3B", "7B") for suffix in ("", "-Instruct")},
    **{f"Qwen/Qwen3-{size}{suffix}": f"qwen3-{size.lower()}"
       for size in ("0.6B", "1.7B", "4B", "8B") for suffix in ("", "-Base")},
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
    "Qwen/Qwen3-30B-A3B-Base": "qwen3-30b-a3b",
    "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b",
    "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
}


def hub_preset(hub_id: str) -> str | None:
    """The preset name of a known hub id (case-insensitive), or None."""
    lowered = {k.lower(): v for k, v in HUB_PRESETS.items()}
    return lowered.get(str(hub_id).strip().lower())


# Fields an override may set: the architecture, plus the HF switches that from_hf
# checks (so e.g. `use_sliding_window: true` is refused there, not ignored here).
OVERRIDABLE: frozenset[str] = frozenset(CONFIG_FIELDS) | {
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "rope_scaling",
    "rope_parameters",
    "attention_dropout",
    # mixture-of-experts families (Qwen3-MoE)
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
}


def preset_hf_dict(name: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The HF config fields of preset ``name`` with ``overrides`` applied."""
    if name not in PRESETS:
        raise UserError(f"Unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - OVERRIDABLE)
    if unknown:
        raise UserError(
            f"Unknown config field(s) in model.random.overrides: {', '.join(unknown)}. "
            f"Known fields: {', '.join(sorted(OVERRIDABLE))}."
        )
    return {**PRESETS[name], **overrides}


def preset_family(name: str) -> str:
    """The model plugin (family) name of preset ``name``, without importing JAX."""
    from grpo.models.families import resolve_family

    return resolve_family(preset_hf_dict(name), where=f"preset {name!r}").name


def preset_config(name: str, overrides: Mapping[str, Any] | None = None) -> Any:
    """The family config (e.g. :class:`~grpo.models.qwen3.Qwen3Config`) of preset ``name``
    with ``overrides`` applied, read by the preset's model plugin."""
    from grpo.models.families import resolve_family

    hf = preset_hf_dict(name, overrides)
    return resolve_family(hf, where=f"preset {name!r}").config_from_hf(hf)


def from_random_config(random_config: Any) -> Any:
    """From a :class:`grpo.core.config.RandomModelConfig` (``preset`` + ``overrides``)."""
    return preset_config(random_config.preset, random_config.overrides)


__all__ = ["HUB_PRESETS", "OVERRIDABLE", "PRESETS", "from_random_config", "hub_preset", "preset_config", "preset_family",
           "preset_hf_dict"]
