"""Qwen2/Qwen2.5 in Flax NNX and Hugging Face checkpoints in and out.

- :mod:`grpo.models.qwen2` — :class:`Qwen2Config`, the :class:`Qwen2` module,
  :class:`KVCache` and the padding/position helpers.
- :mod:`grpo.models.loading` — :func:`load_hf`, :func:`random_init`, :func:`save_hf`,
  :func:`build_model` (all sharded on a ``jax.sharding.Mesh``).
- :mod:`grpo.models.presets` — ``tiny`` and the Qwen2.5 sizes.
- :mod:`grpo.models.tiny` — a tiny checkpoint and tokenizer written locally.

Names are imported lazily, so ``grpo.models.cli`` and ``grpo.models.presets`` users do
not pay for what they do not use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "Qwen2": "grpo.models.qwen2",
    "Qwen2Config": "grpo.models.qwen2",
    "KVCache": "grpo.models.qwen2",
    "positions_from_mask": "grpo.models.qwen2",
    "repeat_batch": "grpo.models.qwen2",
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
