"""Hugging Face checkpoints and the shared decoder: the ``config.json`` translation and
the tensor layout.

Config: :func:`config_from_hf` reads a transformers config (object or ``to_dict()``)
into a :class:`grpo.models.decoder.DecoderConfig` subclass, refusing what the decoder
would get wrong; :func:`hf_fields` and :func:`hf_config_dict` write one back. A family
config reaches them through ``from_hf`` / ``to_hf_dict`` (its hooks:
``_family_problems``, and ``to_hf_dict`` overrides for its own fields).

Tensors: Qwen2, Qwen3 and Llama name their tensors alike
(``model.layers.{i}.self_attn.q_proj`` ...); a family's config says which exist (biases,
q/k norms, an untied head). transformers stores ``nn.Linear`` weights as [out, in] with
heads flattened into the out (or in) dimension and one tensor per layer;
:class:`~grpo.models.decoder.Decoder` stores [in, ..., out] with explicit head axes,
stacked over layers. Each :class:`TensorMap` describes one parameter: the HF name
(``{i}`` = layer), the HF shape, how HF dims split into ours (``groups``) and the
transpose from the split HF layout to ours (``perm``). The same description serves
loading a slice (:func:`read_hf_slice`), export (:func:`to_hf`) and validation
(:func:`expected_tensors`).

NumPy only — no JAX (the decoder imports this module, never the reverse).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from grpo.core.errors import UserError

# --------------------------------------------------------------------------- config.json

LLAMA3_ROPE_KEYS: tuple[str, ...] = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _getter(hf: Any):
    """``get(key, default)`` over a transformers config object or its ``to_dict()``."""
    if isinstance(hf, Mapping):
        return hf.get
    return lambda k, d=None: getattr(hf, k, d)


def rope_settings(get: Any) -> tuple[str, dict[str, Any], float]:
    """(rope type, its parameters, rope_theta) of an HF config, in the 4.x layout
    (top-level ``rope_theta`` + ``rope_scaling``) or 5.x's (``rope_parameters``)."""
    rope = get("rope_parameters") or get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        rope = {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    theta = rope.get("rope_theta")
    if theta is None:
        theta = get("rope_theta", None)
    params = {k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")}
    return str(rope_type), params, theta


def config_from_hf(cls: type, hf: Any) -> Any:
    """A ``cls`` (a :class:`~grpo.models.decoder.DecoderConfig` subclass) from a
    transformers config object of its family (or its ``to_dict()``).

    Raises :class:`UserError` for anything the decoder would get wrong: another
    ``model_type``, sliding-window attention switched on, a rope scaling the family does
    not implement, an activation other than SiLU, attention dropout, quantized weights,
    and the family's own refusals (``cls._family_problems``).
    """
    get = _getter(hf)
    _check_model_type(cls, get)
    problems = []
    act = get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        problems.append(f"hidden_act={act!r}: only 'silu' is implemented")
    layer_types = get("layer_types") or ()
    if get("use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        problems.append(
            f"sliding-window attention is switched on (use_sliding_window="
            f"{get('use_sliding_window')}, sliding_window={get('sliding_window')}, "
            f"max_window_layers={get('max_window_layers')}); only full attention is implemented"
        )
    scaling, theta = _rope_from_hf(cls, get, problems)
    if float(get("attention_dropout", 0.0) or 0.0) != 0.0:
        problems.append(f"attention_dropout={get('attention_dropout')} is not implemented (only 0)")
    if get("quantization_config"):
        problems.append("quantized checkpoints (quantization_config) are not supported")
    problems += cls._family_problems(get)
    if problems:
        raise UserError(f"Unsupported {cls.label_of()} config:", problems=problems)
    eos = get("eos_token_id")
    return cls(
        **cls._family_fields(get),
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=get("num_attention_heads"),
        num_key_value_heads=get("num_key_value_heads") or get("num_attention_heads"),
        head_dim=get("head_dim") or 0,
        rope_theta=float(theta),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        max_position_embeddings=int(get("max_position_embeddings", 32768)),
        initializer_range=float(get("initializer_range", 0.02)),
        bos_token_id=get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, (list, tuple)) else eos,
        pad_token_id=get("pad_token_id"),
        rope_scaling=scaling,
    )


def _check_model_type(cls: type, get: Any) -> None:
    """Refuses a ``model_type`` the family does not implement (before anything else: the
    other checks would only add noise)."""
    model_type = get("model_type")
    accepted = cls.model_types or (cls.model_type,)
    if model_type not in accepted:
        archs = get("architectures")
        raise UserError(
            f"Unexpected architecture: model_type={model_type!r}"
            + (f" (architectures {list(archs)})" if archs else "")
            + f"; the {cls.family} model plugin implements model_type "
            + " or ".join(repr(t) for t in accepted) + " only."
        )


def _rope_from_hf(cls: type, get: Any, problems: list[str]) -> tuple[tuple[tuple[str, Any], ...], float]:
    """(``rope_scaling`` pairs, ``rope_theta``) of an HF config; what the family does not
    implement is appended to ``problems``."""
    rope_type, rope_params, theta = rope_settings(get)
    scaling: tuple[tuple[str, Any], ...] = ()
    if rope_type not in cls.rope_types:
        shown = {"rope_type": rope_type, **rope_params}
        problems.append(
            f"rope scaling type {rope_type!r} ({shown}) is not implemented; {cls.family} implements "
            + " and ".join(repr(t) for t in cls.rope_types) + " RoPE"
        )
    elif rope_type == "llama3":
        missing = [k for k in LLAMA3_ROPE_KEYS if rope_params.get(k) is None]
        if missing:
            problems.append(f"rope_scaling of type 'llama3' lacks {', '.join(missing)} ({rope_params})")
        else:
            scaling = tuple(sorted(
                (k, int(rope_params[k]) if k == "original_max_position_embeddings" else float(rope_params[k]))
                for k in LLAMA3_ROPE_KEYS
            ))
    if theta is None:
        theta = 10000.0
    return scaling, theta


def hf_fields(cfg: Any) -> dict[str, Any]:
    """The shared decoder's keyword arguments for a transformers config class (no
    ``model_type``): the base of every family's ``to_hf_dict``."""
    out: dict[str, Any] = dict(
        architectures=[cfg.hf_architecture],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.rms_norm_eps,
        # transformers 5 folds rope_theta (and rope_scaling) into rope_parameters;
        # 4.x reads them directly. Both read this, the published checkpoints' layout.
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_dropout=0.0,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )
    if cfg.rope_scaling:
        out["rope_scaling"] = {"rope_type": "llama3", **dict(cfg.rope_scaling)}
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        out["head_dim"] = cfg.head_dim
    return out


def hf_config_dict(cfg: Any, dtype: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` (``model_type`` first, then the family's
    ``to_hf_dict()``, then ``torch_dtype`` when given). Loads in transformers 4.x and 5.x
    (5.x folds the top-level ``rope_theta`` into ``rope_parameters``)."""
    out = {"model_type": cfg.model_type, **cfg.to_hf_dict()}
    if dtype is not None:
        out["torch_dtype"] = dtype
    return out


# --------------------------------------------------------------------------- tensors

TIED_HEAD = "lm_head.weight"
# Tensors some exporters add that carry nothing a forward pass reads.
IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class TensorMap:
    param: str  # dotted path in the module ("layers.q_proj")
    hf: str  # HF tensor name; "{i}" is the layer index when `layered`
    hf_shape: tuple[int, ...]  # per layer
    groups: tuple[tuple[int, ...], ...]  # HF dim j splits into groups[j]
    perm: tuple[int, ...]  # split-HF dims -> ours: ours = split.transpose(perm)
    layered: bool
    # > 0: one HF tensor per (layer, expert), "{j}" the expert in `hf`; ours stacks them
    # as [layers, experts, ...] (mixture-of-experts weights, e.g. Qwen3-MoE).
    experts: int = 0

    def hf_name(self, layer: int | None = None, expert: int | None = None) -> str:
        if not self.layered:
            return self.hf
        return self.hf.format(i=layer, j=expert) if self.experts else self.hf.format(i=layer)

    def entries(self, num_layers: int) -> list[tuple[int | None, int | None]]:
        """The (layer, expert) of every HF tensor this map covers (None where unused)."""
        if not self.layered:
            return [(None, None)]
        return [(i, j) for i in range(num_layers) for j in (range(self.experts) if self.experts else (None,))]

    @property
    def split_shape(self) -> tuple[int, ...]:
        return tuple(s for g in self.groups for s in g)

    @property
    def our_shape(self) -> tuple[int, ...]:
        split = self.split_shape
        return tuple(split[p] for p in self.perm)


def tensor_maps(cfg: Any) -> list[TensorMap]:
    """The HF tensor of every parameter of a :class:`Decoder` of ``cfg`` (load and export)."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, K, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    lay = "model.layers.{i}."
    layer_maps = {
        "attn_norm": TensorMap("layers.attn_norm", lay + "input_layernorm.weight", (D,), ((D,),), (0,), True),
        "q_proj": TensorMap("layers.q_proj", lay + "self_attn.q_proj.weight", (H * E, D), ((H, E), (D,)), (2, 0, 1), True),
        "q_bias": TensorMap("layers.q_bias", lay + "self_attn.q_proj.bias", (H * E,), ((H, E),), (0, 1), True),
        "k_proj": TensorMap("layers.k_proj", lay + "self_attn.k_proj.weight", (K * E, D), ((K, E), (D,)), (2, 0, 1), True),
        "k_bias": TensorMap("layers.k_bias", lay + "self_attn.k_proj.bias", (K * E,), ((K, E),), (0, 1), True),
        "v_proj": TensorMap("layers.v_proj", lay + "self_attn.v_proj.weight", (K * E, D), ((K, E), (D,)), (2, 0, 1), True),
        "v_bias": TensorMap("layers.v_bias", lay + "self_attn.v_proj.bias", (K * E,), ((K, E),), (0, 1), True),
        "q_norm": TensorMap("layers.q_norm", lay + "self_attn.q_norm.weight", (E,), ((E,),), (0,), True),
        "k_norm": TensorMap("layers.k_norm", lay + "self_attn.k_norm.weight", (E,), ((E,),), (0,), True),
        "o_proj": TensorMap("layers.o_proj", lay + "self_attn.o_proj.weight", (D, H * E), ((D,), (H, E)), (1, 2, 0), True),
        "mlp_norm": TensorMap("layers.mlp_norm", lay + "post_attention_layernorm.weight", (D,), ((D,),), (0,), True),
        "gate_proj": TensorMap("layers.gate_proj", lay + "mlp.gate_proj.weight", (F, D), ((F,), (D,)), (1, 0), True),
        "up_proj": TensorMap("layers.up_proj", lay + "mlp.up_proj.weight", (F, D), ((F,), (D,)), (1, 0), True),
        "down_proj": TensorMap("layers.down_proj", lay + "mlp.down_proj.weight", (D, F), ((D,), (F,)), (1, 0), True),
    }
    X, M = getattr(cfg, "num_experts", 0), getattr(cfg, "moe_intermediate_size", 0)
    if X:  # Qwen3-MoE / Qwen2-MoE: the router ("gate") and one tensor per expert
        ex = lay + "mlp.experts.{j}."
        layer_maps.update({
            "router": TensorMap("layers.router", lay + "mlp.gate.weight", (X, D), ((X,), (D,)), (1, 0), True),
            "expert_gate": TensorMap("layers.expert_gate", ex + "gate_proj.weight", (M, D), ((M,), (D,)), (1, 0), True, X),
            "expert_up": TensorMap("layers.expert_up", ex + "up_proj.weight", (M, D), ((M,), (D,)), (1, 0), True, X),
            "expert_down": TensorMap("layers.expert_down", ex + "down_proj.weight", (D, M), ((D,), (M,)), (1, 0), True, X),
        })
    maps = [TensorMap("embed", "model.embed_tokens.weight", (V, D), ((V,), (D,)), (0, 1), False)]
    maps += [layer_maps[name] for name in cfg.layer_params()]
    maps.append(TensorMap("final_norm", "model.norm.weight", (D,), ((D,),), (0,), False))
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap("lm_head", TIED_HEAD, (V, D), ((V,), (D,)), (1, 0), False))
    return maps


def expected_tensors(cfg: Any, maps: Sequence[TensorMap] | None = None) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a checkpoint of ``cfg`` holds -> its shape (``maps``: the
    family's tensor maps; default :func:`tensor_maps`)."""
    out: dict[str, tuple[int, ...]] = {}
    for tm in tensor_maps(cfg) if maps is None else maps:
        for i, j in tm.entries(cfg.num_hidden_layers):
            out[tm.hf_name(i, j)] = tm.hf_shape
    return out


def check_tensors(
    cfg: Any, found: dict[str, tuple[tuple[int, ...], str]], maps: Sequence[TensorMap] | None = None
) -> list[str]:
    """Problems of a checkpoint's tensors (name -> (shape, safetensors dtype)) against
    ``cfg``, one per tensor, each naming it."""
    expected = expected_tensors(cfg, maps)
    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
            continue
        got_shape, dtype = found[name]
        if tuple(got_shape) != shape:
            problems.append(f"tensor {name} has shape {list(got_shape)}, expected {list(shape)} from config.json")
        if dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {name} has dtype {dtype}; expected a float dtype ({', '.join(FLOAT_DTYPES)})")
    for name in sorted(set(found) - set(expected)):
        if name == TIED_HEAD and cfg.tie_word_embeddings:
            continue  # tied: transformers ignores a stored head too
        if name.endswith(IGNORABLE_SUFFIXES):
            continue
        problems.append(
            f"unexpected tensor {name} {list(found[name][0])} (not part of a {cfg.label} with "
            f"{cfg.num_hidden_layers} layers and tie_word_embeddings={cfg.tie_word_embeddings})"
        )
    return problems


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


def _norm_slice(s: slice, dim: int) -> tuple[int, int]:
    start, stop, step = s.indices(dim)
    if step != 1:
        raise ValueError(f"strided shard index {s}")
    return start, stop


def read_hf_slice(
    tm: TensorMap, get: Callable[[tuple[slice, ...]], np.ndarray], index: Sequence[slice]
) -> np.ndarray:
    """The part ``index`` (over *our* per-layer dims) of one HF tensor, in our layout.

    ``get`` reads a slice of the HF tensor in its stored layout (e.g. a safetensors
    ``get_slice``), so only the requested part is ever read. A split HF dim is read as
    the contiguous range of its leading sub-dim; later sub-dims are cut after reshaping.
    """
    split = tm.split_shape
    ours = tm.our_shape
    if len(index) != len(ours):
        raise ValueError(f"index {index} does not match {tm.param} {ours}")
    # our dim d is split-HF dim perm[d]
    split_idx: list[tuple[int, int]] = [(0, 0)] * len(split)
    for d, s in enumerate(index):
        split_idx[tm.perm[d]] = _norm_slice(s, ours[d])
    hf_slices = []
    after: list[slice] = []
    k = 0
    for group in tm.groups:
        lead_start, lead_stop = split_idx[k]
        inner = math.prod(group[1:])
        hf_slices.append(slice(lead_start * inner, lead_stop * inner))
        after.append(slice(None))
        for j in range(1, len(group)):
            after.append(slice(*split_idx[k + j]))
        k += len(group)
    raw = np.asarray(get(tuple(hf_slices)))
    shape = []
    k = 0
    for group in tm.groups:
        shape.append(split_idx[k][1] - split_idx[k][0])
        shape.extend(group[1:])
        k += len(group)
    part = raw.reshape(shape)[tuple(after)]
    return part.transpose(tm.perm)


def to_hf(tm: TensorMap, x: np.ndarray) -> np.ndarray:
    """One layer's parameter in our layout -> the HF tensor."""
    inverse = np.argsort(tm.perm)
    return np.ascontiguousarray(np.asarray(x).transpose(inverse).reshape(tm.hf_shape))


def write_json(path: Any, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
