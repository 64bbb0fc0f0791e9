"""The attention kernel contract, and the kernel ``model.attention: auto`` picks per platform."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from pydantic import BaseModel

from grpo.core.contracts.base import _PluginBase

ATTENTION_PLATFORMS: tuple[str, ...] = ("cpu", "gpu", "tpu")
AUTO_ATTENTION: dict[str, str] = {"tpu": "splash", "gpu": "pallas_gpu"}
"""platform -> the attention plugin ``model.attention: auto`` runs; other platforms: ``xla``."""


def auto_attention(platform: str) -> str:
    """The attention plugin ``auto`` means on ``platform``."""
    return AUTO_ATTENTION.get(platform, "xla")


class AttentionPlugin(_PluginBase):
    """Causal self-attention over whole sequences: the update's forward and backward, the
    reference pass and prefill (decode, one query per row against the cache, keeps the
    model's own XLA attention). Chosen by ``model.attention`` (``auto``: the engine's pick
    for the platform), options in ``model.attention_options``.

    ``platforms`` lists where the kernel compiles; a Pallas kernel may also list
    ``interpret_platforms``, where it runs in Pallas interpret mode (CPU tests: exact, slow).

    :meth:`build` returns a function with the contract of
    :data:`grpo.kernels.attention.AttentionFn` — ``out = fn(q, k, v, segment_ids, *,
    scale)``, q [B, T, H, E], k/v [B, T, K, E], segment ids [B, T] int32 (query slot i
    sees key slot j iff j <= i and their ids are equal), out [B, T, H, E] — which the
    model runs per device under ``shard_map``; or ``None``: the model's own masked XLA
    attention. It must be hashable (a frozen dataclass): it is part of the model's
    static structure. JAX is imported inside ``build``, never at module import.
    """

    platforms: ClassVar[tuple[str, ...]] = ATTENTION_PLATFORMS
    interpret_platforms: ClassVar[tuple[str, ...]] = ()

    def check(self, *, platform: str, options: BaseModel) -> list[str]:
        """Problems running on ``platform`` (``cpu``/``gpu``/``tpu``/``unknown``) with these
        options, one sentence each; the default checks ``platforms``."""
        if platform in self.platforms or platform in self.interpret_platforms or platform == "unknown":
            return []
        runs = ", ".join(self.platforms + tuple(f"{p} (interpreted)" for p in self.interpret_platforms))
        return [f"attention {self.name!r} cannot run on {platform}: it runs on {runs}"]

    @abc.abstractmethod
    def build(self, options: BaseModel, *, platform: str) -> Any: ...
