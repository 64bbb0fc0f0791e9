"""Built-in model families: ``qwen2`` (Qwen2/Qwen2.5), ``qwen3`` (dense Qwen3), ``llama``
(Llama 3.x).

All three are the shared decoder of :mod:`grpo.models.decoder` with a family config
(:class:`~grpo.models.qwen2.Qwen2Config`, :class:`~grpo.models.qwen3.Qwen3Config`,
:class:`~grpo.models.llama.LlamaConfig`) that sets its switches and reads its HF config.
:class:`DecoderFamily` is the :class:`grpo.ModelPlugin` for any such family; a third
party whose architecture is the same decoder subclasses it and names its config class
(a dotted path, so importing the plugin does not import JAX).

Import-light: JAX and Flax are imported inside the methods.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Mapping, Sequence

from grpo.core.contracts import ModelPlugin
from grpo.core.hookspecs import hookimpl


class DecoderFamily(ModelPlugin):
    """A :class:`grpo.ModelPlugin` for the shared decoder (:class:`grpo.models.decoder.Decoder`).

    Subclasses set ``name``, ``model_types``, ``architectures`` and ``config_class``
    (``"module:Class"`` of a :class:`~grpo.models.decoder.DecoderConfig` subclass whose
    ``family`` is ``name``).
    """

    config_class: ClassVar[str] = ""

    def config_type(self) -> Any:
        module, _, attr = self.config_class.partition(":")
        return getattr(importlib.import_module(module), attr)

    def config_from_hf(self, hf_config: Any) -> Any:
        return self.config_type().from_hf(hf_config)

    def hf_config(self, config: Any) -> dict[str, Any]:
        from grpo.models.hf import hf_config_dict

        return hf_config_dict(config)

    def param_specs(self, config: Any) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        return config.param_specs()

    def tensor_maps(self, config: Any) -> Sequence[Any]:
        from grpo.models.hf import tensor_maps

        return tensor_maps(config)

    def build(
        self,
        config: Any,
        *,
        rngs: Any,
        param_dtype: Any = "float32",
        compute_dtype: Any = "float32",
        remat: str = "none",
        attention_impl: Any = "xla",
        mesh: Any = None,
        activation_rules: Mapping[str, Any] | None = None,
    ) -> Any:
        from grpo.models.decoder import Decoder

        return Decoder(
            config, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat,
            attention_impl=attention_impl, mesh=mesh, activation_rules=activation_rules,
        )


class Qwen2Family(DecoderFamily):
    name = "qwen2"
    description = "Qwen2 / Qwen2.5 (model_type qwen2): biases on q/k/v, GQA, tied or untied head."
    model_types = ("qwen2",)
    architectures = ("Qwen2ForCausalLM",)
    config_class = "grpo.models.qwen2:Qwen2Config"
    refused_model_types = {
        "qwen2_moe": "Qwen2-MoE (model_type qwen2_moe) is not implemented: grpo's qwen2 plugin is dense only.",
    }


class Qwen3Family(DecoderFamily):
    name = "qwen3"
    description = "Qwen3 dense (model_type qwen3): RMSNorm on q/k heads, no qkv bias, free head_dim."
    model_types = ("qwen3",)
    architectures = ("Qwen3ForCausalLM",)
    config_class = "grpo.models.qwen3:Qwen3Config"
    refused_model_types = {
        "qwen3_moe": "MoE Qwen3 (model_type qwen3_moe, e.g. Qwen3-30B-A3B) is not implemented: grpo's qwen3 "
        "plugin is dense only (Qwen3-0.6B ... 32B).",
    }


class LlamaFamily(DecoderFamily):
    name = "llama"
    description = "Llama 3.x (model_type llama): no biases, GQA, llama3 rope scaling, tied head for 3.2 1B/3B."
    model_types = ("llama",)
    architectures = ("LlamaForCausalLM",)
    config_class = "grpo.models.llama:LlamaConfig"
    tool_call_format = "llama3"  # Llama 3.1 JSON tool calling: the turn is {"name": ..., "parameters": {...}}
    refused_model_types = {
        "llama4": "Llama 4 (model_type llama4, MoE and multimodal) is not implemented; the llama plugin is Llama 3.x.",
    }


@hookimpl
def register_models(register):
    register(Qwen2Family())
    register(Qwen3Family())
    register(LlamaFamily())


__all__ = ["DecoderFamily", "LlamaFamily", "Qwen2Family", "Qwen3Family"]
