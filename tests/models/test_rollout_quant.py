"""Low-precision rollout weights (issue 53, item 1): per-output-channel int8/fp8 codes
and scales, and the quantized decoder against the float decoder on the same values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo.models import rollout_quant as rq
from grpo.models.loading import random_init
from grpo.models.presets import preset_config


@pytest.mark.parametrize("fmt", rq.FORMATS)
@pytest.mark.parametrize("shape,inputs", [((2, 12, 3, 5), 1), ((2, 3, 4, 6), 2), ((3, 16, 8), 1)])
def test_round_trip_and_scale_shapes(fmt, shape, inputs):
    """Codes keep the weight's shape in the format's dtype; one scale per layer and output
    channel; the round trip is within the format's bound of the channel's absmax (NumPy)."""
    w = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    w[0, ..., 0] = 0.0 if inputs == 1 else w[0, ..., 0]  # an all-zero channel: scale 1, codes 0
    codes, scale = rq.quantize_channels(jnp.asarray(w), fmt, inputs=inputs)
    assert codes.shape == shape and codes.dtype == rq.CODE_DTYPES[fmt]
    assert scale.shape == (shape[0],) + shape[1 + inputs:] and scale.dtype == jnp.float32
    axes = tuple(range(1, 1 + inputs))
    absmax = np.abs(w).max(axis=axes)
    np.testing.assert_allclose(np.asarray(scale), np.where(absmax > 0, absmax / rq.QMAX[fmt], 1.0), rtol=1e-6)
    back = np.asarray(rq.dequantize_channels(codes, scale, inputs=inputs))
    # NumPy's own dequantization of the codes agrees exactly
    np.testing.assert_array_equal(back, np.asarray(codes).astype(np.float32) * np.expand_dims(np.asarray(scale), axes))
    err = np.abs(back - w).max(axis=axes)
    assert np.all(err <= rq.max_error(fmt) * absmax + 1e-7)
    if fmt == "int8":
        assert np.abs(np.asarray(codes)).max() == 127  # the channel's absmax maps to qmax


def _tiny():
    return random_init("tiny", None, seed=3)


@pytest.mark.parametrize("fmt", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_quantized_forward_is_the_float_forward_of_the_dequantized_weights(fmt):
    """The quantized decoder ((x @ codes) * scale) equals the float decoder whose
    projections hold codes * scale, to float32 rounding (the math is the same up to where
    the scale multiplies); and differs from the unquantized model."""
    model = _tiny()
    graphdef, state = nnx.split(model)
    q = jax.jit(lambda s: rq.quantize_state(graphdef, s, fmt))(state)
    assert set(q.scales) == set(rq.INPUT_DIMS)
    for name in rq.INPUT_DIMS:  # the trainer's state is untouched
        assert state["layers"][name][...].dtype == jnp.float32
        assert q.state["layers"][name][...].dtype == rq.CODE_DTYPES[fmt]
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 300, size=(2, 7)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))

    def logits(m):
        h, _ = m(tokens, pos)
        return np.asarray(m.logits(h))

    full = logits(nnx.merge(graphdef, state))
    quantized = logits(rq.merge_rollout(graphdef, q))
    deq = nnx.merge(graphdef, nnx.clone(state))
    for name, w in rq.numpy_dequantized(q).items():
        getattr(deq.layers, name).set_value(jnp.asarray(w, jnp.float32))
    np.testing.assert_allclose(quantized, logits(deq), rtol=0, atol=1e-5)
    assert np.abs(quantized - full).max() > 1e-4


@pytest.mark.parametrize("tied", [pytest.param(True, marks=pytest.mark.slow), False])  # tied: ~12 s; the engine test reads a tied head
def test_quantized_head_is_the_float_forward_of_its_dequantized_table(tied):
    """``rollout.quantization.head: int8`` (issue 53, item 4): the head's codes and one
    scale per vocabulary row; the quantized decoder equals the float decoder whose head
    (and, tied, input embedding: the one table) holds codes * scale (NumPy's), and moves the
    logits further from the float model's than the projections alone do."""
    model = random_init(preset_config("tiny", {"tie_word_embeddings": tied}), None, seed=3)
    graphdef, state = nnx.split(model)
    q = jax.jit(lambda s: rq.quantize_state(graphdef, s, "int8", head="int8"))(state)
    table = "embed" if tied else "lm_head"
    codes, V = q.state[table][...], model.config.vocab_size
    assert codes.dtype == jnp.int8 and q.head_scale.shape == (V,) and q.head_scale.dtype == jnp.float32
    w = np.asarray(state[table][...], np.float64)
    absmax = np.abs(w).max(axis=1 if tied else 0)  # over D: one scale a vocabulary row
    np.testing.assert_allclose(np.asarray(q.head_scale), absmax / 127, rtol=1e-6)
    assert state[table][...].dtype == jnp.float32  # the trainer's copy is untouched
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 300, size=(2, 7)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))

    def logits(m):
        h, _ = m(tokens, pos)
        return np.asarray(m.logits(h))

    deq = nnx.merge(graphdef, nnx.clone(state))
    for name, x in rq.numpy_dequantized(q).items():
        getattr(deq.layers, name).set_value(jnp.asarray(x, jnp.float32))
    projections_only = logits(deq)
    head = rq.numpy_head(q)
    if tied:
        deq.embed.set_value(jnp.asarray(head["embed"], jnp.float32))
    else:
        deq.lm_head.set_value(jnp.asarray(head["head"], jnp.float32))
    quantized = logits(rq.merge_rollout(graphdef, q))
    np.testing.assert_allclose(quantized, logits(deq), rtol=0, atol=1e-5)
    assert np.abs(quantized - projections_only).max() > 1e-4
