"""The built-in model families (Qwen2/Qwen2.5, Qwen3, Qwen3-MoE, Llama 3.x) in Flax NNX, and Hugging
Face checkpoints in and out.

- :mod:`grpo.models.decoder` — the shared :class:`Decoder` module (embed -> the scanned
  stack of layers -> norm), :class:`KVCache` and the padding/position helpers;
  :mod:`grpo.models.config` — :class:`DecoderConfig`, the architecture.
- :mod:`grpo.models.layers` — one decoder layer, room by room: projection (QLoRA, LoRA),
  attention (dense, a blocked kernel per device, paged), MLP, norms and RoPE. The Pallas
  kernels they run are :mod:`grpo.kernels`.
- :mod:`grpo.models.qwen2`, :mod:`grpo.models.qwen3`, :mod:`grpo.models.qwen3_moe`,
  :mod:`grpo.models.llama` — each family's config (its switches and HF config translation). The model plugins that
  wrap them are in :mod:`grpo.plugins.models`; :mod:`grpo.models.families` picks one
  for a checkpoint.
- :mod:`grpo.models.loading` — :func:`load_hf`, :func:`random_init`, :func:`save_hf`,
  :func:`build_model` (all sharded on a ``jax.sharding.Mesh``).
- :mod:`grpo.models.classifier` — sequence classifiers (reward models): a family's decoder
  and a score head, loaded from ``*ForSequenceClassification`` checkpoints.
- :mod:`grpo.models.rollout_quant` — a low-precision rollout's weights: int8/fp8 codes and
  per-output-channel scales, quantized once per sync (``rollout.quantization``).
- :mod:`grpo.models.presets` — ``tiny``, ``tiny-moe`` and the published Qwen2.5, Qwen3,
  Qwen3-30B-A3B and Llama 3 sizes.
- :mod:`grpo.models.tiny` — a tiny checkpoint and tokenizer written locally.

Names are imported lazily, so ``grpo.models.cli`` and ``grpo.models.presets`` users do
not pay for what they do not use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "Decoder": "grpo.models.decoder",
    "DecoderConfig": "grpo.models.decoder",
    "LlamaConfig": "grpo.models.llama",
    "Qwen3Config": "grpo.models.qwen3",
    "Qwen3MoeConfig": "grpo.models.qwen3_moe",
    "Qwen2": "grpo.models.qwen2",
    "Qwen2Config": "grpo.models.qwen2",
    "KVCache": "grpo.models.decoder",
    "positions_from_mask": "grpo.models.decoder",
    "repeat_batch": "grpo.models.decoder",
    "CheckpointError": "grpo.models.loading",
    "build_model": "grpo.models.loading",
    "load_hf": "grpo.models.loading",
    "random_init": "grpo.models.loading",
    "save_hf": "grpo.models.loading",
    "PRESETS": "grpo.models.presets",
    "preset_config": "grpo.models.presets",
    "write_tiny_checkpoint": "grpo.models.tiny",
    "write_tiny_tokenizer": "grpo.models.tiny",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'grpo.models' has no attribute {name!r}")
