"""Objectives (ppo_clip, gspo, cispo, sapo) and the mismatch correction against NumPy
references written here (f64, hand-derived values and gradients), through the shared
math and through both loss plugins (pallas interpreted); exact micro-batching for every
objective x aggregation (with beta > 0 and the mismatch correction); GSPO's token form against its sequence-level form; config errors."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _losses import _inputs

from grpo.core.config import load_config
from grpo.core.contracts import LossSettings, MismatchCorrection
from grpo.core.errors import ConfigError
from grpo.core.plugins import load_plugins
from grpo.plugins.losses import JaxLoss, PallasLoss
from grpo.plugins.losses._common import grpo_objective

OBJECTIVES = ("ppo_clip", "gspo", "cispo", "sapo")
AGGREGATIONS = ("token_mean", "sequence_mean", "constant")
# GSPO's ratio is a per-sequence mean of log-ratios: a narrower band makes some rows clip.
EPS = {"gspo": (0.03, 0.04)}
SAPO = (("tau_neg", 1.3), ("tau_pos", 0.8))


def _settings(objective, aggregation="token_mean", *, t=5, beta=0.05, mismatch=None, temperature=1.0):
    lo, hi = EPS.get(objective, (0.2, 0.28))
    return LossSettings(epsilon_low=lo, epsilon_high=hi, beta=beta, aggregation=aggregation, max_completion_length=t,
                        temperature=temperature, objective=objective,
                        objective_options=SAPO if objective == "sapo" else (), mismatch=mismatch)


# --------------------------------------------------------------------------- the NumPy reference


def reference(logp, old, ref, mask, adv, settings, sampler=None, normalizer=None):
    """(loss, d loss / d logp) in float64, from the definitions written out by hand."""
    logp, old, ref, mask, adv = (np.asarray(x, np.float64) for x in (logp, old, ref, mask, adv))
    valid = mask > 0
    b, t = logp.shape
    lo, hi = 1 - settings.epsilon_low, 1 + settings.epsilon_high
    lr = np.where(valid, logp - old, 0.0)
    r = np.exp(lr)
    a = adv[:, None] * np.ones((1, t)) if adv.ndim == 1 else adv  # per row, or per token (turn-level credit)
    n = valid.sum(1, keepdims=True)
    name = settings.objective
    if name == "ppo_clip":
        clipped = ((a > 0) & (r > hi)) | ((a < 0) & (r < lo))
        val = np.where(clipped, np.clip(r, lo, hi) * a, r * a)
        dval = np.where(clipped, 0.0, r * a)
    elif name == "gspo":
        s = np.exp(lr.sum(1, keepdims=True) / np.maximum(n, 1)) * np.ones((1, t))
        clipped = ((a > 0) & (s > hi)) | ((a < 0) & (s < lo))
        val = np.where(clipped, np.clip(s, lo, hi) * a, s * a)
        dval = np.where(clipped, 0.0, s * a)  # d s_i / d logp_t = s_i / n_i; the 1/n_i is the weight's
    elif name == "cispo":
        w = np.clip(r, lo, hi)
        val, dval = w * a * np.where(valid, logp, 0.0), w * a
    elif name == "sapo":
        opts = dict(settings.objective_options)
        tau = np.where(a > 0, opts["tau_pos"], opts["tau_neg"])
        g = 1 / (1 + np.exp(-tau * (r - 1)))
        val, dval = g * 4 / tau * a, 4 * g * (1 - g) * r * a
    weight = np.ones_like(logp)
    if settings.mismatch is not None:
        mc = settings.mismatch
        lw = np.where(valid, old - np.asarray(sampler, np.float64), 0.0)
        if mc.level == "sequence":
            lw = lw.sum(1, keepdims=True) * np.ones((1, t))
        w = np.exp(lw)
        weight = np.minimum(w, mc.cap) if mc.mode == "truncate" else (w <= mc.cap).astype(np.float64)
    per, dper = -val * weight, -dval * weight
    if settings.beta > 0:
        d = ref - logp
        per, dper = per + settings.beta * (np.exp(d) - d - 1), dper + settings.beta * (1 - np.exp(d))
    if settings.aggregation == "sequence_mean":
        tw = np.where(valid, 1.0 / np.maximum(n, 1), 0.0)
        norm = b
    else:
        tw = valid.astype(np.float64)
        norm = max(valid.sum(), 1) if settings.aggregation == "token_mean" else b * settings.max_completion_length
    norm = norm if normalizer is None else normalizer
    return float(np.sum(np.where(valid, tw * per, 0.0)) / norm), np.where(valid, tw * dper, 0.0) / norm


def _logp_inputs(b=3, t=5, seed=0):
    """Odd shapes, a short row and an empty one, off-policy ratios (|log r| ~ 0.3)."""
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.2, 3.0, (b, t))
    mask = (np.arange(t)[None] < np.array([t, 2, 0][:b] + [t] * max(0, b - 3))[:, None]).astype(np.float32)
    old = logp + 0.3 * rng.normal(size=(b, t))
    ref = logp + 0.3 * rng.normal(size=(b, t))
    sampler = old + 0.4 * rng.normal(size=(b, t))
    adv = rng.normal(size=b)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return dict(logp=f32(logp), old=f32(old), ref=f32(ref), mask=f32(mask), adv=f32(adv), sampler=f32(sampler))


@jax.jit(static_argnames=("settings",))
def _value_and_grad(logp, mask, adv, old, ref, sampler, normalizer, settings):
    def f(lp):
        return grpo_objective(logprobs=lp, mask=mask, advantages=adv, old_logprobs=old, ref_logprobs=ref,
                              settings=settings, normalizer=normalizer, sampler_logprobs=sampler)

    return jax.value_and_grad(f, has_aux=True)(logp)


def _run(x, settings, normalizer=None):
    sampler = x["sampler"] if settings.mismatch is not None else None
    norm = None if normalizer is None else jnp.float32(normalizer)
    (loss, metrics), grad = _value_and_grad(x["logp"], x["mask"], x["adv"], x["old"], x["ref"], sampler, norm, settings)
    return float(loss), metrics, np.asarray(grad)


@jax.jit(static_argnames=("settings",))
def _each_aggregation(x, settings):
    """``{aggregation: (full, first half, second half)}`` of ``(loss, d loss / d logp)``, the
    halves with the full batch's normalizer: one compile per objective."""
    def vg(rows, st):
        def f(lp):
            return grpo_objective(logprobs=lp, mask=x["mask"][rows], advantages=x["adv"][rows],
                                  old_logprobs=x["old"][rows], ref_logprobs=x["ref"][rows], settings=st,
                                  normalizer=st.normalizer(x["mask"]), sampler_logprobs=x["sampler"][rows])

        (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(x["logp"][rows])
        return loss, grad, metrics

    out = {}
    for agg in AGGREGATIONS:
        st = dataclasses.replace(settings, aggregation=agg)
        out[agg] = tuple(vg(rows, st) for rows in (slice(None), slice(0, 2), slice(2, None)))
    return out


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_objective_math_and_micro_batches(objective):
    """Every aggregation against the NumPy reference, with beta > 0, off-policy ratios and
    a sequence-level mismatch correction; row halves with the global normalizer sum to
    the full batch exactly (loss and gradient)."""
    x = _logp_inputs(4, 5, seed=1)
    settings = _settings(objective, mismatch=MismatchCorrection("sequence", "truncate", 1.5))
    for agg, ((loss, grad, metrics), *halves) in _each_aggregation(x, settings).items():
        want_loss, want_grad = reference(x["logp"], x["old"], x["ref"], x["mask"], x["adv"],
                                         dataclasses.replace(settings, aggregation=agg), sampler=x["sampler"])
        assert float(loss) == pytest.approx(want_loss, abs=1e-5, rel=1e-4), agg
        np.testing.assert_allclose(np.asarray(grad), want_grad, atol=1e-5, rtol=1e-4, err_msg=agg)
        assert np.abs(np.asarray(grad)).max() > 1e-3
        assert sum(float(h[0]) for h in halves) == pytest.approx(float(loss), abs=1e-6, rel=1e-5), agg
        np.testing.assert_allclose(np.concatenate([np.asarray(h[1]) for h in halves]), np.asarray(grad),
                                   atol=1e-7, rtol=1e-5, err_msg=agg)
    if objective in ("ppo_clip", "gspo", "cispo"):  # the inputs reach the clip, and not everywhere
        clipped = float(metrics["clip_frac/low"]) + float(metrics["clip_frac/high"])
        assert 0 < clipped < 1, clipped
    assert 0 < float(metrics["mismatch/truncated_frac"]) < 1


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("impl", ["jax", "pallas"])
def test_objective_through_loss_plugins_against_numpy(objective, impl):
    """Values and gradients w.r.t. the hidden states and the head, the chain rule through
    a NumPy log-softmax: d logp / d logits = onehot - softmax, divided by the temperature."""
    b, t, d, v, temp = 3, 5, 16, 200, 0.8
    x = _inputs(b, t, d, v, seed=7, lengths=[5, 2, 0], temperature=temp)
    settings = _settings(objective, "sequence_mean" if objective == "gspo" else "token_mean", t=t, temperature=temp)
    plugin = JaxLoss() if impl == "jax" else PallasLoss()
    opts = plugin.parse_options({} if impl == "jax" else {"block_t": 8, "block_v": 128})

    def f(h, w):
        return plugin.compute(hidden=h, head_weight=w, targets=x["targets"], mask=x["mask"], advantages=x["advantages"],
                              old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"], settings=settings,
                              options=opts)

    (loss, _), (dh, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x["hidden"], x["head_weight"])
    h, w = np.asarray(x["hidden"], np.float64), np.asarray(x["head_weight"], np.float64)
    logits = h @ w / temp
    logits -= logits.max(-1, keepdims=True)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    tgt = np.asarray(x["targets"])
    logp = np.log(np.take_along_axis(probs, tgt[..., None], -1)[..., 0])
    want_loss, g = reference(logp, x["old_logprobs"], x["ref_logprobs"], x["mask"], x["advantages"], settings)
    dlogits = g[..., None] * (np.eye(v)[tgt] - probs) / temp  # B T V
    np.testing.assert_allclose(float(loss), want_loss, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(dh), dlogits @ w.T, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(dw), np.einsum("btd,btv->dv", h, dlogits), atol=1e-4, rtol=1e-4)
    assert np.abs(np.asarray(dw)).max() > 1e-3


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_per_token_advantages(objective):
    """Turn-level credit hands the loss advantages [B, T]: every objective against the
    NumPy reference with a different advantage on each token (signs mixed within a row),
    with beta > 0 and a mismatch correction; and [B, T] advantages that are constant
    along each row give exactly the [B] loss and gradient."""
    x = _logp_inputs(4, 5, seed=3)
    settings = _settings(objective, mismatch=MismatchCorrection("sequence", "truncate", 1.5))
    per_token = jnp.asarray(np.random.default_rng(5).normal(size=(4, 5)), jnp.float32)
    loss, _, grad = _run(dict(x, adv=per_token), settings)
    want_loss, want_grad = reference(x["logp"], x["old"], x["ref"], x["mask"], per_token, settings, sampler=x["sampler"])
    assert loss == pytest.approx(want_loss, abs=1e-5, rel=1e-4)
    np.testing.assert_allclose(grad, want_grad, atol=1e-5, rtol=1e-4)
    row_loss, _, row_grad = _run(x, settings)
    tiled_loss, _, tiled_grad = _run(dict(x, adv=jnp.broadcast_to(x["adv"][:, None], (4, 5))), settings)
    assert tiled_loss == row_loss
    np.testing.assert_array_equal(tiled_grad, row_grad)
    assert loss != pytest.approx(row_loss)


def test_gspo_token_form_equals_sequence_form_under_sequence_mean():
    """The token form's value and gradient equal GSPO's sequence objective
    -mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(logp - old)), written with the
    sequence ratio itself (autodiff through it)."""
    x = _logp_inputs(4, 6, seed=2)
    settings = _settings("gspo", "sequence_mean", t=6, beta=0.0)
    lo, hi = 1 - settings.epsilon_low, 1 + settings.epsilon_high

    def sequence_form(logp):
        m = x["mask"]
        n = m.sum(1)
        s = jnp.exp(jnp.sum(m * (logp - x["old"]), 1) / jnp.maximum(n, 1.0))
        a = x["adv"]
        # An empty row is no sequence: it counts in the mean's rows but contributes nothing.
        return -jnp.mean(jnp.where(n > 0, jnp.minimum(s * a, jnp.clip(s, lo, hi) * a), 0.0))

    want, want_grad = jax.value_and_grad(sequence_form)(x["logp"])
    loss, metrics, grad = _run(x, settings)
    assert loss == pytest.approx(float(want), abs=1e-6)
    np.testing.assert_allclose(grad, np.asarray(want_grad), atol=1e-6)
    assert 0 < float(metrics["gspo/clip_frac"]) < 1
    # The sequence ratio's extremes over the non-empty rows.
    m = np.asarray(x["mask"])
    s = np.exp((m * (np.asarray(x["logp"]) - np.asarray(x["old"]))).sum(1) / np.maximum(m.sum(1), 1))[m.sum(1) > 0]
    assert float(metrics["gspo/seq_ratio/min"]) == pytest.approx(s.min(), rel=1e-5)
    assert float(metrics["gspo/seq_ratio/max"]) == pytest.approx(s.max(), rel=1e-5)


# --------------------------------------------------------------------------- mismatch correction by hand


def _one_row(cap, level, mode, logp_minus_sampler):
    """One on-policy row, A = 1: the loss is -(sum of the weights) / tokens, and the
    gradient per token is -weight / tokens."""
    logp = jnp.asarray([[-1.0] * len(logp_minus_sampler)], jnp.float32)
    x = dict(logp=logp, mask=jnp.ones(logp.shape), adv=jnp.ones(1), old=None, ref=None,
             sampler=logp - jnp.asarray([logp_minus_sampler], jnp.float32))
    settings = LossSettings(mismatch=MismatchCorrection(level, mode, cap))
    (loss, metrics), grad = _value_and_grad(x["logp"], x["mask"], x["adv"], None, None, x["sampler"], None, settings)
    return float(loss), metrics, np.asarray(grad)[0]


def test_mismatch_token_truncate_by_hand():
    """A token the sampler found 1/3 as likely as the trainer has weight 3 -> capped at 2;
    one it found twice as likely 0.5; one it agrees on 1."""
    loss, metrics, grad = _one_row(2.0, "token", "truncate", [math.log(3.0), -math.log(2.0), 0.0])
    assert loss == pytest.approx(-(2.0 + 0.5 + 1.0) / 3, abs=1e-6)
    np.testing.assert_allclose(grad, [-2.0 / 3, -0.5 / 3, -1.0 / 3], atol=1e-6)
    assert float(metrics["mismatch/weight_mean"]) == pytest.approx(3.5 / 3, abs=1e-6)
    assert float(metrics["mismatch/truncated_frac"]) == pytest.approx(1 / 3, abs=1e-6)


def test_mismatch_token_mask_by_hand():
    loss, metrics, grad = _one_row(2.0, "token", "mask", [math.log(3.0), -math.log(2.0), 0.0])
    assert loss == pytest.approx(-2.0 / 3, abs=1e-6)  # the first token is dropped, the others weigh 1
    np.testing.assert_allclose(grad, [0.0, -1 / 3, -1 / 3], atol=1e-6)
    assert float(metrics["mismatch/masked_frac"]) == pytest.approx(1 / 3, abs=1e-6)


def test_mismatch_sequence_truncate_by_hand():
    """The row's weight is exp(sum of the log-ratios) = 3 * 0.5 * 1 = 1.5 for every token
    (under the cap), and a row of 200 tokens at log-ratio 1 (e^200, past f32) is exactly the cap."""
    loss, metrics, grad = _one_row(2.0, "sequence", "truncate", [math.log(3.0), -math.log(2.0), 0.0])
    assert loss == pytest.approx(-1.5, abs=1e-5)
    np.testing.assert_allclose(grad, [-0.5] * 3, atol=1e-6)
    assert float(metrics["mismatch/truncated_frac"]) == 0.0
    loss, metrics, grad = _one_row(2.0, "sequence", "truncate", [1.0] * 200)
    assert loss == pytest.approx(-2.0, abs=1e-5) and np.all(np.isfinite(grad))
    assert float(metrics["mismatch/truncated_frac"]) == 1.0


def test_mismatch_sequence_mask_drops_exactly_the_sequences_above_the_cap():
    b, t, cap = 6, 4, 1.5
    rng = np.random.default_rng(5)
    logp = jnp.asarray(-rng.uniform(0.5, 2.0, (b, t)), jnp.float32)
    mask = jnp.asarray((np.arange(t)[None] < np.array([4, 3, 4, 2, 4, 1])[:, None]), jnp.float32)
    # Per-row summed log-ratios on both sides of log(1.5) = 0.405, spread over the row's tokens.
    row_log_w = np.array([0.9, 0.1, -0.3, 0.5, 0.39, 2.0])
    per_token = row_log_w[:, None] / np.asarray(mask).sum(1, keepdims=True)
    sampler = logp - jnp.asarray(per_token, jnp.float32)
    adv = jnp.asarray(rng.normal(size=b) + 2.0, jnp.float32)
    settings = LossSettings(aggregation="sequence_mean", mismatch=MismatchCorrection("sequence", "mask", cap))
    (loss, metrics), grad = _value_and_grad(logp, mask, adv, None, None, sampler, None, settings)
    kept = row_log_w <= math.log(cap)
    assert kept.tolist() == [False, True, True, False, True, False]
    # On-policy, sequence_mean: each kept row contributes -A_i / B, each dropped one nothing.
    assert float(loss) == pytest.approx(-float(np.sum(np.asarray(adv)[kept])) / b, rel=1e-5)
    row_grad = np.abs(np.asarray(grad)).sum(1)
    assert np.all(row_grad[~kept] == 0.0) and np.all(row_grad[kept] > 0)
    tokens = np.asarray(mask).sum(1)
    assert float(metrics["mismatch/masked_frac"]) == pytest.approx(tokens[~kept].sum() / tokens.sum(), rel=1e-6)


def test_mismatch_needs_sampler_logprobs():
    from grpo.plugins.losses._common import check_inputs

    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="sampler_logprobs"):
        check_inputs(hidden=jnp.zeros((1, 2, 4)), head_weight=jnp.zeros((4, 8)), targets=jnp.zeros((1, 2), jnp.int32),
                     mask=z, advantages=jnp.zeros(1), old_logprobs=None, ref_logprobs=None,
                     settings=LossSettings(mismatch=MismatchCorrection()), sampler_logprobs=None)


# --------------------------------------------------------------------------- registration and config


def test_objectives_registered_and_listed():
    loaded = load_plugins(entry_points=False)
    assert set(OBJECTIVES) <= set(loaded.registry("objective").names())
    assert loaded.get("objective", "sapo").parse_options({}).tau_neg == 1.05  # TRL's defaults


def _problems(overrides):
    with pytest.raises(ConfigError) as err:
        load_config("configs/quickstart.yaml", overrides)
    return "\n".join(err.value.problems)


def test_config_errors_name_the_field():
    msg = _problems(["loss.objective=gpso"])
    assert "loss.objective" in msg and "cispo, gspo, ppo_clip, sapo" in msg
    msg = _problems(["loss.objective=gspo", "loss.mismatch.level=token"])
    assert "loss.mismatch.level=token" in msg and "loss.objective=gspo" in msg
    msg = _problems(["loss.tis_cap=2.0"])
    assert "loss.mismatch: {level: token, mode: truncate, cap: 2.0}" in msg
    msg = _problems(["loss.objective=sapo", "loss.objective_options.tau=1"])
    assert "loss.objective_options.tau" in msg
    msg = _problems(["loss.mismatch.cap=0"])
    assert "loss.mismatch.cap" in msg


def test_config_carries_objective_and_mismatch_to_loss_settings():
    cfg = load_config("configs/quickstart.yaml", ["loss.objective=sapo", "loss.objective_options.tau_pos=2",
                                                  "loss.mismatch.level=sequence", "loss.mismatch.mode=mask"])
    s = cfg.loss_settings
    assert s.objective == "sapo" and dict(s.objective_options) == {"tau_pos": 2.0, "tau_neg": 1.05}
    assert s.mismatch == MismatchCorrection("sequence", "mask", 2.0)
    hash(s)  # a static jit argument
    assert cfg.loss.objective_options == {"tau_pos": 2.0, "tau_neg": 1.05}  # resolved with defaults
