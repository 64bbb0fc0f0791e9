"""The model family contract: Hugging Face checkpoints in, a Flax NNX causal LM out,
and back."""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Mapping, Sequence

from grpo.core.contracts.base import _PluginBase


class ModelPlugin(_PluginBase):
    """A model family: Hugging Face checkpoints of some ``model_type`` in, a Flax NNX
    causal LM out, and back to a checkpoint transformers loads.

    Which checkpoints: ``model_types`` lists the ``config.json`` ``model_type`` values the
    plugin handles; ``architectures``, when not empty, the ``architectures`` entries it
    accepts (a checkpoint listing others, e.g. ``Qwen2ForSequenceClassification``, is
    refused). ``refused_model_types`` maps model types the family knows it does *not*
    implement (``qwen3_moe``) to a sentence saying so, for the error a user sees. With
    ``model.architecture: auto`` the engine picks the plugin whose ``model_types`` hold
    the checkpoint's; a name picks that plugin and checks it handles the checkpoint.

    The family's *config* is any hashable object (a static jit argument; built-ins use
    :class:`grpo.models.decoder.DecoderConfig`) with at least ``vocab_size``,
    ``hidden_size``, ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``,
    ``tie_word_embeddings``, ``eos_token_id`` and ``family`` (this plugin's name, so a
    model can be exported without being told its family), and methods ``num_params()``,
    ``kv_bytes_per_token(dtype)``.

    Behaviour (JAX lives inside these methods, never at import):

    - :meth:`config_from_hf` — the config from transformers' config object of the
      checkpoint (``AutoConfig.from_pretrained``; a plain ``config.json`` mapping when
      transformers does not know the ``model_type``, and for presets). Raise
      :class:`grpo.UserError` for everything the implementation would get wrong
      (sliding-window layers, an unimplemented rope scaling, quantization, ...), one
      problem per line.
    - :meth:`hf_config` — the ``config.json`` dict of an export (``model_type`` and
      ``architectures`` included) that transformers loads back.
    - :meth:`param_specs` — ``dotted path -> (shape, logical axis names)`` of every
      parameter, with names from the sharding tables (``embed``, ``vocab``, ``heads``,
      ``kv_heads``, ``head_dim``, ``mlp``, ``layers``, ``norm``). The loaders place each
      parameter by these names (:data:`grpo.sharding.PARAM_RULES`), so FSDP, tp
      and memory planning need nothing else from the family.
    - :meth:`tensor_maps` — one :class:`grpo.models.hf.TensorMap` per parameter:
      its HF tensor name (``{i}`` = layer for stacked layer parameters), HF shape, and
      how HF dims split and transpose into ours. The same description loads a slice of
      a tensor straight into its shard and exports it back.
    - :meth:`build` — the unsharded module, created under ``nnx.eval_shape`` (loading)
      or ``jax.jit`` with ``out_shardings`` (random init) by the engine, with parameters
      initialised from ``rngs``. The module's parameters must be ``nnx.Param`` at the
      dotted paths of :meth:`param_specs`.

    The module is what the sampler, the update and the losses use today:

    - ``hidden, cache = model(tokens, positions, kv_mask=None, *, cache=None,
      write_index=None)`` — ``tokens``/``positions`` [B, T] int32, ``kv_mask`` [B, S]
      bool (causal by slot index); returns the final-normed hidden states [B, T, D] and
      the updated cache (see :mod:`grpo.models.decoder` for the slot semantics);
    - ``model.init_cache(batch, max_length, dtype=None)`` — a
      :class:`grpo.models.decoder.KVCache` (``k``/``v`` [layers, batch, slots,
      kv_heads, head_dim]; the sampler repeats and pads it along batch and slots);
    - ``model.head_weight()`` [D, V] (the transposed embedding when tied) and
      ``model.logits(hidden)`` float32 [B, T, V]: losses get hidden states and the head
      weight, never logits;
    - ``model.config``, ``model.dtype`` (compute dtype), ``model.param_dtype``,
      ``model.mesh`` (settable) and ``model.set_activation_rules(rules)``;
    - ``model.use_adapters(enabled) -> model`` — LoRA's adapters on or off (the
      reference pass and ``model.lora.sampler: merged`` run the base alone; a module
      without adapters ignores it).

    :class:`grpo.plugins.models.DecoderFamily` implements all of this for any family
    that is the shared decoder with a :class:`~grpo.models.decoder.DecoderConfig`
    subclass; a new family of that shape overrides ``config_class`` and the names.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    architectures: ClassVar[tuple[str, ...]] = ()
    refused_model_types: ClassVar[Mapping[str, str]] = {}
    tool_call_format: ClassVar[str] = "qwen"
    """The name of the :class:`ToolCallFormat` this family's chat models write tool calls in
    (``qwen``: ``<tool_call>{json}</tool_call>``; ``llama3``: a bare JSON object)."""

    def handles(self, model_type: str | None, architectures: Sequence[str] = ()) -> bool:
        """Whether a checkpoint with this ``model_type`` (and ``architectures``) is ours."""
        if model_type not in self.model_types:
            return False
        return not (self.architectures and architectures and not set(architectures) & set(self.architectures))

    @abc.abstractmethod
    def config_from_hf(self, hf_config: Any) -> Any: ...

    @abc.abstractmethod
    def hf_config(self, config: Any) -> dict[str, Any]: ...

    @abc.abstractmethod
    def param_specs(self, config: Any) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]: ...

    @abc.abstractmethod
    def tensor_maps(self, config: Any) -> Sequence[Any]: ...

    @abc.abstractmethod
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
    ) -> Any: ...
