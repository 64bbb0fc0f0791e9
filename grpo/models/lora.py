"""LoRA and QLoRA on the shared decoder: adapters, a frozen (optionally quantized) base,
the trainable/frozen split of the parameters, and the PEFT export.

Why not qwix
------------
qwix's ``LoraProvider`` adds adapters by intercepting the matmuls a module runs on one
of its own parameters (``nnx.Linear``/``nnx.Einsum``-style modules). The decoder keeps
every layer's weights stacked on a leading ``layers`` axis and runs them in one
``lax.scan``, so the matmuls see per-layer *slices* of the stacked parameters and qwix
recognises none of them: ``qwix.apply_lora_to_model(Decoder, LoraProvider(".*", ...))``
(qwix 0.1.8) returns the model with zero adapter parameters. Unrolling the layers into
modules to suit it would give up the scan (compile time linear in depth) and the
logical-axis sharding of the stacked weights, so the adapters live in the model instead.

Layout
------
For a targeted projection ``layers.<name>`` of shape ``[L, *in, *out]`` (``o_proj`` has
two input dims, heads and head_dim; the others one) the adapter is

- ``lora.<name>_a`` ``[L, *in, r]`` (logical axes ``layers, *in, lora_rank``), initialised
  uniform in ``+-1/sqrt(prod(in))`` (PEFT's Kaiming-uniform with ``a = sqrt(5)``);
- ``lora.<name>_b`` ``[L, r, *out]`` (``layers, lora_rank, *out``), initialised to zero,

so the step-0 model is the base model exactly, and the projection computes
``x @ W + (alpha / r) * (dropout(x) @ A) @ B`` without ever forming ``W + A @ B``
(the sampler reads base + adapter the same way). Adapters are float32 parameters; their
``lora_rank`` axis is replicated, the others shard like the base weight's.

Dropout (``model.lora.dropout``) drops each adapter's input in the update only, with one
mask per row per training step, drawn from (seed, step): every PPO epoch of the step
uses the same masks as the log-probs its ratio divides by (``logp_old``), so at unchanged
parameters the ratio is exactly 1 and clipping sees only what the update moved. The
sampler and the reference never drop. The mismatch correction (``loss.mismatch``)
corrects for the sampler and the trainer disagreeing about the *same* policy, so its
``logp_old`` is the dropout-free log-prob of the pre-update policy: the weight comes from
``exp(logp_free - logp_sampler)`` (per token, or summed per sequence), sampler/trainer
numerics only. (The trainer
hands the loss ``logp_sampler + (logp_masked - logp_free)``, both pre-update, so the loss's
``exp(logp_old - sampler)`` with its masked ``logp_old`` is that weight; a dropout mask
against a dropout-free sampler would otherwise make the weight dropout noise.) The
dropout-free pass costs one forward per step (two with the correction); the sampler/trainer metrics
(``logprob_gap/sampler_trainer``, ``is_ratio/...``) are measured on it.

QLoRA (``base_quantization: nf4|int8``) replaces each projection's storage by the codes
of :mod:`grpo.models.quant` (``layers.<name>``, uint4/int8) and its per-block scales
(``layers.<name>_scale``); the decoder dequantizes one layer at a time in its scan.

The trainable/frozen split (:func:`split_params`) is by path: everything under ``lora``
trains, the rest is the frozen base. The optimizer (and checkpoints) see only the first.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo.core.errors import UserError

log = logging.getLogger(__name__)

from grpo.core.config import LORA_PROJECTIONS as PROJECTIONS  # noqa: E402

IN_DIMS: dict[str, int] = {"o_proj": 2}
"""How many leading (after ``layers``) dims of a projection are its input (default 1)."""
PEFT_MODULES: dict[str, str] = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
LORA_COLLECTION = "lora"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What the decoder's forward needs to know (static, hashable)."""

    targets: tuple[str, ...]
    rank: int
    alpha: float
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraAdapters(nnx.Module):
    """The stacked adapter matrices (attributes ``<name>_a``, ``<name>_b``)."""

    def __init__(self, values: Mapping[str, tuple[jax.Array, tuple[str, ...]]]):
        for attr, (value, names) in values.items():
            setattr(self, attr, nnx.Param(value, out_sharding=tuple(names), eager_sharding=False))


# --------------------------------------------------------------------------- specs


def _available(config: Any) -> tuple[str, ...]:
    params = set(config.layer_params())
    return tuple(n for n in PROJECTIONS if n in params)


def resolve_spec(config: Any, lora_cfg: Any) -> LoraSpec:
    """The :class:`LoraSpec` of a ``model.lora`` section for the architecture ``config``;
    :class:`UserError` naming the field for targets that match nothing or a rank too
    large for a targeted matrix."""
    targets = lora_cfg.projections(_available(config))
    if not targets:
        raise UserError(
            f"model.lora.targets={list(lora_cfg.targets)} matches none of this model's projections "
            f"({', '.join('layers.' + n for n in _available(config))})."
        )
    specs = config.param_specs()
    problems = []
    for name in targets:
        shape = specs[f"layers.{name}"][0]
        k = IN_DIMS.get(name, 1)
        fan_in, fan_out = math.prod(shape[1:1 + k]), math.prod(shape[1 + k:])
        if lora_cfg.rank > min(fan_in, fan_out):
            problems.append(
                f"model.lora.rank={lora_cfg.rank} is larger than layers.{name}'s {fan_in} x {fan_out} matrix "
                f"allows (at most {min(fan_in, fan_out)})"
            )
    if problems:
        raise UserError("Invalid model.lora for this model:", problems=problems)
    return LoraSpec(targets=targets, rank=int(lora_cfg.rank), alpha=float(lora_cfg.alpha), dropout=float(lora_cfg.dropout))


def adapter_specs(config: Any, spec: LoraSpec) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """``lora.<name>_a|b -> (shape, logical names)`` of every adapter matrix."""
    specs = config.param_specs()
    out = {}
    r = spec.rank
    for name in spec.targets:
        shape, names = specs[f"layers.{name}"]
        k = IN_DIMS.get(name, 1)
        out[f"{LORA_COLLECTION}.{name}_a"] = ((shape[0], *shape[1:1 + k], r), (names[0], *names[1:1 + k], "lora_rank"))
        out[f"{LORA_COLLECTION}.{name}_b"] = ((shape[0], r, *shape[1 + k:]), (names[0], "lora_rank", *names[1 + k:]))
    return out


def quantized_specs(config: Any, kind: str, block: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], Any]]:
    """``path -> (shape, logical names, dtype)`` of the codes and scales of a quantized base."""
    from grpo.models.quant import CODE_DTYPES, scale_shape

    specs = config.param_specs()
    out = {}
    for name in _available(config):
        shape, names = specs[f"layers.{name}"]
        out[f"layers.{name}"] = (shape, names, CODE_DTYPES[kind])
        out[f"layers.{name}_scale"] = (scale_shape(shape, block), names, jnp.float32)
    return out


# --------------------------------------------------------------------------- build


def _init_adapters(spec: LoraSpec, shapes: Mapping[str, tuple[tuple[int, ...], Any]], key: jax.Array) -> dict[str, jax.Array]:
    out = {}
    for i, name in enumerate(spec.targets):
        a_shape = shapes[f"{LORA_COLLECTION}.{name}_a"][0]
        fan_in = math.prod(a_shape[1:-1])
        bound = 1.0 / math.sqrt(fan_in)
        out[f"{name}_a"] = jax.random.uniform(jax.random.fold_in(key, i), a_shape, jnp.float32, -bound, bound)
        out[f"{name}_b"] = jnp.zeros(shapes[f"{LORA_COLLECTION}.{name}_b"][0], jnp.float32)
    return out


# Cached per (format, shapes, shardings): a second model of the same structure (tests,
# export after a run) reuses the executables instead of recompiling them.
@functools.lru_cache(maxsize=32)
def _jitted_quantize(kind: str, block: int, out_shardings: Any) -> Any:
    from grpo.models.quant import quantize

    return jax.jit(lambda w: quantize(w, kind, block), out_shardings=out_shardings)


@functools.lru_cache(maxsize=16)
def _jitted_init(spec: LoraSpec, shapes: tuple, out_shardings: tuple | None) -> Any:
    table = dict(shapes)
    return jax.jit(lambda key: _init_adapters(spec, table, key),
                   out_shardings=None if out_shardings is None else dict(out_shardings))


def apply_lora(model: Any, lora_cfg: Any, *, seed: int = 0, abstract: bool = False) -> Any:
    """Give ``model`` (a :class:`~grpo.models.decoder.Decoder`, sharded on its mesh) the
    adapters of ``lora_cfg`` (a :class:`~grpo.core.config.LoraConfig`) and, for QLoRA, a
    quantized base. Every new array is created in its sharding on the model's mesh;
    ``abstract`` makes them ``jax.ShapeDtypeStruct`` (``grpo plan``). Returns the model."""
    from grpo.sharding import PARAM_RULES, fit_sharding

    config = model.config
    spec = resolve_spec(config, lora_cfg)
    mesh = model.mesh

    def sharding(shape, names):
        return None if mesh is None else fit_sharding(shape, names, mesh, PARAM_RULES)

    kind = lora_cfg.base_quantization
    if kind != "none":
        qspecs = quantized_specs(config, kind, lora_cfg.quantization_block)
        for name in _available(config):
            shape, names, code_dtype = qspecs[f"layers.{name}"]
            s_shape = qspecs[f"layers.{name}_scale"][0]
            out_sh = (sharding(shape, names), sharding(s_shape, names))
            if abstract:
                codes = jax.ShapeDtypeStruct(shape, code_dtype, sharding=out_sh[0])
                scales = jax.ShapeDtypeStruct(s_shape, jnp.float32, sharding=out_sh[1])
            else:
                fn = _jitted_quantize(kind, lora_cfg.quantization_block, out_sh if mesh is not None else None)
                codes, scales = fn(getattr(model.layers, name)[...])
            setattr(model.layers, name, nnx.Param(codes, out_sharding=tuple(names), eager_sharding=False))
            setattr(model.layers, f"{name}_scale", nnx.Param(scales, out_sharding=tuple(names), eager_sharding=False))

    shapes = adapter_specs(config, spec)
    if abstract:
        values = {
            path.split(".", 1)[1]: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding(shape, names))
            for path, (shape, names) in shapes.items()
        }
    else:
        out_sh = None
        if mesh is not None:
            out_sh = {path.split(".", 1)[1]: sharding(shape, names) for path, (shape, names) in shapes.items()}
        frozen_shapes = tuple(sorted((k, (tuple(v[0]), tuple(v[1]))) for k, v in shapes.items()))
        frozen_sh = None if out_sh is None else tuple(sorted(out_sh.items()))
        values = _jitted_init(spec, frozen_shapes, frozen_sh)(jax.random.fold_in(jax.random.key(seed), 0x10A))
    names_of = {path.split(".", 1)[1]: names for path, (_, names) in shapes.items()}
    model.attach_adapters(
        LoraAdapters({attr: (values[attr], names_of[attr]) for attr in names_of}), spec, base_quantization=kind
    )
    return model


# --------------------------------------------------------------------------- params


def is_lora_state(state: Any) -> bool:
    return LORA_COLLECTION in state


def split_params(state: Any) -> tuple[Any, Any]:
    """``(trainable, frozen)`` of a model's ``nnx.State``: with adapters, the adapters and
    the base; without, the whole state and ``None``."""
    if not is_lora_state(state):
        return state, None
    return nnx.split_state(state, nnx.PathContains(LORA_COLLECTION), ...)


def merge_params(trainable: Any, frozen: Any) -> Any:
    """The full state again (no copies: the same arrays)."""
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def merge_into_state(graphdef: Any, trainable: Any, frozen: Any) -> Any:
    """The full state with every targeted projection replaced by ``W + (alpha / r) A @ B``
    in the parameter dtype (a new array per projection; everything else shared). Run it
    under ``jax.jit``; read with the adapters switched off it is the merged model (the
    ``model.lora.sampler: merged`` rollout)."""
    model = nnx.merge(graphdef, trainable, frozen)
    targets = model.lora_spec.targets
    flat = []
    for path, var in nnx.to_flat_state(merge_params(trainable, frozen)):
        name = _projection(path)
        if name in targets:
            var = var.replace(effective_weight(model, name, var[...].dtype))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def _projection(path: tuple) -> str | None:
    """The projection name of a flat-state path ``("layers", "<name>")``, else None."""
    if len(path) == 2 and path[0] == "layers" and path[1] in PROJECTIONS:
        return str(path[1])
    return None


def count_params(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


# --------------------------------------------------------------------------- merged weights


def _stacked(model: Any, name: str) -> jax.Array:
    return getattr(model.layers, name)[...]


def base_weight(model: Any, name: str, dtype: Any = jnp.float32) -> jax.Array:
    """``layers.<name>`` of the base in ``dtype`` (dequantized for QLoRA)."""
    from grpo.models.quant import dequantize

    w = _stacked(model, name)
    kind = getattr(model, "base_quantization", "none")
    if kind != "none" and name in PROJECTIONS:
        return dequantize(w, _stacked(model, f"{name}_scale"), kind, dtype, axis=1)
    return w.astype(dtype)


def lora_delta(model: Any, name: str) -> jax.Array | None:
    """``(alpha / r) * A @ B`` in the weight's layout [L, *in, *out] (float32), or None."""
    spec = getattr(model, "lora_spec", None)
    if spec is None or name not in spec.targets:
        return None
    a = getattr(model.lora, f"{name}_a")[...].astype(jnp.float32)
    b = getattr(model.lora, f"{name}_b")[...].astype(jnp.float32)
    L = a.shape[0]
    fan_in, fan_out = math.prod(a.shape[1:-1]), math.prod(b.shape[2:])
    d = jnp.einsum("lir,lro->lio", a.reshape(L, fan_in, -1), b.reshape(L, b.shape[1], fan_out))
    return (d * spec.scale).reshape(a.shape[:-1] + b.shape[2:])


def effective_weight(model: Any, name: str, dtype: Any) -> jax.Array:
    """``layers.<name>`` as the model computes with it: the base (dequantized) plus the
    adapters' ``(alpha / r) A @ B`` when targeted, summed in float32, cast to ``dtype``."""
    w = base_weight(model, name)
    d = lora_delta(model, name)
    return (w if d is None else w + d).astype(dtype)


def merged_params(model: Any) -> dict[str, jax.Array]:
    """``path -> array`` of the model's *effective* weights (base, dequantized, plus the
    adapters' product) in the parameter dtype: what ``grpo export`` writes."""
    from grpo.models.decoder import DTYPES

    dtype = DTYPES[model.param_dtype]
    _, state = nnx.split(model)
    out: dict[str, jax.Array] = {}
    for path, var in nnx.to_flat_state(state):
        key = ".".join(str(p) for p in path)
        if path[0] == LORA_COLLECTION or key.endswith("_scale"):
            continue
        name = _projection(path)
        out[key] = var[...] if name is None else effective_weight(model, name, dtype)
    return out


# --------------------------------------------------------------------------- PEFT export


def save_peft(model: Any, out_dir: str | os.PathLike, *, base_model: str | None = None) -> Path:
    """Write the adapters as a PEFT LoRA directory: ``adapter_config.json`` and
    ``adapter_model.safetensors`` (float32), which ``peft.PeftModel.from_pretrained``
    loads onto the transformers base model. PEFT's ``lora_A.weight`` is [r, in] and
    ``lora_B.weight`` [out, r] with transformers' flattening of heads (ours, in order)."""
    from safetensors.numpy import save_file

    from grpo.models._host import take_layer, to_host

    spec = getattr(model, "lora_spec", None)
    if spec is None:
        raise UserError("This run trained no adapters (model.lora is not set): export it without --adapter.")
    out = Path(out_dir)
    writer = jax.process_index() == 0
    tensors: dict[str, np.ndarray] = {}
    L = model.config.num_hidden_layers
    for name in spec.targets:
        a_all = getattr(model.lora, f"{name}_a")[...]
        b_all = getattr(model.lora, f"{name}_b")[...]
        for i in range(L):
            a = to_host(take_layer(a_all, np.int32(i))).astype(np.float32)
            b = to_host(take_layer(b_all, np.int32(i))).astype(np.float32)
            prefix = f"base_model.model.model.layers.{i}.{PEFT_MODULES[name]}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, spec.rank).T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.reshape(spec.rank, -1).T)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": spec.rank,
            "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout,
            "target_modules": list(spec.targets),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": None,
            "layers_to_transform": None,
            "revision": None,
        }
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


__all__ = [
    "LoraAdapters",
    "LoraSpec",
    "PROJECTIONS",
    "adapter_specs",
    "apply_lora",
    "base_weight",
    "count_params",
    "effective_weight",
    "lora_delta",
    "merge_params",
    "merged_params",
    "quantized_specs",
    "resolve_spec",
    "save_peft",
    "split_params",
]
