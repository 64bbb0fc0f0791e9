"""How transformers' tensors map onto :class:`grpo.models.decoder.Decoder` parameters.

Qwen2, Qwen3 and Llama name their tensors alike (``model.layers.{i}.self_attn.q_proj``
...); a family's config says which exist (biases, q/k norms, an untied head).
transformers stores ``nn.Linear`` weights as [out, in] with heads flattened into the
out (or in) dimension and one tensor per layer; :class:`Decoder` stores [in, ..., out]
with explicit head axes, stacked over layers. Each :class:`TensorMap` describes one
parameter: the HF name (``{i}`` = layer), the HF shape, how HF dims split into ours
(``groups``) and the transpose from the split HF layout to ours (``perm``). The same
description serves loading a slice (:func:`read_hf_slice`), export (:func:`to_hf`) and
validation (:func:`expected_tensors`). NumPy only — no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from grpo.models.decoder import DecoderConfig

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

    def hf_name(self, layer: int | None = None) -> str:
        return self.hf.format(i=layer) if self.layered else self.hf

    @property
    def split_shape(self) -> tuple[int, ...]:
        return tuple(s for g in self.groups for s in g)

    @property
    def our_shape(self) -> tuple[int, ...]:
        split = self.split_shape
        return tuple(split[p] for p in self.perm)


def tensor_maps(cfg: "DecoderConfig") -> list[TensorMap]:
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
    maps = [TensorMap("embed", "model.embed_tokens.weight", (V, D), ((V,), (D,)), (0, 1), False)]
    maps += [layer_maps[name] for name in cfg.layer_params()]
    maps.append(TensorMap("final_norm", "model.norm.weight", (D,), ((D,),), (0,), False))
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap("lm_head", TIED_HEAD, (V, D), ((V,), (D,)), (1, 0), False))
    return maps


def expected_tensors(cfg: "DecoderConfig", maps: Sequence[TensorMap] | None = None) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a checkpoint of ``cfg`` holds -> its shape (``maps``: the
    family's tensor maps; default :func:`tensor_maps`)."""
    out: dict[str, tuple[int, ...]] = {}
    for tm in tensor_maps(cfg) if maps is None else maps:
        for i in range(cfg.num_hidden_layers) if tm.layered else (None,):
            out[tm.hf_name(i)] = tm.hf_shape
    return out


def check_tensors(
    cfg: "DecoderConfig", found: dict[str, tuple[tuple[int, ...], str]], maps: Sequence[TensorMap] | None = None
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


def hf_config_dict(cfg: Any, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint of ``cfg`` (loads in transformers 4.x and 5.x:
    5.x folds the top-level ``rope_theta`` into ``rope_parameters``)."""
    return {**cfg.hf_config_dict(), "torch_dtype": dtype}


def write_json(path: Any, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
