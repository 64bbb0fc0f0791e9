"""Built-in model families: ``qwen2`` (Qwen2/Qwen2.5), ``qwen3`` (dense Qwen3),
``qwen3_moe`` (Qwen3-MoE: Qwen3-30B-A3B), ``llama`` (Llama 3.x).

All four are the shared decoder of :mod:`grpo.models.decoder` with a family config
(:class:`~grpo.models.qwen2.Qwen2Config`, :class:`~grpo.models.qwen3.Qwen3Config`,
:class:`~grpo.models.qwen3_moe.Qwen3MoeConfig`, :class:`~grpo.models.llama.LlamaConfig`) that sets its switches and reads its HF config,
registered as a :class:`grpo.DecoderFamily` (the :class:`grpo.ModelPlugin` for any such
family; it lives in :mod:`grpo.models.families`). ``grpo.plugins.models.DecoderFamily``
still resolves, with a :class:`DeprecationWarning`, until 0.3: use ``from grpo import
DecoderFamily``.

Import-light: JAX and Flax are imported inside the methods.
"""

from __future__ import annotations

import warnings

from grpo.core.hookspecs import hookimpl
from grpo.models.families import DecoderFamily as _DecoderFamily


class Qwen2Family(_DecoderFamily):
    name = "qwen2"
    description = "Qwen2 / Qwen2.5 (model_type qwen2): biases on q/k/v, GQA, tied or untied head."
    model_types = ("qwen2",)
    architectures = ("Qwen2ForCausalLM",)
    config_class = "grpo.models.qwen2:Qwen2Config"
    refused_model_types = {
        "qwen2_moe": "Qwen2-MoE (model_type qwen2_moe) is not implemented: grpo's qwen2 plugin is dense only.",
    }


class Qwen3Family(_DecoderFamily):
    name = "qwen3"
    description = "Qwen3 dense (model_type qwen3): RMSNorm on q/k heads, no qkv bias, free head_dim."
    model_types = ("qwen3",)
    architectures = ("Qwen3ForCausalLM",)
    config_class = "grpo.models.qwen3:Qwen3Config"


class Qwen3MoeFamily(_DecoderFamily):
    name = "qwen3_moe"
    description = ("Qwen3-MoE (model_type qwen3_moe, e.g. Qwen3-30B-A3B): Qwen3 attention, softmax top-k router, "
                   "dropless grouped-matmul experts, router replay.")
    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)
    config_class = "grpo.models.qwen3_moe:Qwen3MoeConfig"


class LlamaFamily(_DecoderFamily):
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
    register(Qwen3MoeFamily())
    register(LlamaFamily())


def __getattr__(name: str):
    # Moved in 0.2 (grpo.models.families, exported as grpo.DecoderFamily): the old path
    # warns and forwards for one minor version.
    if name == "DecoderFamily":
        warnings.warn("grpo.plugins.models.DecoderFamily is deprecated and goes in grpo 0.3: use "
                      "`from grpo import DecoderFamily`.", DeprecationWarning, stacklevel=2)
        return _DecoderFamily
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LlamaFamily", "Qwen2Family", "Qwen3Family", "Qwen3MoeFamily"]
