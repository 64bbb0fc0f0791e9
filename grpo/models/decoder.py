"""The decoder every built-in model family shares (Qwen2/2.5, Qwen3, Llama 3.x), in Flax NNX.

Qwen2, Qwen3 and Llama 3 are one architecture with a few switches: biases on the q/k/v
projections (Qwen2), a per-head RMSNorm on q and k before RoPE (Qwen3), a ``head_dim``
independent of ``hidden_size / heads`` (Qwen3, and allowed for all), and the ``llama3``
RoPE frequency scaling (Llama 3.1/3.2). A family is a :class:`DecoderConfig` subclass
that sets the switches (class variables) and translates its Hugging Face config; the
attention, KV cache, scan over layers and sharding code below exist once.

What the rest of the framework uses
-----------------------------------

- :class:`DecoderConfig` — the architecture (HF field names); each family subclass
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
  (:mod:`grpo.models.paged_attention`: a pool of pages and a page table per row; the
  continuous-batching sampler's decode): each live row's key/value is written at token
  ``lengths`` of its pages and its query attends over its own ``lengths + 1`` tokens only.
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
functions of a frozen :class:`LayerContext` (what is fixed for the call: config, compute
dtype, mesh and rules, quantization, adapters and dropout keys, RoPE tables, the
attention form and its mask) and the layer's parameters: :func:`project` (a projection,
with QLoRA dequantization and the LoRA term), :func:`qkv` (norm, q/k/v, RoPE),
:func:`attend` (cache write and attention), :func:`out_and_mlp` (output projection and
:func:`mlp_block`); :func:`layer_function` composes them under the remat policy and
:func:`run_layers` scans it.

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
(:func:`rope_inv_freq`), so the ``llama3`` scaling's band edges fall where transformers'
do.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, Literal, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from grpo.core.errors import UserError
from grpo.models.attention import sharded
from grpo.models.hf import LLAMA3_ROPE_KEYS, config_from_hf, hf_fields
from grpo.models.paged_attention import PagedKVCache, PagedSpec, paged_decode
from grpo.models.quant import dequantize
from grpo.sharding import ACTIVATION_RULES, fit_sharding

Remat = Literal["none", "full", "dots"]
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots")
DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# --------------------------------------------------------------------------- config


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
        L, D, F, V = self.num_hidden_layers, self.hidden_size, self.intermediate_size, self.vocab_size
        H, K, E = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        every: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
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
        specs = {"embed": ((V, D), ("vocab", "embed"))}
        specs.update({f"layers.{n}": every[f"layers.{n}"] for n in self.layer_params()})
        specs["final_norm"] = ((D,), ("norm",))
        if not self.tie_word_embeddings:
            specs["lm_head"] = ((D, V), ("embed", "vocab"))
        return specs

    def num_params(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.param_specs().values())

    def kv_bytes_per_token(self, dtype: Any = jnp.bfloat16) -> int:
        """KV-cache bytes one token occupies over all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * jnp.dtype(dtype).itemsize

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim / 2], float32 (see :func:`rope_inv_freq`)."""
        return rope_inv_freq(self.head_dim, self.rope_theta, dict(self.rope_scaling) or None)


def rope_inv_freq(head_dim: int, theta: float, llama3: Mapping[str, Any] | None = None) -> np.ndarray:
    """RoPE inverse frequencies [head_dim / 2] in float32, as transformers computes them.

    ``theta ** (-2i / head_dim)``; with ``llama3`` scaling (Llama 3.1/3.2), wavelengths
    longer than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, shorter than ``... / high_freq_factor`` kept, and the band between
    interpolated smoothly — transformers' ``_compute_llama3_parameters``, step by step in
    float32 so the band edges fall on the same frequencies.
    """
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim)
    inv_freq = (f32(1.0) / (f32(theta) ** exponent)).astype(f32)
    if not llama3:
        return inv_freq
    factor = f32(llama3["factor"])
    low = f32(llama3["low_freq_factor"])
    high = f32(llama3["high_freq_factor"])
    old_context = f32(llama3["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = (f32(2 * math.pi) / inv_freq).astype(f32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(f32)
    smooth = ((old_context / wavelen - low) / (high - low)).astype(f32)
    smoothed = ((f32(1) - smooth) * scaled / factor + smooth * scaled).astype(f32)
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


# --------------------------------------------------------------------------- cache


class KVCache(NamedTuple):
    """Keys and values of every layer, ``[layers, batch, max_length, kv_heads, head_dim]``.

    K/V are stored at ``num_key_value_heads`` (no GQA repetition). A plain pytree:
    jit, donate and ``jax.tree.map`` it freely.
    """

    k: jax.Array
    v: jax.Array

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_length(self) -> int:
        return self.k.shape[2]

    def repeat(self, n: int) -> "KVCache":
        """Each row repeated ``n`` times in place (row b -> rows b*n .. b*n+n-1)."""
        return KVCache(k=jnp.repeat(self.k, n, axis=1), v=jnp.repeat(self.v, n, axis=1))


CACHE_AXES: tuple[str, ...] = ("layers", "batch", "cache_length", "kv_heads", "head_dim")


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


# --------------------------------------------------------------------------- math


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype: Any) -> jax.Array:
    """RMSNorm over the last axis; statistics in float32, result in ``dtype``."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return y.astype(dtype) * weight.astype(dtype)


def rope_tables(
    positions: jax.Array, head_dim: int, theta: float, inv_freq: np.ndarray | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, head_dim] (float32) for integer positions [B, T].

    transformers' convention: frequencies ``theta ** (-2i / head_dim)`` (or the given
    ``inv_freq`` [head_dim / 2], e.g. llama3-scaled) for the first half, repeated for the
    second half (paired with :func:`apply_rope`'s rotate-half).
    """
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    else:
        inv_freq = jnp.asarray(inv_freq, jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # B T E/2
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # B T E
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, N, E] by cos/sin [B, T, E] (rotate-half convention), in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def attention_mask(kv_mask: jax.Array, q_slots: jax.Array) -> jax.Array:
    """[B, 1, T, S] bool: key slot s is visible to the query in slot q_slots[t] iff
    ``s <= q_slots[t]`` and ``kv_mask[b, s]``."""
    S = kv_mask.shape[-1]
    causal = jnp.arange(S, dtype=jnp.int32)[None, :] <= q_slots[:, None]  # T S
    return causal[None, None, :, :] & kv_mask.astype(bool)[:, None, None, :]


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


# --------------------------------------------------------------------------- layers
# One decoder layer, as pure functions of a LayerContext (what is fixed for one call of
# the model) and the layer's parameters p (name -> one layer's slice of the stacked
# arrays). Decoder.__call__ builds the context and scans layer_function over the layers.

DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def constrain(
    x: jax.Array, names: Sequence[str], mesh: Mesh | None, rules: Sequence[tuple[str, Any]]
) -> jax.Array:
    """``x`` constrained to the logical axes ``names`` under the activation ``rules`` on
    ``mesh`` (unchanged without a mesh)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, fit_sharding(x.shape, names, mesh, dict(rules)))


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What every decoder layer reads besides its own parameters, fixed for one call of
    :class:`Decoder` (built by it; the layer functions are pure in it)."""

    config: DecoderConfig
    dtype: Any  # the compute dtype
    mesh: Mesh | None
    rules: tuple[tuple[str, Any], ...]  # activation rules (Decoder.activation_rules)
    quantization: str  # how the base projections are stored: none | nf4 | int8
    lora: Any  # the LoraSpec of the adapters in use; None: no adapters, or switched off
    dropout_keys: jax.Array | None  # [B, T, 2] each token's row's adapter-dropout key data; None: no dropout
    positions: jax.Array  # [B, T] int32 RoPE positions (a token's place in its sequence)
    cos: jax.Array  # [B, T, head_dim] float32 RoPE tables
    sin: jax.Array  # [B, T, head_dim]
    kernel: Any  # the blocked attention kernel of this call, or None (dense attention)
    dense_impl: Any  # jax.nn.dot_product_attention's implementation (dense attention)
    mask: jax.Array | None  # [B, 1, T, S] bool, dense attention only
    segment_ids: jax.Array | None  # [B, S] int32 (1 real token, 0 padding), kernel only
    write_index: jax.Array | None  # scalar int32: the cache slot of the first token
    # A decode step over a paged cache: (page_table [B, max_pages], lengths [B], live [B],
    # its PagedSpec); None: the dense cache (or none).
    paged: Any = None

    def constrain(self, x: jax.Array, names: Sequence[str]) -> jax.Array:
        return constrain(x, names, self.mesh, self.rules)


def project(
    ctx: LayerContext, eq: str, x: jax.Array, p: Mapping[str, jax.Array], name: str, layer: jax.Array
) -> jax.Array:
    """``x`` through projection ``name`` (``eq``: its einsum, x first): the (dequantized)
    base weight plus, when targeted, the adapter ``(alpha / r) * (dropout(x) @ A) @ B``,
    never merged."""
    w = p[name]
    if f"{name}_scale" in p:
        w = dequantize(w, p[f"{name}_scale"], ctx.quantization, ctx.dtype, axis=0)
    y = jnp.einsum(eq, x, w.astype(ctx.dtype))
    if f"{name}_lora_a" not in p:
        return y
    return y + _adapter(ctx, eq, x, p, name, layer)


def _adapter(
    ctx: LayerContext, eq: str, x: jax.Array, p: Mapping[str, jax.Array], name: str, layer: jax.Array
) -> jax.Array:
    """The adapter's term of projection ``name``: ``x`` [lead..., contracted...] through
    A [contracted..., r] then B [r, kept...], scaled by ``alpha / r``."""
    dt = ctx.dtype
    ins, out = eq.split("->")
    xs, ws = ins.split(",")
    contracted = "".join(ch for ch in ws if ch in xs)
    kept = "".join(ch for ch in ws if ch not in xs)
    lead = "".join(ch for ch in out if ch not in kept)
    if ctx.dropout_keys is not None:
        x = _adapter_dropout(ctx, x, name, layer)
    t = jnp.einsum(f"{xs},{contracted}r->{lead}r", x, p[f"{name}_lora_a"].astype(dt))
    d = jnp.einsum(f"{lead}r,r{kept}->{out}", t, p[f"{name}_lora_b"].astype(dt))
    return d * jnp.asarray(ctx.lora.scale, dt)


def _adapter_dropout(ctx: LayerContext, x: jax.Array, name: str, layer: jax.Array) -> jax.Array:
    """Inverted dropout on an adapter's input [B, T, ...]: each token's mask from its
    row's key folded with the layer, the projection (every adapter draws its own) and the
    token's position in its sequence. A token's mask is then the same wherever the token
    sits: in a padded row (any left padding) or in a packed bin, in any micro-batch."""
    keep = 1.0 - ctx.lora.dropout
    salt = ctx.config.layer_params().index(name)

    def token_mask(k, pos):
        k = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(k), layer), salt)
        return jax.random.bernoulli(jax.random.fold_in(k, pos), keep, x.shape[2:])

    masks = jax.vmap(jax.vmap(token_mask))(ctx.dropout_keys, ctx.positions)  # B T ...
    return jnp.where(masks, x / keep, jnp.zeros((), x.dtype)).astype(x.dtype)


def qkv(
    ctx: LayerContext, h: jax.Array, p: Mapping[str, jax.Array], layer: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention block's inputs: the residual stream h [B, T, D] normed and projected
    to q [B, T, H, E] and k, v [B, T, K, E] (biases, Qwen3's q/k norms, RoPE)."""
    c, dt = ctx.config, ctx.dtype
    x = rms_norm(h, p["attn_norm"], c.rms_norm_eps, dt)
    q = project(ctx, "btd,dhe->bthe", x, p, "q_proj", layer)
    k = project(ctx, "btd,dke->btke", x, p, "k_proj", layer)
    v = project(ctx, "btd,dke->btke", x, p, "v_proj", layer)
    if c.qkv_bias:
        q = q + p["q_bias"].astype(dt)
        k = k + p["k_bias"].astype(dt)
        v = v + p["v_bias"].astype(dt)
    if c.qk_norm:  # Qwen3: per head, over head_dim, before RoPE
        q = rms_norm(q, p["q_norm"], c.rms_norm_eps, dt)
        k = rms_norm(k, p["k_norm"], c.rms_norm_eps, dt)
    q = ctx.constrain(apply_rope(q, ctx.cos, ctx.sin), ("batch", "length", "heads", "head_dim"))
    k = ctx.constrain(apply_rope(k, ctx.cos, ctx.sin), ("batch", "length", "kv_heads", "head_dim"))
    v = ctx.constrain(v, ("batch", "length", "kv_heads", "head_dim"))
    return q, k, v


def attend(ctx: LayerContext, q: jax.Array, k_new: jax.Array, v_new: jax.Array, kv: Any) -> tuple[jax.Array, Any]:
    """Attention of q [B, T, H, E] over the new keys/values or, with a cache carry ``kv``
    = (k, v, layer), over the cache after writing them at ``write_index``. Returns the
    output [B, T, H, E] and the carry ((k, v) updated; None without a cache)."""
    dt = ctx.dtype
    if ctx.paged is not None:
        return _attend_paged(ctx, q, k_new, v_new, kv)
    if kv is None:
        k_all, v_all = k_new, v_new
    else:
        ck, cv, layer = kv
        start = (layer, jnp.int32(0), ctx.write_index, jnp.int32(0), jnp.int32(0))
        ck = jax.lax.dynamic_update_slice(ck, k_new.astype(ck.dtype)[None], start)
        cv = jax.lax.dynamic_update_slice(cv, v_new.astype(cv.dtype)[None], start)
        ck = ctx.constrain(ck, CACHE_AXES)
        cv = ctx.constrain(cv, CACHE_AXES)
        k_all = jax.lax.dynamic_index_in_dim(ck, layer, axis=0, keepdims=False).astype(dt)
        v_all = jax.lax.dynamic_index_in_dim(cv, layer, axis=0, keepdims=False).astype(dt)
        kv = (ck, cv)
    scale = 1.0 / math.sqrt(ctx.config.head_dim)
    if ctx.kernel is not None:
        out = sharded(
            ctx.kernel, q, k_all, v_all, ctx.segment_ids, scale=scale, mesh=ctx.mesh, rules=dict(ctx.rules),
        )
        return out, kv
    out = jax.nn.dot_product_attention(
        q, k_all, v_all, mask=ctx.mask, scale=scale, implementation=ctx.dense_impl
    )  # B T H E
    return out, kv


def _attend_paged(
    ctx: LayerContext, q: jax.Array, k_new: jax.Array, v_new: jax.Array, kv: Any
) -> tuple[jax.Array, Any]:
    """One decode token per row (T = 1) over a paged pool: the new key/value written at
    token ``lengths`` of each live row's pages, then attention over the row's
    ``lengths + 1`` tokens (:func:`grpo.models.paged_attention.paged_decode`)."""
    page_table, lengths, live, spec = ctx.paged
    pk, pv, layer = kv
    out, pk, pv = paged_decode(
        q=q[:, 0], k_new=k_new[:, 0], v_new=v_new[:, 0], pool_k=pk, pool_v=pv, layer=layer, page_table=page_table,
        lengths=lengths, live=live, scale=1.0 / math.sqrt(ctx.config.head_dim), spec=spec, mesh=ctx.mesh,
    )
    return out[:, None].astype(ctx.dtype), (pk, pv)


def mlp_block(ctx: LayerContext, h: jax.Array, p: Mapping[str, jax.Array], layer: jax.Array) -> jax.Array:
    """The MLP block with its residual: h [B, T, D] + down(silu(gate(x)) * up(x)), x the
    normed h."""
    x = rms_norm(h, p["mlp_norm"], ctx.config.rms_norm_eps, ctx.dtype)
    g = project(ctx, "btd,df->btf", x, p, "gate_proj", layer)
    u = project(ctx, "btd,df->btf", x, p, "up_proj", layer)
    y = ctx.constrain(jax.nn.silu(g) * u, ("batch", "length", "mlp"))
    h = h + project(ctx, "btf,fd->btd", y, p, "down_proj", layer)
    return ctx.constrain(h, ("batch", "length", "embed"))


def out_and_mlp(
    ctx: LayerContext, h: jax.Array, a: jax.Array, p: Mapping[str, jax.Array], layer: jax.Array
) -> jax.Array:
    """What follows attention: the output projection of a [B, T, H, E] added to h, then
    the MLP block."""
    h = h + project(ctx, "bthe,hed->btd", a, p, "o_proj", layer)
    return mlp_block(ctx, h, p, layer)


def _layer(
    ctx: LayerContext, pre: Callable, post: Callable, h: jax.Array, p: Any, kv: Any, layer: jax.Array
) -> tuple[jax.Array, Any]:
    """One layer: ``pre`` (:func:`qkv`), :func:`attend`, ``post`` (:func:`out_and_mlp`),
    each possibly checkpointed."""
    q, k, v = pre(h, p, layer)
    a, kv = attend(ctx, q, k, v, kv)
    return post(h, a, p, layer), kv


def layer_function(ctx: LayerContext, remat: Remat) -> Callable:
    """One decoder layer ``(h, p, kv, layer) -> (h, kv)`` under the ``remat`` policy.

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


def _scan_step(layer_fn: Callable, h: jax.Array, xs: Any) -> tuple[jax.Array, None]:
    p, layer = xs
    h, _ = layer_fn(h, p, None, layer)
    return h, None


def _scan_cached_step(layer_fn: Callable, carry: Any, xs: Any) -> tuple[Any, None]:
    h, ck, cv = carry
    p, layer = xs
    h, (ck, cv) = layer_fn(h, p, (ck, cv, layer), layer)
    return (h, ck, cv), None


def run_layers(
    layer_fn: Callable, h: jax.Array, stacked: Mapping[str, jax.Array], num_layers: int, cache: KVCache | None
) -> tuple[jax.Array, KVCache | None]:
    """h [B, T, D] through every layer (``lax.scan`` over the stacked parameters [L, ...]);
    returns h and the updated cache (None without one)."""
    layers = jnp.arange(num_layers, dtype=jnp.int32)
    if cache is None:
        h, _ = jax.lax.scan(functools.partial(_scan_step, layer_fn), h, (stacked, layers))
        return h, None
    # The whole cache rides in the carry: each layer writes only its T new slots in place
    # instead of re-emitting a full per-layer slice as a scan output.
    step = functools.partial(_scan_cached_step, layer_fn)
    (h, ck, cv), _ = jax.lax.scan(step, (h, cache.k, cache.v), (stacked, layers))
    return h, cache._replace(k=ck, v=cv)  # a KVCache, or a PagedKVCache with its pool updated


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
        exactly the prompt length): an :data:`grpo.models.attention.AttentionFn` (a blocked
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
        out = jnp.einsum(
            "btd,dv->btv", hidden.astype(dt), self.head_weight().astype(dt), preferred_element_type=jnp.float32
        )
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
    ) -> tuple[jax.Array, KVCache | None]:
        if isinstance(cache, PagedKVCache):
            ctx = self._paged_context(tokens, positions, cache, PagedSpec() if paged is None else paged)
        else:
            ctx = self._layer_context(tokens, positions, kv_mask, cache, write_index, dropout_keys, segment_ids)
        h = jnp.take(self.embed[...], tokens, axis=0).astype(ctx.dtype)  # B T D
        h = ctx.constrain(h, ("batch", "length", "embed"))
        layer_fn = layer_function(ctx, self.remat)
        h, new_cache = run_layers(layer_fn, h, self._stacked(ctx), self.config.num_hidden_layers, cache)
        h = rms_norm(h, self.final_norm[...], self.config.rms_norm_eps, ctx.dtype)
        return ctx.constrain(h, ("batch", "length", "embed")), new_cache

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
