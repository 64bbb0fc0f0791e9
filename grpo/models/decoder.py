"""The decoder every built-in model family shares (Qwen2/2.5, Qwen3, Llama 3.x), in Flax NNX.

Qwen2, Qwen3 and Llama 3 are one architecture with a few switches: biases on the q/k/v
projections (Qwen2), a per-head RMSNorm on q and k before RoPE (Qwen3), a ``head_dim``
independent of ``hidden_size / heads`` (Qwen3, and allowed for all), and the ``llama3``
RoPE frequency scaling (Llama 3.1/3.2). A family is a :class:`DecoderConfig` subclass
that sets the switches (class variables) and translates its Hugging Face config; the
layers (:mod:`grpo.models.layers`), the KV cache, the scan over layers and the sharding
code exist once.

What the rest of the framework uses
-----------------------------------

- :class:`DecoderConfig` (:mod:`grpo.models.config`) — the architecture (HF field
  names); each family subclass
  (:class:`grpo.models.qwen2.Qwen2Config`, :class:`grpo.models.qwen3.Qwen3Config`,
  :class:`grpo.models.llama.LlamaConfig`) builds it from a transformers config with
  ``from_hf`` (which refuses what is not implemented: sliding-window attention, rope
  scalings other than the family's, other activations, quantization) and turns it back
  with ``to_hf_dict``; the translation itself is :mod:`grpo.models.hf`'s, beside the HF
  tensor layout.
- :class:`Decoder` — the NNX module (``Qwen2`` is the same class). Build it with
  :func:`grpo.models.loading.load_hf` or :func:`grpo.models.loading.random_init` (both
  create every parameter directly in its sharding); the constructor here is the
  unsharded building block they trace.

  ``hidden, cache = model(tokens, positions, kv_mask, cache=None, write_index=None)``

  * ``tokens`` [B, T] int32, ``positions`` [B, T] int32 (RoPE positions; for a padded
    batch use :func:`positions_from_mask`, so the first real token of every row is at 0).
  * ``kv_mask`` [B, S] bool, which key slots hold real tokens (``None``: all). It is
    combined with causality *by slot index*: the query in slot ``i`` sees key slots
    ``<= i``. Without a cache the slots are the T input tokens (S = T); with a cache they
    are the cache's S slots and the T queries occupy slots ``write_index + [0, T)``.
    So a left-padded batch works as is, and a sampler can pass one constant mask for the
    whole generation: prompt padding as False, every later slot True (slots not yet
    written are hidden by causality).
  * ``cache``: a :class:`KVCache` from :meth:`Decoder.init_cache`; ``write_index`` a
    scalar int (python or traced) — the slot of the first of the T tokens, the same for
    every row. Keys/values are written with ``lax.dynamic_update_slice`` in place, so a
    jitted step with the cache donated (``donate_argnames``) does not copy it. The caller
    keeps ``write_index + T <= max_length`` (XLA clamps out-of-range updates).
    Attention reads all S slots of the cache it is given, so prefill into a cache of
    exactly the prompt length and grow it (``jnp.pad`` on the slot axis) for decoding.
  * Returns the final-normed hidden states [B, T, D] in the compute dtype and the
    updated cache (``None`` without one).

- ``hidden, paged = model(tokens [B, 1], positions [B, 1], cache=PagedKVCache(...),
  paged=PagedSpec(...))`` — one decode step over a paged KV cache
  (:mod:`grpo.models.layers.paged`: a pool of pages and a page table per row; the
  continuous-batching sampler's decode): each live row's key/value is written at token
  ``lengths`` of its pages and its query attends over its own ``lengths + 1`` tokens only.
- ``hidden, cache, routing = model(..., moe=MoeCall(...))`` — a mixture-of-experts
  family (Qwen3-MoE) also returns its layers' routing
  (:class:`~grpo.models.layers.moe.LayerRouting`, each field stacked [L, ...]: the experts
  every token used, the load and router statistics of the tokens ``MoeCall.mask``
  counts); ``MoeCall.replay`` [L, B, T, k] (-1: none) replays another forward's experts
  (``use_replay``) or is only compared with the recomputed ones.
- :meth:`Decoder.head_weight` — the output head [D, V] (the transposed embedding when
  tied), for losses that fuse the head matmul; :meth:`Decoder.logits` — float32 logits.
- :meth:`KVCache.repeat` — prefill B prompts once, then decode B*K sequences (each row
  repeated K times in place: rows ``b*K .. b*K+K-1`` come from prompt ``b``); repeat the
  ``kv_mask`` and positions the same way with :func:`repeat_batch`.
- :meth:`Decoder.attach_adapters` / :meth:`Decoder.use_adapters` — LoRA adapters
  (:func:`grpo.models.lora.apply_lora` attaches them) and the switch that turns them off
  for the reference pass.

Layers
------

``Decoder.__call__`` reads as embed -> layers -> norm. One layer is module-level pure
functions (:mod:`grpo.models.layers`) of a frozen
:class:`~grpo.models.layers.context.LayerContext` (what is fixed for the call: config,
compute dtype, mesh and rules, quantization, adapters and dropout keys, RoPE tables, the
attention form and its mask) and the layer's parameters:
:func:`~grpo.models.layers.projection.project` (a projection, with QLoRA dequantization
and the LoRA term), :func:`~grpo.models.layers.attention.qkv` (norm, q/k/v, RoPE),
:func:`~grpo.models.layers.attention.attend` (cache write and attention),
:func:`out_and_mlp` (output projection and :func:`~grpo.models.layers.mlp.mlp_block`);
:func:`layer_function` composes them under the remat policy and :func:`run_layers` scans
it. The feed-forward block is :func:`~grpo.models.layers.mlp.mlp_block`, or
:func:`~grpo.models.layers.moe.moe_block` for a family with experts.

Layout and numerics
-------------------

Decoder layers are stacked (a leading ``layers`` axis on every layer parameter) and run
with ``lax.scan``, so compile time does not grow with depth. Every parameter carries its
logical axis names in the ``out_sharding`` metadata (e.g. ``("layers", "embed", "heads",
"head_dim")`` for the query projection); :data:`grpo.sharding.PARAM_RULES` maps
them to mesh axes. Attention keeps K/V at ``num_key_value_heads`` and goes through
``jax.nn.dot_product_attention``, whose grouped einsum never repeats them. Matmuls run in
``compute_dtype``; RMSNorm statistics, RoPE and the attention softmax run in float32.
The residual stream is kept in ``compute_dtype`` (as transformers does). RoPE inverse
frequencies are computed on the host in float32 in transformers' operation order
(:func:`grpo.models.layers.rope.rope_inv_freq`), so the ``llama3`` scaling's band edges
fall where transformers' do.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Literal, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from grpo.core.errors import UserError
from grpo.models.config import DecoderConfig
from grpo.models.layers.attention import CACHE_AXES, KVCache, attend, attention_mask, qkv
from grpo.models.layers.context import LayerContext, constrain
from grpo.models.layers.mlp import mlp_block
from grpo.models.layers.moe import MoeCall, moe_block
from grpo.models.layers.norms import rms_norm
from grpo.models.layers.paged import PagedKVCache, PagedSpec
from grpo.models.layers.projection import project
from grpo.models.layers.rope import apply_rope, rope_inv_freq, rope_tables
from grpo.sharding import ACTIVATION_RULES

Remat = Literal["none", "full", "dots"]
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots")
DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# --------------------------------------------------------------------------- inputs


def repeat_batch(x: jax.Array, n: int, *, axis: int = 0) -> jax.Array:
    """Each row along ``axis`` repeated ``n`` times in place (matches :meth:`KVCache.repeat`)."""
    return jnp.repeat(x, n, axis=axis)


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """RoPE positions for a padded batch: [B, T] mask -> [B, T] int32.

    Each row counts its real tokens from 0 (left padding shifts nothing); padding slots
    get the position of the previous real token, or 0 (their outputs are never used).
    """
    m = mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0).astype(jnp.int32)


# --------------------------------------------------------------------------- module

def _param(value: jax.Array, names: Sequence[str]) -> nnx.Param:
    # Logical names live in flax's standard `out_sharding` metadata; eager sharding is
    # off because the names are logical, not mesh axes — the loaders place each array
    # in its NamedSharding themselves (grpo.sharding.fit_sharding).
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def _dtype(d: Any) -> Any:
    if isinstance(d, str):
        if d not in DTYPES:
            raise UserError(f"Unknown dtype {d!r}; choose one of {sorted(DTYPES)}.")
        return DTYPES[d]
    return jnp.dtype(d).type


def _dtype_name(d: Any) -> str:
    return jnp.dtype(_dtype(d)).name


class DecoderLayers(nnx.Module):
    """The stacked parameters of all decoder layers (leading axis: layer)."""

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, param_dtype: Any):
        specs = config.param_specs()
        std = config.initializer_range
        for name in config.layer_params():
            shape, names = specs[f"layers.{name}"]
            if name.endswith("norm"):
                value = jnp.ones(shape, param_dtype)
            elif name.endswith("bias"):
                value = jnp.zeros(shape, param_dtype)
            else:
                value = (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(param_dtype)
            setattr(self, name, _param(value, names))


# --------------------------------------------------------------------------- the layer stack
# One decoder layer composed of the functions of grpo.models.layers (pure in a
# LayerContext, what is fixed for one call of the model, and the layer's parameters p:
# name -> one layer's slice of the stacked arrays). Decoder.__call__ builds the context
# and scans layer_function over the layers.

DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def out_and_mlp(
    ctx: LayerContext, h: jax.Array, a: jax.Array, p: Mapping[str, jax.Array], layer: jax.Array
) -> tuple[jax.Array, Any]:
    """What follows attention: the output projection of a [B, T, H, E] added to h, then
    the MLP block, or the mixture-of-experts block when the family has experts. Returns
    (h, the layer's :class:`~grpo.models.layers.moe.LayerRouting` or None)."""
    h = h + project(ctx, "bthe,hed->btd", a, p, "o_proj", layer)
    if getattr(ctx.config, "num_experts", 0):
        return moe_block(ctx, h, p, layer)
    return mlp_block(ctx, h, p, layer), None


def _layer(
    ctx: LayerContext, pre: Callable, post: Callable, h: jax.Array, p: Any, kv: Any, layer: jax.Array
) -> tuple[jax.Array, Any]:
    """One layer: ``pre`` (:func:`qkv`), :func:`attend`, ``post`` (:func:`out_and_mlp`),
    each possibly checkpointed."""
    q, k, v = pre(h, p, layer)
    a, kv = attend(ctx, q, k, v, kv)
    h, routing = post(h, a, p, layer)
    return h, kv, routing


def layer_function(ctx: LayerContext, remat: Remat) -> Callable:
    """One decoder layer ``(h, p, kv, layer) -> (h, kv, routing)`` under the ``remat`` policy.

    With ``dots`` and a blocked kernel, the weight matmuls are kept, and the kernel stays
    outside the rematerialised parts: its output and log-sum-exp (linear in T) are saved
    as AD residuals, so the backward pass reruns no attention forward (a remat policy
    cannot name residuals inside a custom_vjp).
    """
    pre = functools.partial(qkv, ctx)
    post = functools.partial(out_and_mlp, ctx)
    if remat == "dots" and ctx.kernel is not None:
        pre = jax.checkpoint(pre, prevent_cse=False, policy=DOTS)
        post = jax.checkpoint(post, prevent_cse=False, policy=DOTS)
    fn = functools.partial(_layer, ctx, pre, post)
    if remat == "full":
        fn = jax.checkpoint(fn, prevent_cse=False)
    elif remat == "dots" and ctx.kernel is None:
        fn = jax.checkpoint(fn, prevent_cse=False, policy=DOTS)
    return fn


def _scan_step(layer_fn: Callable, h: jax.Array, xs: Any) -> tuple[jax.Array, Any]:
    p, layer = xs
    h, _, routing = layer_fn(h, p, None, layer)
    return h, routing


def _scan_cached_step(layer_fn: Callable, carry: Any, xs: Any) -> tuple[Any, Any]:
    h, ck, cv = carry
    p, layer = xs
    h, (ck, cv), routing = layer_fn(h, p, (ck, cv, layer), layer)
    return (h, ck, cv), routing


def run_layers(
    layer_fn: Callable, h: jax.Array, stacked: Mapping[str, jax.Array], num_layers: int, cache: KVCache | None
) -> tuple[jax.Array, KVCache | None, Any]:
    """h [B, T, D] through every layer (``lax.scan`` over the stacked parameters [L, ...]);
    returns h, the updated cache (None without one) and the layers' routing stacked [L, ...]
    (None for a dense model or a call that did not ask for it)."""
    layers = jnp.arange(num_layers, dtype=jnp.int32)
    if cache is None:
        h, routing = jax.lax.scan(functools.partial(_scan_step, layer_fn), h, (stacked, layers))
        return h, None, routing
    # The whole cache rides in the carry: each layer writes only its T new slots in place
    # instead of re-emitting a full per-layer slice as a scan output.
    step = functools.partial(_scan_cached_step, layer_fn)
    (h, ck, cv), routing = jax.lax.scan(step, (h, cache.k, cache.v), (stacked, layers))
    return h, cache._replace(k=ck, v=cv), routing  # a KVCache, or a PagedKVCache with its pool updated


def _query_slots(
    B: int, T: int, cache: KVCache | None, write_index: jax.Array | int | None
) -> tuple[jax.Array, jax.Array | None, int]:
    """(the T queries' slots [T] int32, write_index as a scalar int32 array (None without
    a cache), the number of key slots S), checking the cache against the batch."""
    if cache is None:
        if write_index is not None:
            raise ValueError("write_index is only meaningful with a cache")
        return jnp.arange(T, dtype=jnp.int32), None, T
    if cache.batch_size != B:
        raise ValueError(f"cache batch {cache.batch_size} != tokens batch {B}")
    S = cache.max_length
    if T > S:
        raise ValueError(f"{T} tokens do not fit a cache of {S} slots")
    write_index = jnp.asarray(0 if write_index is None else write_index, jnp.int32)
    if write_index.ndim != 0:
        raise ValueError("write_index must be a scalar (one slot for the whole batch)")
    return write_index + jnp.arange(T, dtype=jnp.int32), write_index, S


class Decoder(nnx.Module):
    """The shared causal LM of every built-in family (see the module docstring for the
    call contract).

    Args:
      config: the architecture.
      rngs: initialisation randomness (normal(0, ``initializer_range``) matrices, zero
        biases, unit norms — transformers' init).
      param_dtype / compute_dtype: ``"float32"``/``"bfloat16"`` (or a dtype).
      remat: ``none``; ``full`` (recompute each layer in the backward pass); ``dots``
        (save the weight matmuls, recompute attention and elementwise work; with a blocked
        attention kernel, its output and log-sum-exp are saved instead and its forward is
        not rerun).
      attention_impl: the attention over whole sequences (no cache, or prefill into a cache of
        exactly the prompt length): an :data:`grpo.kernels.attention.AttentionFn` (a blocked
        kernel, run per device under ``shard_map``), or a string passed to
        ``jax.nn.dot_product_attention`` (``"xla"``; ``None`` = JAX's choice) with the
        materialised mask. Decode always uses the latter form (``"xla"`` for a kernel).
      mesh / activation_rules: when a mesh is given, activations are constrained to the
        logical-axis ``activation_rules`` (default
        :data:`grpo.sharding.ACTIVATION_RULES`) on it.
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = "float32",
        compute_dtype: Any = "float32",
        remat: Remat = "none",
        attention_impl: Any = "xla",
        mesh: Mesh | None = None,
        activation_rules: Mapping[str, Any] | None = None,
    ):
        if remat not in REMAT_POLICIES:
            raise UserError(f"Unknown remat policy {remat!r}; choose one of {list(REMAT_POLICIES)}.")
        self.config = config
        self.param_dtype = _dtype_name(param_dtype)
        self.compute_dtype = _dtype_name(compute_dtype)
        self.remat = remat
        self.attention_impl = attention_impl
        self.mesh = mesh
        self.set_activation_rules(activation_rules)
        pd = _dtype(param_dtype)
        specs = config.param_specs()
        std = config.initializer_range
        shape, names = specs["embed"]
        self.embed = _param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(pd), names)
        self.layers = DecoderLayers(config, rngs=rngs, param_dtype=pd)
        shape, names = specs["final_norm"]
        self.final_norm = _param(jnp.ones(shape, pd), names)
        # LoRA / QLoRA: set by attach_adapters (grpo.models.lora.apply_lora, after the base
        # is built) and use_adapters (the reference pass switches the adapters off).
        self.lora = nnx.data(None)
        self.lora_spec = None
        self.lora_enabled = True
        self.base_quantization = "none"
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            shape, names = specs["lm_head"]
            self.lm_head = _param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(pd), names)

    # ------------------------------------------------------------------ sharding

    def set_activation_rules(self, rules: Mapping[str, Any] | None) -> None:
        """Logical-axis rules for activations (e.g. a rollout style's batch axes via
        :func:`grpo.sharding.with_batch_axes`). Changing them re-traces jits."""
        rules = ACTIVATION_RULES if rules is None else rules
        self.activation_rules = tuple(
            sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in rules.items())
        )

    # ------------------------------------------------------------------ adapters

    def attach_adapters(self, adapters: nnx.Module, spec: Any, *, base_quantization: str = "none") -> None:
        """Give the model LoRA ``adapters`` (``lora.<name>_a|b``, described by ``spec``, a
        :class:`grpo.models.lora.LoraSpec`) and say how the base projections are stored
        (``nf4``/``int8``: QLoRA codes with ``<name>_scale`` beside them). Called by
        :func:`grpo.models.lora.apply_lora`, which builds both."""
        self.lora = nnx.data(adapters)
        self.lora_spec = spec
        self.base_quantization = base_quantization

    def use_adapters(self, enabled: bool) -> "Decoder":
        """Switch the LoRA adapters on (the policy) or off (the base model: the reference
        pass when beta > 0, a rollout of the base) for this model object; nothing changes
        without adapters. The switch is static (part of the graph definition), so set it
        on a model merged inside a jitted function. Returns the model."""
        self.lora_enabled = bool(enabled)
        return self

    # ------------------------------------------------------------------ API

    @property
    def dtype(self) -> Any:
        """The compute dtype."""
        return DTYPES[self.compute_dtype]

    def head_weight(self) -> jax.Array:
        """The output head [D, V] in the parameter dtype (tied: the embedding, transposed)."""
        if self.lm_head is None:
            return self.embed[...].T
        return self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B, T, D] hidden states -> [B, T, V] float32 logits (matmul in the compute dtype,
        float32 accumulation)."""
        dt = self.dtype
        w = self.head_weight().astype(dt)
        head_scale = getattr(self, "rollout_head_scale", None)  # int8 codes (grpo.models.rollout_quant.quantize_head)
        if head_scale is not None:
            w = w * head_scale.astype(dt)
        out = jnp.einsum("btd,dv->btv", hidden.astype(dt), w, preferred_element_type=jnp.float32)
        return constrain(out, ("batch", "length", "vocab"), self.mesh, self.activation_rules)

    def init_cache(self, batch_size: int, max_length: int, *, dtype: Any = None) -> KVCache:
        """An all-zero cache for ``batch_size`` rows of ``max_length`` slots (compute dtype
        by default), sharded by the activation rules when the model has a mesh."""
        c = self.config
        shape = (c.num_hidden_layers, batch_size, max_length, c.num_key_value_heads, c.head_dim)
        dt = self.dtype if dtype is None else _dtype(dtype)
        return KVCache(
            k=constrain(jnp.zeros(shape, dt), CACHE_AXES, self.mesh, self.activation_rules),
            v=constrain(jnp.zeros(shape, dt), CACHE_AXES, self.mesh, self.activation_rules),
        )

    def num_params(self) -> int:
        return self.config.num_params()

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        kv_mask: jax.Array | None = None,
        *,
        cache: KVCache | None = None,
        write_index: jax.Array | int | None = None,
        dropout_keys: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        paged: PagedSpec | None = None,
        moe: MoeCall | None = None,
    ) -> Any:
        if isinstance(cache, PagedKVCache):
            ctx = self._paged_context(tokens, positions, cache, PagedSpec() if paged is None else paged)
        else:
            ctx = self._layer_context(tokens, positions, kv_mask, cache, write_index, dropout_keys, segment_ids)
        if moe is not None:
            if not getattr(self.config, "num_experts", 0):
                raise ValueError(f"moe= asks for routing from a {self.config.label}, which has no experts")
            ctx = dataclasses.replace(ctx, moe=moe)
        h = jnp.take(self.embed[...], tokens, axis=0)  # B T D
        head_scale = getattr(self, "rollout_head_scale", None)
        if head_scale is not None and self.lm_head is None:  # a quantized tied table: codes x their row's scale
            h = h.astype(jnp.float32) * jnp.take(head_scale, tokens, axis=0)[..., None]
        h = h.astype(ctx.dtype)
        h = ctx.constrain(h, ("batch", "length", "embed"))
        layer_fn = layer_function(ctx, self.remat)
        h, new_cache, routing = run_layers(layer_fn, h, self._stacked(ctx), self.config.num_hidden_layers, cache)
        h = rms_norm(h, self.final_norm[...], self.config.rms_norm_eps, ctx.dtype)
        h = ctx.constrain(h, ("batch", "length", "embed"))
        if moe is not None:  # LayerRouting, each field stacked [L, ...]
            return h, new_cache, routing
        return h, new_cache

    def _layer_context(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        kv_mask: jax.Array | None,
        cache: KVCache | None,
        write_index: jax.Array | int | None,
        dropout_keys: jax.Array | None,
        segment_ids: jax.Array | None = None,
    ) -> LayerContext:
        """The call's :class:`LayerContext`: the attention form and its mask, the RoPE
        tables and the adapters in use (the shapes are checked here).

        ``segment_ids`` [B, T] int32 (packed sequences, no cache): a query sees the keys up
        to itself with its own id (0 = bin padding, which sees only padding); ``kv_mask``
        is then ignored. ``dropout_keys``: [B, 2] one per row, or [B, T, 2] one per token
        (packed: each token's row's key)."""
        c = self.config
        B, T = tokens.shape
        if positions.shape != (B, T):
            raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")
        # Whole sequences (the update, the reference pass, prefill into a cache of exactly
        # T slots from slot 0) may take a blocked kernel; decode steps take the XLA form.
        whole = cache is None or (isinstance(write_index, int) and write_index == 0 and cache.max_length == T)
        kernel = self.attention_impl if (whole and callable(self.attention_impl)) else None
        q_slots, write_index, S = _query_slots(B, T, cache, write_index)
        if kv_mask is None:
            kv_mask = jnp.ones((B, S), bool)
        if kv_mask.shape != (B, S):
            raise ValueError(f"kv_mask {kv_mask.shape} must be [batch, {'tokens' if cache is None else 'cache slots'}] = {(B, S)}")
        mask = None
        if segment_ids is not None:
            if cache is not None or segment_ids.shape != (B, T):
                raise ValueError(f"segment_ids {segment_ids.shape} need whole sequences [batch, tokens] = {(B, T)}")
            segment_ids = segment_ids.astype(jnp.int32)
            if kernel is None:
                mask = attention_mask(jnp.ones((B, S), bool), q_slots) & (
                    segment_ids[:, None, :, None] == segment_ids[:, None, None, :])  # B 1 T S
        elif kernel is None:
            mask = attention_mask(kv_mask, q_slots)  # B 1 T S
        else:  # 1 = real token, 0 = padding: the kernel masks causally within a segment
            segment_ids = kv_mask.astype(jnp.int32)
        # Plain RoPE keeps its in-graph frequencies; a scaled one is a host constant.
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta, c.inv_freq() if c.rope_scaling else None)
        spec = self.lora_spec if (self.lora is not None and self.lora_enabled) else None
        drop = spec is not None and spec.dropout > 0 and dropout_keys is not None
        if drop and dropout_keys.ndim == 2:  # one key per row: every token of the row reads it
            dropout_keys = jnp.broadcast_to(dropout_keys[:, None, :], (B, T, dropout_keys.shape[-1]))
        return LayerContext(
            config=c, dtype=self.dtype, mesh=self.mesh, rules=self.activation_rules,
            quantization=self.base_quantization, lora=spec, dropout_keys=dropout_keys if drop else None,
            positions=positions,
            cos=cos, sin=sin, kernel=kernel, dense_impl="xla" if callable(self.attention_impl) else self.attention_impl,
            mask=mask, segment_ids=segment_ids, write_index=write_index,
        )

    def _paged_context(self, tokens: jax.Array, positions: jax.Array, cache: PagedKVCache,
                       paged: PagedSpec) -> LayerContext:
        """The context of a decode step over a paged cache: one token per row, written at
        token ``cache.lengths`` of the row's pages (positions are the caller's: RoPE
        positions equal those indices when a row's prompt starts at token 0)."""
        c = self.config
        B, T = tokens.shape
        if T != 1 or positions.shape != (B, 1) or cache.page_table.shape[0] != B:
            raise ValueError(f"a paged decode step takes one token per row: tokens {tokens.shape}, positions "
                             f"{positions.shape}, page table {cache.page_table.shape}")
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta, c.inv_freq() if c.rope_scaling else None)
        spec = self.lora_spec if (self.lora is not None and self.lora_enabled) else None
        return LayerContext(
            config=c, dtype=self.dtype, mesh=self.mesh, rules=self.activation_rules,
            quantization=self.base_quantization, lora=spec, dropout_keys=None, positions=positions, cos=cos,
            sin=sin, kernel=None, dense_impl="xla", mask=None, segment_ids=None, write_index=None,
            paged=(cache.page_table, cache.lengths, cache.live, paged),
        )

    def _stacked(self, ctx: LayerContext) -> dict[str, jax.Array]:
        """Every stacked layer array [L, ...] the layer functions read, by name: the base
        parameters, their quantization scales (``<name>_scale``) and the adapters in use
        (``<name>_lora_a|b``)."""
        names = self.config.layer_params()
        stacked = {name: getattr(self.layers, name)[...] for name in names}
        if ctx.quantization != "none":
            for name in names:
                if hasattr(self.layers, f"{name}_scale"):
                    stacked[f"{name}_scale"] = getattr(self.layers, f"{name}_scale")[...]
        # A quantized rollout's per-channel scales (grpo.models.rollout_quant.merge_rollout).
        for name, scale in (getattr(self, "rollout_scales", None) or {}).items():
            stacked[f"{name}_qscale"] = scale
        if ctx.moe is not None and ctx.moe.replay is not None:
            stacked["moe_replay"] = ctx.moe.replay  # L B T k: each layer reads its slice
        if ctx.lora is not None:
            for name in ctx.lora.targets:
                stacked[f"{name}_lora_a"] = getattr(self.lora, f"{name}_a")[...]
                stacked[f"{name}_lora_b"] = getattr(self.lora, f"{name}_b")[...]
        return stacked


__all__ = [
    "CACHE_AXES",
    "DTYPES",
    "Decoder",
    "DecoderConfig",
    "KVCache",
    "LayerContext",
    "apply_rope",
    "attend",
    "attention_mask",
    "constrain",
    "layer_function",
    "mlp_block",
    "out_and_mlp",
    "positions_from_mask",
    "project",
    "qkv",
    "repeat_batch",
    "rms_norm",
    "rope_inv_freq",
    "rope_tables",
    "run_layers",
]
