"""Qwen2 / Qwen2.5: the shared decoder with biases on the q, k and v projections.

:class:`Qwen2Config` is the family's :class:`~grpo.models.decoder.DecoderConfig`;
``Qwen2`` is :class:`~grpo.models.decoder.Decoder` (one module serves every family);
the cache and padding helpers live in :mod:`grpo.models.decoder`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from grpo.models.decoder import Decoder, DecoderConfig

Qwen2 = Decoder


@dataclasses.dataclass(frozen=True)
class Qwen2Config(DecoderConfig):
    """Qwen2 / Qwen2.5 (transformers ``Qwen2Config``, ``Qwen2ForCausalLM``)."""

    family: ClassVar[str] = "qwen2"
    model_type: ClassVar[str] = "qwen2"
    hf_architecture: ClassVar[str] = "Qwen2ForCausalLM"
    qkv_bias: ClassVar[bool] = True

    def to_hf_dict(self) -> dict[str, Any]:
        return {**super().to_hf_dict(), "use_sliding_window": False}

    def to_hf(self) -> Any:
        """A transformers ``Qwen2Config`` describing this architecture."""
        from transformers import Qwen2Config as HFQwen2Config

        return HFQwen2Config(**self.to_hf_dict())


__all__ = ["Qwen2", "Qwen2Config"]
