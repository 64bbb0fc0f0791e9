"""The rollout engines' option sections (``rollout.continuous``) and the rule of
``rollout.engine: auto``, apart from :mod:`grpo.core.config.schema` so that it stays one
readable module."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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


class RolloutQuantizationConfig(BaseModel):
    """A low-precision rollout (``rollout.quantization``): the sampler's weights and KV
    cache in int8 or fp8; the trainer stays in its own precision."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    weights: Literal["none", "int8", "fp8"] = Field(
        "none",
        description="The rollout's copy of the decoder projections, quantized once per weight sync inside the "
        "engine (update_weights): int8 (symmetric, qmax 127) or fp8 (e4m3); none = the compute dtype. The "
        "trainer's master weights, old/reference log-prob passes and update keep their precision; the sampler's "
        "log-probs are the quantized model's (correct the gap with loss.mismatch). fp8 needs a GPU with fp8 "
        "(sm_89+) or the CPU (the same values, dequantized); TPU v5e/v6e have int8, not fp8.",
    )
    weight_scales: Literal["channel"] = Field(
        "channel", description="Scale granularity of the weights: one float32 scale per output channel and layer."
    )
    kv_cache: Literal["none", "int8", "fp8"] = Field(
        "none",
        description="The continuous engine's KV page pool in int8 or fp8 (e4m3) with scales beside the pages, so "
        "the same HBM holds about twice the rows; none = the compute dtype. The static engine refuses it.",
    )
    kv_scales: Literal["token"] = Field(
        "token",
        description="Scale granularity of the KV pages: one scale per token and KV head, stored in the page "
        "beside its codes (the layout JAX's Pallas TPU paged-attention kernel reads).",
    )
    head: Literal["none", "int8"] = Field(
        "none",
        description="The output head in int8 too (one float32 scale per vocabulary row), quantized with the "
        "projections once per sync; with tied embeddings the one table is quantized, so the input embedding reads "
        "the same codes. none (the default, as vLLM and verl keep it) = the head in the compute dtype. Needs "
        "rollout.quantization.weights.",
    )

    @model_validator(mode="after")
    def _head_needs_weights(self) -> "RolloutQuantizationConfig":
        if self.head != "none" and self.weights == "none":
            raise ValueError(f"rollout.quantization.head={self.head} quantizes the output head in the same once-per-sync program as the "
                             "decoder projections: set rollout.quantization.weights (int8) too, or head: none")
        return self

    @property
    def enabled(self) -> bool:
        return self.weights != "none" or self.kv_cache != "none"


def quantization_problems(rollout: Any, engine: Any, *, base_quantization: str = "none") -> list[str]:
    """What ``rollout.quantization`` asks that the run cannot give (one sentence each):
    ``engine`` is the ``rollout.engine`` plugin (its ``quantized_weights`` and
    ``quantized_kv``: :class:`grpo.RolloutEnginePlugin`), ``base_quantization`` the LoRA
    base's storage (``model.lora.base_quantization``)."""
    q, problems = rollout.quantization, []
    if q.weights != "none" and engine is not None and not getattr(engine, "quantized_weights", False):
        problems.append(f"rollout.quantization.weights={q.weights}: rollout.engine={rollout.engine!r} does not quantize "
                        "its weights; use rollout.engine: static or continuous, or weights: none")
    if q.weights != "none" and base_quantization != "none":
        problems.append(f"rollout.quantization.weights={q.weights} with model.lora.base_quantization="
                        f"{base_quantization}: the QLoRA base is already stored quantized (block-wise, dequantized per "
                        "layer); set one of them to none")
    if q.kv_cache != "none" and engine is not None and not getattr(engine, "quantized_kv", False):
        problems.append(f"rollout.quantization.kv_cache={q.kv_cache}: rollout.engine={rollout.engine!r} keeps its KV "
                        "cache in the compute dtype (the static engine's dense cache is not quantized); use "
                        "rollout.engine: continuous (its page pool is), or kv_cache: none")
    return problems


def quantization_platform_problems(rollout: Any, platform: str) -> list[str]:
    """fp8 where the accelerator has no fp8 matmul: TPUs before v7 (v5e, v5p, v6e have
    int8, not fp8; libtpu 0.0.52 still compiles an e4m3 matmul for a v6e, but int8 reads
    the same bytes more precisely). A GPU or the CPU (the same values, dequantized) may take it."""
    q = rollout.quantization
    if platform != "tpu":
        return []
    return [f"rollout.quantization.{field}=fp8 on a TPU: TPU v5e/v5p/v6e have no fp8 matmul units (bf16 and int8); "
            "int8 reads the same bytes with more precision (7 bits of magnitude against e4m3's 3 of mantissa), so "
            "use int8"
            for field in ("weights", "kv_cache") if getattr(q, field) == "fp8"]


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


__all__ = ["AUTO_CONTINUOUS_FROM", "ContinuousEngineConfig", "RolloutQuantizationConfig", "auto_engine",
           "quantization_platform_problems", "quantization_problems"]
