"""Qwen3 (dense): the shared decoder with a per-head RMSNorm on queries and keys.

Differences from Qwen2 (transformers ``modeling_qwen3``): no q/k/v biases, an RMSNorm
over ``head_dim`` applied to every query and key head before RoPE (one weight vector per
layer for q and one for k), and ``head_dim`` set independently of ``hidden_size`` (128 in
every published size). Tied or untied output head. Refused: ``attention_bias: true``
(no published checkpoint uses it), sliding-window layers, rope scaling, and MoE Qwen3
(``model_type: qwen3_moe``, a different plugin's job).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from grpo.models.decoder import DecoderConfig


@dataclasses.dataclass(frozen=True)
class Qwen3Config(DecoderConfig):
    """Qwen3 dense (transformers ``Qwen3Config``, ``Qwen3ForCausalLM``)."""

    family: ClassVar[str] = "qwen3"
    model_type: ClassVar[str] = "qwen3"
    hf_architecture: ClassVar[str] = "Qwen3ForCausalLM"
    qk_norm: ClassVar[bool] = True

    @classmethod
    def _family_problems(cls, get: Any) -> list[str]:
        if get("attention_bias", False):
            return ["attention_bias=true (biases on q/k/v/o) is not implemented for Qwen3"]
        return []

    def to_hf_dict(self) -> dict[str, Any]:
        # transformers' Qwen3Config defaults head_dim to 128: always write it.
        return {
            **super().to_hf_dict(), "head_dim": self.head_dim, "attention_bias": False, "use_sliding_window": False,
        }

    def to_hf(self) -> Any:
        from transformers import Qwen3Config as HF

        return HF(**self.to_hf_dict())


__all__ = ["Qwen3Config"]
