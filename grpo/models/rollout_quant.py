"""Low-precision rollout weights (``rollout.quantization.weights``: ``int8`` | ``fp8``).

The sampler's copy of the policy, quantized once per weight sync (the trainer's master
weights, the old/reference log-prob passes and the update never see it). Every decoder
projection ``W`` [L, in..., out...] (``q/k/v/o_proj``, ``gate/up/down_proj``) is stored as
codes of the same shape and one float32 scale per output channel and layer
(``scale`` [L, out...] = ``absmax over the input dims / qmax``):

- ``int8``: ``round(W / scale)`` clipped to [-127, 127] (qmax 127, symmetric);
- ``fp8``: ``W / scale`` cast to ``float8_e4m3fn`` (qmax 448, round to nearest even).

A projection computes ``x @ (codes * scale)``: the codes converted to the compute dtype
(exactly: int8 and e4m3 values are bf16 values) and scaled per output channel inside the
matmul's weight operand. On a TPU XLA fuses the convert and the scale into the matmul's
operand fetch, so the weights are read from HBM as one byte each (what decode, bound by
memory bandwidth, pays for); on CPU the same values are computed explicitly, so tests run
the same math. Norms and biases stay in their dtype. The output head stays too unless
``rollout.quantization.head: int8``: then the head [D, V] becomes int8 codes and one
float32 scale per vocabulary row (its output channel), quantized in the same program;
with tied embeddings the one table ``embed`` [V, D] is quantized, so the sampler's input
embedding reads the same codes times their row's scale (:func:`quantize_head`).

Unlike :mod:`grpo.models.quant` (a QLoRA base: block-wise scales along the *input*
dimension, dequantized per layer before the matmul: it saves memory, not time), scales
per output channel factor out of the matmul, which is what lets the matmul read codes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("int8", "fp8")
QMAX = {"int8": 127.0, "fp8": 448.0}
CODE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
#: Input (contracted) dimensions of each projection after the layer axis: the scale is one
#: per output channel, the rest of the dimensions (see DecoderConfig.param_specs).
INPUT_DIMS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}


def quantize_channels(w: jax.Array, fmt: str, *, inputs: int) -> tuple[jax.Array, jax.Array]:
    """``(codes, scale)`` of ``w`` [L, in..., out...] (``inputs`` input dims after the layer
    axis): codes like ``w`` in the format's dtype, scale [L, out...] float32."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown rollout weight format {fmt!r}; choose one of {FORMATS}")
    x = w.astype(jnp.float32)
    axes = tuple(range(1, 1 + inputs))
    absmax = jnp.max(jnp.abs(x), axis=axes)  # L out...
    scale = jnp.where(absmax > 0, absmax / QMAX[fmt], 1.0)
    y = x / jnp.expand_dims(scale, axes)
    if fmt == "int8":
        codes = jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8)
    else:
        codes = jnp.clip(y, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return codes, scale


def dequantize_channels(codes: jax.Array, scale: jax.Array, *, inputs: int, dtype: Any = jnp.float32) -> jax.Array:
    """The weight ``codes * scale`` in ``dtype`` (``scale`` [L, out...] broadcast over the
    ``inputs`` input dims)."""
    axes = tuple(range(1, 1 + inputs))
    return (codes.astype(jnp.float32) * jnp.expand_dims(scale, axes)).astype(dtype)


def max_error(fmt: str) -> float:
    """The largest ``|dequantize(quantize(w)) - w| / absmax(channel)`` of the format:
    int8 rounds to the nearest of 127 steps; e4m3 keeps 3 mantissa bits (a relative error
    of at most 2^-4 of the value, and the value is at most the absmax), with subnormals
    below 2^-6 of the 448 scale spaced 2^-9 apart (never more than the relative bound)."""
    return 0.5 / 127.0 if fmt == "int8" else 2.0**-4


def quantized_matmul(eq: str, x: jax.Array, codes: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``einsum(eq, x, codes * scale)`` in ``dtype``: the codes converted to ``dtype``
    (exact) and scaled per output channel (``scale``, one layer's [out...]: the trailing
    dims of the weight), then the unquantized matmul. On a TPU XLA fuses the convert and
    the scale into the matmul's weight operand, so HBM holds and the step reads one byte a
    weight; scaling the matmul's result instead costs a pass over every projection's
    output (+7% bytes a decode step: ``scripts/quant_decode_compare.py`` on the v6e
    compiler, where this form reads what Qwix's weight-only ``dot_general`` reads)."""
    return jnp.einsum(eq, x.astype(dtype), codes.astype(dtype) * scale.astype(dtype))


@dataclasses.dataclass(frozen=True)
class QuantizedWeights:
    """What a quantized rollout's programs read: ``state`` (the model's ``nnx`` state with
    each quantized projection holding its codes), ``scales`` {projection: [L, out...]
    float32} and the format ``fmt`` (static)."""

    state: Any
    scales: dict[str, Any]
    fmt: str
    head_scale: Any = None
    """[V] float32: the output head's scale per vocabulary row when the head is quantized
    (``rollout.quantization.head``), else None."""


jax.tree_util.register_dataclass(QuantizedWeights, data_fields=["state", "scales", "head_scale"], meta_fields=["fmt"])


def quantize_model(model: Any, fmt: str) -> dict[str, jax.Array]:
    """Quantize ``model``'s layer projections in place (each parameter's value becomes its
    codes); returns their scales by name. ``model``: a :class:`grpo.models.decoder.Decoder`
    merged inside a jitted function (the arrays are traced)."""
    if getattr(model, "base_quantization", "none") != "none":
        raise ValueError("a QLoRA base (model.lora.base_quantization) cannot be quantized again for the rollout")
    scales = {}
    for name in model.config.layer_params():
        if name not in INPUT_DIMS:
            continue
        var = getattr(model.layers, name)
        codes, scales[name] = quantize_channels(var[...], fmt, inputs=INPUT_DIMS[name])
        var.set_value(codes)
    return scales


def quantize_head(model: Any, fmt: str = "int8") -> jax.Array:
    """Quantize ``model``'s output head in place, one scale per vocabulary row (the head's
    output channel): ``lm_head`` [D, V] or, tied, ``embed`` [V, D] (then the input
    embedding reads these codes too). Returns the scale [V] float32."""
    if model.lm_head is None:
        codes, scale = quantize_channels(model.embed[...].T[None], fmt, inputs=1)
        model.embed.set_value(codes[0].T)
    else:
        codes, scale = quantize_channels(model.lm_head[...][None], fmt, inputs=1)
        model.lm_head.set_value(codes[0])
    return scale[0]


def quantize_state(graphdef: Any, state: Any, fmt: str, head: str = "none") -> QuantizedWeights:
    """The :class:`QuantizedWeights` of the sampler state ``state`` (jit it: once per
    sync); ``head``: ``int8`` quantizes the output head too (:func:`quantize_head`)."""
    from flax import nnx

    model = nnx.merge(graphdef, state)
    scales = quantize_model(model, fmt)
    head_scale = quantize_head(model, head) if head != "none" else None
    return QuantizedWeights(state=nnx.state(model), scales=scales, fmt=fmt, head_scale=head_scale)


def abstract_quantized(shapes: QuantizedWeights, prepared: Any) -> QuantizedWeights:
    """The abstract :class:`QuantizedWeights` of abstract ``prepared`` weights (``shapes``:
    ``jax.eval_shape`` of :func:`quantize_state`), each leaf in its sharding: the codes in
    their weight's, the scales in their weight's without its input dimensions (what
    ``grpo plan`` lowers the rollout's programs with)."""
    from jax.sharding import NamedSharding, PartitionSpec

    def place(leaf, like):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=getattr(like, "sharding", None))

    state = jax.tree.map(place, shapes.state, prepared)
    scales = {}
    for name, s in shapes.scales.items():
        w = prepared["layers"][name]
        w = getattr(w, "value", w)
        sharding = getattr(w, "sharding", None)
        if isinstance(sharding, NamedSharding):
            spec = tuple(sharding.spec) + (None,) * (len(w.shape) - len(sharding.spec))
            sharding = NamedSharding(sharding.mesh, PartitionSpec(spec[0], *spec[1 + INPUT_DIMS[name]:]))
        scales[name] = jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
    head_scale = None
    if shapes.head_scale is not None:  # [V]: the head's vocabulary dimension's sharding
        tied = "lm_head" not in prepared  # an nnx State holds no None attribute
        w = prepared["embed"] if tied else prepared["lm_head"]
        w = getattr(w, "value", w)
        sharding = getattr(w, "sharding", None)
        if isinstance(sharding, NamedSharding):
            spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
            sharding = NamedSharding(sharding.mesh, PartitionSpec(spec[0] if tied else spec[1]))
        head_scale = jax.ShapeDtypeStruct(shapes.head_scale.shape, shapes.head_scale.dtype, sharding=sharding)
    return QuantizedWeights(state=state, scales=scales, fmt=shapes.fmt, head_scale=head_scale)


def merge_rollout(graphdef: Any, params: Any) -> Any:
    """The model a rollout program runs: ``nnx.merge(graphdef, params)``, with the scales
    attached when ``params`` are :class:`QuantizedWeights` (its projections then compute
    :func:`quantized_matmul`)."""
    from flax import nnx

    if not isinstance(params, QuantizedWeights):
        return nnx.merge(graphdef, params)
    model = nnx.merge(graphdef, params.state)
    model.rollout_scales = nnx.data(dict(params.scales))
    if params.head_scale is not None:
        model.rollout_head_scale = nnx.data(params.head_scale)
    return model


def numpy_dequantized(params: QuantizedWeights) -> dict[str, np.ndarray]:
    """Each quantized projection's weight ``codes * scale`` as float64 NumPy arrays (an
    independent reference for tests)."""
    out = {}
    for name, scale in params.scales.items():
        codes = np.asarray(params.state["layers"][name][...]).astype(np.float64)
        s = np.asarray(scale, np.float64)
        out[name] = codes * np.expand_dims(s, tuple(range(1, 1 + INPUT_DIMS[name])))
    return out


def numpy_head(params: QuantizedWeights) -> dict[str, np.ndarray] | None:
    """A quantized head as float64 NumPy: ``{"embed": [V, D], "head": [D, V]}`` (tied: both
    from the one table's codes times their row's scale; untied: ``head`` alone), or None
    when the head is not quantized."""
    if params.head_scale is None:
        return None
    s = np.asarray(params.head_scale, np.float64)
    if "lm_head" not in params.state:  # tied (an nnx State holds no None attribute)
        embed = np.asarray(params.state["embed"][...]).astype(np.float64) * s[:, None]
        return {"embed": embed, "head": embed.T}
    return {"head": np.asarray(params.state["lm_head"][...]).astype(np.float64) * s[None, :]}


__all__ = ["CODE_DTYPES", "abstract_quantized", "FORMATS", "INPUT_DIMS", "QMAX", "QuantizedWeights", "dequantize_channels", "max_error",
           "merge_rollout", "numpy_dequantized", "numpy_head", "quantize_channels", "quantize_head", "quantize_model",
           "quantize_state",
           "quantized_matmul"]
