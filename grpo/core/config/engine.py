"""The rollout engines' option sections (``rollout.continuous``) and the rule of
``rollout.engine: auto``, apart from :mod:`grpo.core.config.schema` so that it stays one
readable module."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ContinuousEngineConfig(BaseModel):
    """The continuous-batching rollout engine's options (``rollout.engine: continuous``)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    slots: int | Literal["auto"] = Field(
        "auto",
        description="Decode slots (rows decoded at once, over all devices); 0 = every row of the rollout at once. "
        "auto (the default): every row at once while the page pool holds them (pool_pages 0 always does: it is "
        "sized for every slot at the cap, the static cache's bytes), else as many rows as pool_pages holds at "
        "the longest prompt bucket + half of max_new_tokens, per part of the pool (grpo.engine.rollout.paged."
        "slots.auto_slots). A synchronous rollout cannot end before its longest row, so every row at once runs the "
        "fewest steps, chunks and prefills while each chunk computes only its live slots; measured with "
        "`grpo bench rollout --lengths gsm8k-qwen25-3b-v6e8`.",
    )
    page_size: int = Field(16, ge=1, le=65536, description="Tokens per page of the paged KV cache.")
    pool_pages: int = Field(
        0, ge=0, le=100_000_000,
        description="KV pages per device along the rows' mesh axes (each holds the pages of its own slots); "
        "0 = enough for every slot at the length cap (no row is ever evicted). It must hold at least one row of "
        "prompt + max_new_tokens.",
    )
    chunk: int = Field(
        16, ge=1, le=131072,
        description="Decode steps between host boundaries (finished rows leave, queued rows are prefilled).",
    )
    attention: Literal["auto", "reference", "tpu", "gpu"] = Field(
        "auto",
        description="Paged decode attention: auto = the Pallas kernel of a TPU or GPU backend, else the plain-JAX reference.",
    )


    @field_validator("slots", mode="before")
    @classmethod
    def _slots(cls, value: Any) -> Any:
        """One message for both forms (a count or ``auto``), not one per member of the union."""
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1_000_000):
            return value
        raise ValueError("must be auto or an integer greater than or equal to 0 (at most 1,000,000)")


AUTO_CONTINUOUS_FROM = 128
"""``rollout.engine: auto`` picks the continuous engine from this ``max_new_tokens`` on.

Measured with ``grpo bench rollout --preset tiny --lengths gsm8k-qwen25-3b-v6e8`` (bf16,
default options, both engines on the same rows, ratios within one run): see
:func:`auto_engine`."""


def auto_engine(*, max_new_tokens: int, partial_rollouts: bool) -> str:
    """The engine ``rollout.engine: auto`` runs: ``continuous`` where rows stream across
    steps (``train.async.partial_rollouts``: only it can), or where the cap leaves a ragged
    tail to save (``max_new_tokens >= AUTO_CONTINUOUS_FROM``: the static engine decodes
    every row until the longest stops, attending each row's whole cache segment, while the
    continuous one computes only the live slots and their pages); else ``static``, whose
    one batch pays no chunk boundaries and fewer compiles at a short cap, where every row
    stops near the same step. Multi-turn tasks follow the same rule (``max_new_tokens`` is
    the whole trajectory's budget); both engines run them."""
    if partial_rollouts or max_new_tokens >= AUTO_CONTINUOUS_FROM:
        return "continuous"
    return "static"


__all__ = ["AUTO_CONTINUOUS_FROM", "ContinuousEngineConfig", "auto_engine"]
