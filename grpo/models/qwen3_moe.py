"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): dense Qwen3 attention with a
mixture-of-experts block in place of every layer's MLP.

transformers ``modeling_qwen3_moe``: the router ("gate", [experts, hidden], no bias)
gives each token a softmax over the experts (float32), the top ``num_experts_per_tok``
are kept and, with ``norm_topk_prob``, renormalised to sum to one; the token's output is
the gate-weighted sum of those experts' SwiGLU MLPs (``moe_intermediate_size`` wide). No
shared expert (that is Qwen2-MoE). The block is :func:`grpo.models.layers.moe.moe_block`.

Refused: ``decoder_sparse_step`` other than 1 and non-empty ``mlp_only_layers`` (no
published Qwen3-MoE checkpoint mixes dense and sparse layers), and what dense Qwen3
refuses (``attention_bias``, sliding windows, rope scaling).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from grpo.core.errors import UserError
from grpo.models.qwen3 import Qwen3Config

MOE_PARAMS: tuple[str, ...] = ("router", "expert_gate", "expert_up", "expert_down")
"""The stacked per-layer parameters of a mixture-of-experts block, in place of the MLP's."""


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE (transformers ``Qwen3MoeConfig``, ``Qwen3MoeForCausalLM``).

    ``intermediate_size`` is kept for the HF round trip (transformers' dense-layer width);
    every layer here is sparse, with ``num_experts`` experts of ``moe_intermediate_size``.
    """

    family: ClassVar[str] = "qwen3_moe"
    model_type: ClassVar[str] = "qwen3_moe"
    hf_architecture: ClassVar[str] = "Qwen3MoeForCausalLM"

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{f} must be a positive integer (got {v!r})")
        if not problems and self.num_experts_per_tok > self.num_experts:
            problems.append(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}"
            )
        if not problems and self.num_experts > 32767:
            problems.append(f"num_experts={self.num_experts}: routed expert ids are stored as int16 (at most 32767)")
        if problems:
            raise UserError(f"Invalid {self.label} config:", problems=problems)

    @classmethod
    def _family_problems(cls, get: Any) -> list[str]:
        problems = super()._family_problems(get)
        step = get("decoder_sparse_step", 1)
        if step not in (1, None):
            problems.append(f"decoder_sparse_step={step}: only 1 (every layer sparse) is implemented")
        if get("mlp_only_layers"):
            problems.append(f"mlp_only_layers={list(get('mlp_only_layers'))}: dense layers in a Qwen3-MoE "
                            "are not implemented (every layer is sparse)")
        return problems

    @classmethod
    def _family_fields(cls, get: Any) -> dict[str, Any]:
        # transformers maps num_experts onto num_local_experts in a saved config.json
        experts = get("num_experts", None) or get("num_local_experts", None)
        return {
            "num_experts": experts,
            "num_experts_per_tok": get("num_experts_per_tok"),
            "moe_intermediate_size": get("moe_intermediate_size"),
            "norm_topk_prob": bool(get("norm_topk_prob", False)),
            "router_aux_loss_coef": float(get("router_aux_loss_coef", 0.001) or 0.0),
        }

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            **super().to_hf_dict(), "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
            "router_aux_loss_coef": self.router_aux_loss_coef, "decoder_sparse_step": 1, "mlp_only_layers": [],
        }

    def to_hf(self) -> Any:
        from transformers import Qwen3MoeConfig as HF

        return HF(**self.to_hf_dict())

    def layer_params(self) -> tuple[str, ...]:
        dense = ("gate_proj", "up_proj", "down_proj")
        return tuple(n for n in super().layer_params() if n not in dense) + MOE_PARAMS

    def _layer_specs(self) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        L, D, X, M = self.num_hidden_layers, self.hidden_size, self.num_experts, self.moe_intermediate_size
        return {
            **super()._layer_specs(),
            "layers.router": ((L, D, X), ("layers", "embed", "router_experts")),
            "layers.expert_gate": ((L, X, D, M), ("layers", "experts", "embed", "expert_mlp")),
            "layers.expert_up": ((L, X, D, M), ("layers", "experts", "embed", "expert_mlp")),
            "layers.expert_down": ((L, X, M, D), ("layers", "experts", "expert_mlp", "embed")),
        }

    def active_params(self) -> int:
        """Parameters one token reads: every parameter but the experts it is not routed to."""
        per_expert = 3 * self.hidden_size * self.moe_intermediate_size * self.num_hidden_layers
        return self.num_params() - (self.num_experts - self.num_experts_per_tok) * per_expert


__all__ = ["MOE_PARAMS", "Qwen3MoeConfig"]
