"""The packed layout (``segment_ids``) of both loss plugins: at the same sequences, packed
and padded give the same loss, metrics, log-probs and gradients (to the hidden states and
the head weight) within 1e-5 in f32, for every objective x every aggregation x both
mismatch levels, with beta > 0, a multi-turn loss mask, a truncated row, an empty bin, and
per-row and turn-level advantages. The packed inputs come from the NumPy packer in
tests/_packed.py, not from the engine's packing module.

The matrix (2 losses x 4 objectives x 3 aggregations x 2 levels, 4 loss evaluations each)
runs op by op, not jitted: a compile per configuration would cost ~0.4 s each; op by op
every primitive compiles once and a configuration costs ~0.1 s. The Pallas kernels (its
forward and backward) are jitted once per shape for the same reason."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _glossary import assert_glossary
from _packed import build, off_sequence, unpack

from grpo.core.contracts import LossSettings, MismatchCorrection, ObjectivePlugin, sequence_sum
from grpo.core.plugins import load_plugins

OBJECTIVES = ("ppo_clip", "gspo", "cispo", "sapo")
AGGREGATIONS = ("token_mean", "sequence_mean", "constant")
LEVELS = ("token", "sequence")
EPS = {"gspo": (0.03, 0.04)}  # GSPO's per-sequence ratio: a narrow band, so some sequences clip
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def case():
    return build(bin_length=16, bins=5, temperature=0.7)


@pytest.fixture(scope="module")
def jitted_kernels():
    """The Pallas kernels jitted (once per shape) while the loss around them runs op by op."""
    from grpo.kernels import head_logprobs

    names = ("_forward", "_grid_backward", "_loop_backward")
    saved = {n: getattr(head_logprobs, n) for n in names}
    head_logprobs._forward = jax.jit(saved["_forward"], static_argnums=(3, 4))
    for n in names[1:]:
        setattr(head_logprobs, n, jax.jit(saved[n], static_argnames=("inv_temp", "cfg")))
    yield
    for n, fn in saved.items():
        setattr(head_logprobs, n, fn)


def _settings(objective, aggregation, level, i):
    lo, hi = EPS.get(objective, (0.2, 0.28))
    return LossSettings(
        epsilon_low=lo, epsilon_high=hi, beta=0.05, temperature=0.7, aggregation=aggregation,
        max_completion_length=8, objective=objective,
        objective_options=(("tau_neg", 1.3), ("tau_pos", 0.8)) if objective == "sapo" else (),
        # Both modes and the entropy bonus ride along on alternate configurations.
        mismatch=MismatchCorrection(level=level, mode=("truncate", "mask")[i % 2], cap=1.3),
        entropy_coef=0.01 if objective in ("cispo", "sapo") else 0.0,
    )


def _value_and_grad(plugin, options, settings, inputs, normalizer):
    def loss(hidden, head):
        return plugin.compute(**dict(inputs, hidden=hidden, head_weight=head), settings=settings, options=options,
                              normalizer=normalizer)

    (value, metrics), (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        inputs["hidden"], inputs["head_weight"])
    return float(value), {k: np.asarray(v) for k, v in metrics.items()}, np.asarray(dh), np.asarray(dw)


def _check(case, padded, packed, what):
    loss, metrics, dh, dw = padded
    p_loss, p_metrics, p_dh, p_dw = packed
    np.testing.assert_allclose(p_loss, loss, **TOL, err_msg=f"{what}: loss")
    np.testing.assert_allclose(p_dw, dw, **TOL, err_msg=f"{what}: d head")
    np.testing.assert_allclose(unpack(case, p_dh), dh, **TOL, err_msg=f"{what}: d hidden")
    assert not np.any(off_sequence(case, p_dh)), f"{what}: gradient off the completion tokens"
    assert set(p_metrics) == set(metrics)
    for k, v in metrics.items():
        if k == "logprobs":
            trained = case.padded["mask"] > 0
            np.testing.assert_allclose(unpack(case, p_metrics[k])[trained], v[trained], **TOL, err_msg=f"{what}: {k}")
        else:
            np.testing.assert_allclose(p_metrics[k], v, **TOL, err_msg=f"{what}: {k}")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["jax", "pallas"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_packed_equals_padded(case, jitted_kernels, impl, objective):
    plugin = load_plugins(entry_points=False).get("loss", impl)
    assert plugin.supports_packing
    options = plugin.parse_options({"interpret": True} if impl == "pallas" else {})
    padded = {k: jnp.asarray(v) for k, v in case.padded.items()}
    packed = {k: jnp.asarray(v) for k, v in case.packed.items()}
    turns = {"row": (padded["advantages"], packed["advantages"]),
             "turn": (jnp.asarray(case.turn_advantages), jnp.asarray(case.packed_turn_advantages))}
    logged = []  # the loss's metrics, as the trainer's row takes them (issue 52: the metrics glossary)
    for i, (aggregation, level) in enumerate(itertools.product(AGGREGATIONS, LEVELS)):
        settings = _settings(objective, aggregation, level, i)
        normalizer = settings.normalizer(padded["mask"])  # the global batch's, as the engine passes it
        for credit, (adv, packed_adv) in turns.items():
            what = f"{impl} {objective} {aggregation} mismatch={level} advantages={credit}"
            want = _value_and_grad(plugin, options, settings, dict(padded, advantages=adv), normalizer)
            got = _value_and_grad(plugin, options, settings, dict(packed, advantages=packed_adv), normalizer)
            _check(case, want, got, what)
            logged.append({k: v for k, v in got[1].items() if k not in ("logprobs", "num_tokens")})
    # Both mismatch modes ride along; cispo and sapo carry the entropy bonus (_settings).
    own = {"ppo_clip": [], "gspo": ["Objective gspo"], "cispo": ["Objective cispo", "Entropy"],
           "sapo": ["Objective sapo", "Entropy"]}
    assert_glossary(logged, "Mismatch correction", "Mismatch correction, mask mode", *own[objective])


def test_the_case_exercises_what_it_claims(case):
    """Some GSPO sequences clip, some sequence-level mismatch weights pass the cap, a bin
    holds three sequences, one bin is empty, a truncated row and environment tokens train
    nothing: otherwise the matrix above would prove less than it says."""
    seg = case.packed["segment_ids"]
    assert seg.max() >= 3 and not seg[-1].any()
    m = case.padded["mask"]
    valid = m > 0
    log_w = np.where(valid, case.padded["old_logprobs"] - case.padded["sampler_logprobs"], 0).sum(1)
    assert np.any(log_w > np.log(1.3)) and np.any(log_w[valid.any(1)] < np.log(1.3))
    assert m[2].sum() == 0 and m[0, 2] == 0 and m[0, 4] == 1
    plugin = load_plugins(entry_points=False).get("loss", "jax")
    _, metrics, _, _ = _value_and_grad(plugin, plugin.parse_options({}), _settings("gspo", "sequence_mean", "token", 0),
                                       {k: jnp.asarray(v) for k, v in case.packed.items()}, None)
    assert 0 < metrics["gspo/clip_frac"] < 1


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_default_normalizer_counts_segments(case, aggregation):
    """Without the engine's normalizer a packed call normalises by its own sequences
    (segments), not its bins: the padded value."""
    settings = LossSettings(aggregation=aggregation, max_completion_length=8)
    want = settings.normalizer(jnp.asarray(case.padded["mask"]))
    got = settings.normalizer(jnp.asarray(case.packed["mask"]), jnp.asarray(case.packed["segment_ids"]))
    assert float(got) == float(want)


def test_sequence_sum_against_a_loop():
    """``sequence_sum``: each token's sum over its (bin, segment id); the row sum unpacked."""
    rng = np.random.default_rng(1)
    seg = np.array([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3], [0, 0, 0, 0, 0, 0]], np.int32)
    x = rng.normal(size=seg.shape).astype(np.float32)
    want = np.array([[x[b][seg[b] == seg[b, t]].sum() for t in range(6)] for b in range(3)])
    np.testing.assert_allclose(np.asarray(sequence_sum(jnp.asarray(x), segment_ids=jnp.asarray(seg))), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sequence_sum(jnp.asarray(x))), x.sum(1, keepdims=True), rtol=1e-6)


class _OldObjective(ObjectivePlugin):
    """An objective written before packing: no ``segment_ids`` parameter."""

    name = "old_style"

    def per_token(self, *, logprobs, log_ratio, valid, advantages, settings, options):  # noqa: ARG002
        return log_ratio * advantages, {}


class _KwargsObjective(_OldObjective):
    def per_token(self, **kwargs):
        return kwargs["segment_ids"], {}


def test_objectives_get_segment_ids_only_when_they_take_them():
    old, new = _OldObjective(), _KwargsObjective()
    gspo = load_plugins(entry_points=False).get("objective", "gspo")
    assert not old.supports_packing and new.supports_packing and gspo.supports_packing
    kw = dict(logprobs=1.0, log_ratio=2.0, valid=True, advantages=3.0, settings=None, options=None)
    assert old.call_per_token(**kw, segment_ids="seg") == (6.0, {})
    assert new.call_per_token(**kw, segment_ids="seg") == ("seg", {})
