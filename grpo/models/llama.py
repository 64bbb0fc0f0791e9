"""Llama 3.x: the shared decoder without biases, with ``llama3`` RoPE scaling.

Differences from Qwen2 (transformers ``modeling_llama``): no q/k/v biases, and RoPE
frequencies rescaled by ``rope_scaling: {rope_type: llama3, factor, low_freq_factor,
high_freq_factor, original_max_position_embeddings}`` (Llama 3.1 and 3.2), computed
exactly as transformers' ``_compute_llama3_parameters``
(:func:`grpo.models.decoder.rope_inv_freq`). GQA as in every published size; the head is
tied for Llama 3.2 1B/3B and untied for 3.1 8B. Refused: ``attention_bias`` or
``mlp_bias`` true, ``pretraining_tp`` > 1, and every other rope scaling (linear, dynamic,
yarn, longrope).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from grpo.models.decoder import DecoderConfig


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Llama 3.x (transformers ``LlamaConfig``, ``LlamaForCausalLM``)."""

    family: ClassVar[str] = "llama"
    model_type: ClassVar[str] = "llama"
    hf_architecture: ClassVar[str] = "LlamaForCausalLM"
    rope_types: ClassVar[tuple[str, ...]] = ("default", "llama3")

    @classmethod
    def _family_problems(cls, get: Any) -> list[str]:
        problems = []
        for field in ("attention_bias", "mlp_bias"):
            if get(field, False):
                problems.append(f"{field}=true is not implemented for Llama (Llama 3 has no biases)")
        tp = get("pretraining_tp", 1)
        if tp not in (None, 1):
            problems.append(f"pretraining_tp={tp} is not implemented (only 1)")
        return problems

    def to_hf_dict(self) -> dict[str, Any]:
        return {**super().to_hf_dict(), "head_dim": self.head_dim, "attention_bias": False, "mlp_bias": False}

    def to_hf(self) -> Any:
        from transformers import LlamaConfig as HF

        return HF(**self.to_hf_dict())


__all__ = ["LlamaConfig"]
