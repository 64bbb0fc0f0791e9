"""The shared decoder's architecture, :class:`DecoderConfig`: the fields (transformers'
names), the switches a family sets (q/k/v biases, q/k norms, RoPE variants), the checks
of a config, the translation to and from a Hugging Face config (through
:mod:`grpo.models.hf`) and the parameter shapes with their logical axes.

A family (:class:`grpo.models.qwen2.Qwen2Config`, :class:`grpo.models.qwen3.Qwen3Config`,
:class:`grpo.models.llama.LlamaConfig`) is a subclass; :class:`grpo.models.decoder.Decoder`
builds its parameters from :meth:`DecoderConfig.param_specs`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

import jax.numpy as jnp
import numpy as np

from grpo.core.errors import UserError
from grpo.models.hf import LLAMA3_ROPE_KEYS, config_from_hf, hf_fields
from grpo.models.layers.rope import rope_inv_freq


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The shared decoder's architecture. Field names follow transformers' configs.

    A family subclass sets the class variables (the switches and its HF names), adds its
    refusals of an HF config in :meth:`_family_problems` and its own HF fields in
    :meth:`to_hf_dict`. ``head_dim`` 0 means ``hidden_size // num_attention_heads``.
    ``rope_scaling`` is ``()`` (plain RoPE) or the sorted ``(key, value)`` pairs of a
    ``llama3`` scaling (:data:`LLAMA3_ROPE_KEYS`). Hashable, so it can be a static jit
    argument.
    """

    family: ClassVar[str] = "decoder"
    """The model plugin that owns this config (``grpo plugins list``, ``model.architecture``)."""
    model_type: ClassVar[str] = ""
    """transformers' ``model_type`` written to an exported ``config.json``."""
    hf_architecture: ClassVar[str] = ""
    """transformers' causal-LM class name written to ``architectures``."""
    qkv_bias: ClassVar[bool] = False
    """Biases on the q, k and v projections (Qwen2)."""
    qk_norm: ClassVar[bool] = False
    """RMSNorm over ``head_dim`` of every query and key head, before RoPE (Qwen3)."""
    rope_types: ClassVar[tuple[str, ...]] = ("default",)
    """RoPE variants this family implements (``default``; ``llama3`` for Llama)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    rope_scaling: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return self.hf_architecture or self.family

    def __post_init__(self) -> None:
        problems = []
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{f} must be a positive integer (got {v!r})")
        if problems:
            raise UserError(f"Invalid {self.label} config:", problems=problems)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                problems.append(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads} and no head_dim is given"
                )
            else:
                object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not self.rope_theta > 0:
            problems.append(f"rope_theta must be > 0 (got {self.rope_theta!r})")
        if not self.rms_norm_eps > 0:
            problems.append(f"rms_norm_eps must be > 0 (got {self.rms_norm_eps!r})")
        if self.rope_scaling:
            scaling = dict(self.rope_scaling)
            missing = [k for k in LLAMA3_ROPE_KEYS if k not in scaling]
            if "llama3" not in self.rope_types:
                problems.append(f"{self.label} does not implement rope scaling (got {scaling})")
            elif missing or set(scaling) - set(LLAMA3_ROPE_KEYS):
                problems.append(f"a llama3 rope scaling needs exactly {', '.join(LLAMA3_ROPE_KEYS)} (got {scaling})")
            elif not scaling["high_freq_factor"] > scaling["low_freq_factor"] > 0 or not scaling["factor"] > 0:
                problems.append(f"llama3 rope scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0 (got {scaling})")
        if problems:
            raise UserError(f"Invalid {self.label} config:", problems=problems)

    # ------------------------------------------------------------------ HF round trip

    model_types: ClassVar[tuple[str, ...]] = ()
    """``model_type`` values :meth:`from_hf` accepts (default: ``(model_type,)``)."""

    @classmethod
    def from_hf(cls, hf: Any) -> "DecoderConfig":
        """From a transformers config object of this family (or its ``to_dict()``);
        refuses what this implementation would get wrong
        (:func:`grpo.models.hf.config_from_hf`)."""
        return config_from_hf(cls, hf)

    @classmethod
    def label_of(cls) -> str:
        return cls.hf_architecture or cls.family

    @classmethod
    def _family_problems(cls, get: Any) -> list[str]:
        """Family-specific refusals, one sentence each (``get(key, default)`` reads the
        HF config)."""
        return []

    @classmethod
    def _family_fields(cls, get: Any) -> dict[str, Any]:
        """The family's own fields read from the HF config (``get(key, default)``), e.g.
        the experts of a mixture-of-experts family."""
        return {}

    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for the family's transformers config class (no ``model_type``;
        :func:`grpo.models.hf.hf_config_dict` writes the ``config.json``). A family adds
        its own fields to ``super().to_hf_dict()``."""
        return hf_fields(self)

    # ------------------------------------------------------------------ shapes

    def layer_params(self) -> tuple[str, ...]:
        """Names of the stacked per-layer parameters this family has, in a fixed order."""
        out = ["attn_norm", "q_proj"]
        if self.qkv_bias:
            out.append("q_bias")
        out.append("k_proj")
        if self.qkv_bias:
            out.append("k_bias")
        out.append("v_proj")
        if self.qkv_bias:
            out.append("v_bias")
        if self.qk_norm:
            out += ["q_norm", "k_norm"]
        out += ["o_proj", "mlp_norm", "gate_proj", "up_proj", "down_proj"]
        return tuple(out)

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """``path -> (shape, logical axis names)`` of every parameter of :class:`Decoder`.

        Paths are dotted attribute paths (``layers.q_proj``); layer parameters have a
        leading ``layers`` axis of size ``num_hidden_layers``.
        """
        every = self._layer_specs()
        specs = {"embed": ((self.vocab_size, self.hidden_size), ("vocab", "embed"))}
        specs.update({f"layers.{n}": every[f"layers.{n}"] for n in self.layer_params()})
        specs["final_norm"] = ((self.hidden_size,), ("norm",))
        if not self.tie_word_embeddings:
            specs["lm_head"] = ((self.hidden_size, self.vocab_size), ("embed", "vocab"))
        return specs

    def _layer_specs(self) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """``layers.<name> -> (shape, logical axes)`` of every layer parameter a family may
        have (a family with other parameters adds its own)."""
        L, D, F = self.num_hidden_layers, self.hidden_size, self.intermediate_size
        H, K, E = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        return {
            "layers.attn_norm": ((L, D), ("layers", "norm")),
            "layers.q_proj": ((L, D, H, E), ("layers", "embed", "heads", "head_dim")),
            "layers.q_bias": ((L, H, E), ("layers", "heads", "head_dim")),
            "layers.k_proj": ((L, D, K, E), ("layers", "embed", "kv_heads", "head_dim")),
            "layers.k_bias": ((L, K, E), ("layers", "kv_heads", "head_dim")),
            "layers.v_proj": ((L, D, K, E), ("layers", "embed", "kv_heads", "head_dim")),
            "layers.v_bias": ((L, K, E), ("layers", "kv_heads", "head_dim")),
            # one weight per head_dim entry, shared by every head (as transformers does)
            "layers.q_norm": ((L, E), ("layers", "head_dim")),
            "layers.k_norm": ((L, E), ("layers", "head_dim")),
            "layers.o_proj": ((L, H, E, D), ("layers", "heads", "head_dim", "embed")),
            "layers.mlp_norm": ((L, D), ("layers", "norm")),
            "layers.gate_proj": ((L, D, F), ("layers", "embed", "mlp")),
            "layers.up_proj": ((L, D, F), ("layers", "embed", "mlp")),
            "layers.down_proj": ((L, F, D), ("layers", "mlp", "embed")),
        }

    def num_params(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.param_specs().values())

    def kv_bytes_per_token(self, dtype: Any = jnp.bfloat16) -> int:
        """KV-cache bytes one token occupies over all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * jnp.dtype(dtype).itemsize

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim / 2], float32 (see :func:`grpo.models.layers.rope.rope_inv_freq`)."""
        return rope_inv_freq(self.head_dim, self.rope_theta, dict(self.rope_scaling) or None)


__all__ = ["DecoderConfig"]
