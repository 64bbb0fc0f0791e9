"""GRPO loss math: hand-computed clipping/KL/aggregation, exact micro-batch accumulation,
plugin registration, options and layout checks. Fast: the jax reference and the shared
objective only (the pallas kernels are in test_pallas.py)."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from _losses import _inputs, _run_plugin

from grpo.core.cli import cli
from grpo.core.contracts import LossSettings, MeshLayout
from grpo.core.errors import UserError
from grpo.core.plugins import get_plugins
from grpo.plugins.losses import JaxLoss, PallasLoss, PallasLossOptions
from grpo.plugins.losses._common import grpo_objective


@jax.jit(static_argnames=("settings",))
def _objective_jit(logp, mask, adv, old, ref, normalizer, settings):
    def f(lp):
        return grpo_objective(logprobs=lp, mask=mask, advantages=adv, old_logprobs=old, ref_logprobs=ref,
                              settings=settings, normalizer=normalizer)

    return jax.value_and_grad(f, has_aux=True)(logp)


def _objective(logp, *, adv, old=None, ref=None, mask=None, settings=LossSettings(), normalizer=None):
    logp = jnp.asarray(logp, jnp.float32)
    mask = jnp.ones(logp.shape) if mask is None else jnp.asarray(mask, jnp.float32)
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)  # noqa: E731
    (loss, metrics), grad = _objective_jit(logp, mask, f32(adv), f32(old), f32(ref), f32(normalizer), settings)
    return float(loss), metrics, np.asarray(grad)


# --------------------------------------------------------------------------- clipping by hand

# (advantage, ratio, eps_low, eps_high) -> (loss, d loss / d logp, clipped low, clipped high)
CLIP_CASES = {
    "pos-adv-ratio-above-high-clipped": (1.0, 1.5, 0.2, 0.2, -1.2, 0.0, 0, 1),
    "pos-adv-ratio-below-low-keeps-grad": (1.0, 0.5, 0.2, 0.2, -0.5, -0.5, 0, 0),
    "neg-adv-ratio-below-low-clipped": (-1.0, 0.5, 0.2, 0.2, 0.8, 0.0, 1, 0),
    "neg-adv-ratio-above-high-keeps-grad": (-1.0, 1.5, 0.2, 0.2, 1.5, 1.5, 0, 0),
    "asymmetric-high-not-clipped": (2.0, 1.25, 0.2, 0.28, -2.5, -2.5, 0, 0),
    "symmetric-high-clipped": (2.0, 1.25, 0.2, 0.2, -2.4, 0.0, 0, 1),
    "inside-band": (0.5, 1.1, 0.2, 0.2, -0.55, -0.55, 0, 0),
    "zero-adv-never-clipped": (0.0, 3.0, 0.2, 0.2, 0.0, 0.0, 0, 0),
}


@pytest.mark.parametrize("case", list(CLIP_CASES), ids=list(CLIP_CASES))
def test_clipping_by_hand(case):
    adv, ratio, lo, hi, want_loss, want_grad, want_low, want_high = CLIP_CASES[case]
    logp = [[-1.0]]
    old = [[-1.0 - math.log(ratio)]]
    settings = LossSettings(epsilon_low=lo, epsilon_high=hi)
    loss, metrics, grad = _objective(logp, adv=[adv], old=old, settings=settings)
    assert loss == pytest.approx(want_loss, abs=1e-5)
    assert grad[0, 0] == pytest.approx(want_grad, abs=1e-5)
    assert float(metrics["clip_frac/low"]) == want_low
    assert float(metrics["clip_frac/high"]) == want_high
    assert float(metrics["ratio/mean"]) == pytest.approx(ratio, rel=1e-5)
    assert float(metrics["approx_kl"]) == pytest.approx(ratio - 1 - math.log(ratio), abs=1e-6)


def test_clipping_mixed_row_token_mean():
    # One row, four tokens: clipped high (+A), unclipped low (+A), padding, unclipped.
    logp = [[-1.0, -1.0, -7.0, -2.0]]
    old = [[-1.0 - math.log(1.5), -1.0 - math.log(0.5), 0.0, -2.0]]
    mask = [[1, 1, 0, 1]]
    loss, metrics, grad = _objective(logp, adv=[2.0], old=old, mask=mask)
    # per token: -1.2*2, -0.5*2, (masked), -1*2 ; mean over 3 valid tokens
    assert loss == pytest.approx((-2.4 - 1.0 - 2.0) / 3, abs=1e-5)
    np.testing.assert_allclose(grad, [[0.0, -1.0 / 3, 0.0, -2.0 / 3]], atol=1e-6)
    assert float(metrics["clip_frac/high"]) == pytest.approx(1 / 3)
    assert float(metrics["num_tokens"]) == 3


def test_on_policy_ratio_is_one_and_gradient_is_policy_gradient():
    logp = [[-0.3, -2.0], [-1.0, -0.1]]
    loss, metrics, grad = _objective(logp, adv=[1.5, -0.5])
    assert loss == pytest.approx((-1.5 * 2 + 0.5 * 2) / 4, abs=1e-6)
    np.testing.assert_allclose(grad, [[-1.5 / 4, -1.5 / 4], [0.5 / 4, 0.5 / 4]], atol=1e-7)
    assert float(metrics["ratio/mean"]) == 1.0
    assert float(metrics["clip_frac/low"]) == float(metrics["clip_frac/high"]) == 0.0
    assert float(metrics["approx_kl"]) == 0.0


# --------------------------------------------------------------------------- KL


def test_k3_kl_by_hand():
    beta, logp, ref = 0.5, -1.0, -1.5
    delta = ref - logp
    k3 = math.exp(delta) - delta - 1
    loss, metrics, grad = _objective([[logp]], adv=[0.0], ref=[[ref]], settings=LossSettings(beta=beta))
    assert loss == pytest.approx(beta * k3, abs=1e-6)
    assert grad[0, 0] == pytest.approx(beta * (1 - math.exp(delta)), abs=1e-6)
    assert float(metrics["kl"]) == pytest.approx(k3, abs=1e-6)


def test_beta_zero_never_touches_reference():
    nan_ref = [[float("nan"), float("nan")]]
    loss, metrics, grad = _objective([[-1.0, -2.0]], adv=[1.0], ref=nan_ref)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert float(metrics["kl"]) == 0.0
    loss2, _, _ = _objective([[-1.0, -2.0]], adv=[1.0], ref=None)
    assert loss == loss2


def test_beta_needs_reference():
    with pytest.raises(ValueError, match="ref_logprobs"):
        _run_plugin(JaxLoss(), _inputs(1, 2, 4, 8, seed=0), LossSettings(beta=0.1), ref=False)


# --------------------------------------------------------------------------- aggregation


def test_aggregation_by_hand():
    # On-policy, so each valid token's loss is -A of its row. Row lengths 3, 1, 0.
    logp = jnp.zeros((3, 4)) - 1.0
    mask = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    adv = [2.0, -1.0, 5.0]
    want = {
        "token_mean": (3 * -2.0 + 1 * 1.0) / 4,
        "sequence_mean": (-2.0 + 1.0 + 0.0) / 3,
        "constant": (3 * -2.0 + 1 * 1.0) / (3 * 6),
    }
    for agg, value in want.items():
        settings = LossSettings(aggregation=agg, max_completion_length=6)
        loss, metrics, _ = _objective(logp, adv=adv, mask=mask, settings=settings)
        assert loss == pytest.approx(value, abs=1e-6), agg
        assert float(metrics["num_tokens"]) == 4
    # An explicit normalizer replaces the batch's own.
    loss, _, _ = _objective(logp, adv=adv, mask=mask, normalizer=10.0)
    assert loss == pytest.approx((3 * -2.0 + 1.0) / 10.0, abs=1e-6)


def test_all_masked_batch_is_zero_not_nan():
    for agg in ("token_mean", "sequence_mean", "constant"):
        loss, metrics, grad = _objective([[-1.0, -2.0]], adv=[1.0], old=[[0.0, 0.0]], mask=[[0, 0]],
                                         settings=LossSettings(aggregation=agg, beta=0.1), ref=[[0.0, 0.0]])
        assert loss == 0.0 and np.all(grad == 0.0)
        assert all(np.isfinite(float(metrics[k])) for k in ("clip_frac/low", "ratio/mean", "kl", "approx_kl"))


# --------------------------------------------------------------------------- plugins end to end


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_micro_batches_with_global_normalizer_sum_to_full_batch(aggregation):
    b, t = 4, 6
    inputs = _inputs(b, t, 8, 40, seed=3, lengths=[6, 2, 0, 4], temperature=0.9)
    settings = LossSettings(beta=0.05, aggregation=aggregation, max_completion_length=t, temperature=0.9)
    plugin = JaxLoss()
    full_loss, full_metrics, (full_dh, full_dw) = _run_plugin(plugin, inputs, settings)
    global_norm = {"token_mean": float(jnp.sum(inputs["mask"])), "sequence_mean": float(b),
                   "constant": float(b * t)}[aggregation]
    losses, dhs, dw = [], [], 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        loss, _, (dh, dw_part) = _run_plugin(plugin, inputs, settings, normalizer=global_norm, rows=rows)
        losses.append(loss)
        dhs.append(dh)
        dw = dw + dw_part
    assert float(full_loss) != 0.0
    np.testing.assert_allclose(sum(losses), full_loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jnp.concatenate(dhs), full_dh, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, full_dw, rtol=1e-5, atol=1e-7)
    # Without the global normalizer micro-batches would weigh differently (not a no-op test).
    if aggregation != "constant":
        naive = sum(_run_plugin(plugin, inputs, settings, rows=r)[0] for r in (slice(0, 2), slice(2, 4)))
        assert abs(float(naive) - float(full_loss)) > 1e-3


def test_jax_logprobs_match_log_softmax_and_temperature():
    inputs = _inputs(2, 3, 4, 10, seed=1)
    _, metrics, _ = _run_plugin(JaxLoss(), inputs, LossSettings(temperature=0.5))
    # Independently of _jax.py: float64 numpy.
    logits = np.einsum("btd,dv->btv", np.float64(inputs["hidden"]), np.float64(inputs["head_weight"])) / 0.5
    logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    want = np.take_along_axis(logits, np.asarray(inputs["targets"])[..., None], -1)[..., 0] - logz
    np.testing.assert_allclose(metrics["logprobs"], want, atol=1e-5)
    p = np.exp(logits - logz[..., None])
    ent = -np.sum(p * np.log(p), -1)
    mask = np.asarray(inputs["mask"])
    want_ent = np.sum(ent * mask) / np.sum(mask)
    assert float(metrics["entropy"]) == pytest.approx(float(want_ent), rel=1e-5)


def test_shape_errors_name_the_argument():
    inputs = _inputs(2, 3, 4, 10, seed=1)
    inputs["advantages"] = jnp.zeros((3,))
    with pytest.raises(ValueError, match="advantages"):
        _run_plugin(JaxLoss(), inputs, LossSettings())


# --------------------------------------------------------------------------- registration, options, layout


def test_both_losses_registered():
    reg = get_plugins()
    assert isinstance(reg.get("loss", "jax"), JaxLoss)
    assert isinstance(reg.get("loss", "pallas"), PallasLoss)


def test_plugin_module_does_not_import_jax():
    code = "import sys, grpo.plugins.losses, grpo.engine.bench.loss; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "raw, field",
    [({"block_v": 100}, "block_v"), ({"block_t": 12}, "block_t"), ({"block_d": 24}, "block_d"),
     ({"block_t": 4}, "block_t"), ({"blockv": 128}, "blockv"), ({"schedule": "fast"}, "schedule")],
)
def test_pallas_options_refuse_untileable_sizes(raw, field):
    with pytest.raises(ValidationError) as err:
        PallasLossOptions.model_validate(raw)
    assert field in str(err.value)


def test_pallas_option_error_names_config_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {source: random}\nrollout: {num_generations: 4, max_new_tokens: 8}\ntask: {name: arithmetic}\n"
        "train: {steps: 1, prompts_per_step: 4}\nloss: {impl: pallas, options: {block_v: 100}}\n"
    )
    result = CliRunner().invoke(cli, ["config", "validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "loss.options.block_v" in result.output and "128" in result.output


def test_pallas_refuses_tp_at_config_validation(tmp_path):
    assert PallasLoss().check(layout=MeshLayout(dp=1, fsdp=8, tp=1), options=PallasLossOptions()) == []
    problems = PallasLoss().check(layout=MeshLayout(dp=1, fsdp=4, tp=2), options=PallasLossOptions())
    assert len(problems) == 1 and "tp=2" in problems[0]
    assert JaxLoss().check(layout=MeshLayout(dp=1, fsdp=4, tp=2), options=JaxLoss.Options()) == []
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {source: random}\nrollout: {num_generations: 4, max_new_tokens: 8}\ntask: {name: arithmetic}\n"
        "train: {steps: 1, prompts_per_step: 4}\nloss: {impl: pallas}\n"
        "mesh: {policy: explicit, options: {shape: '1,4,2'}}\n"
    )
    result = CliRunner().invoke(cli, ["config", "validate", str(path), "--processes", "1", "--local-devices", "8"])
    assert result.exit_code == 2, result.output
    assert "loss.impl=pallas" in result.output and "tp=2" in result.output


def test_resolve_config_per_backend():
    from grpo.plugins.losses._pallas import resolve_config

    opts = PallasLossOptions
    gpu = resolve_config(opts(), dtype=jnp.bfloat16, hidden_size=64, backend="gpu")
    assert (gpu.schedule, gpu.interpret, gpu.block_t, gpu.block_v, gpu.block_d) == ("loop", False, 64, 128, 64)
    tpu = resolve_config(opts(), dtype=jnp.bfloat16, hidden_size=64, backend="tpu")
    assert (tpu.schedule, tpu.interpret, tpu.block_t, tpu.block_v) == ("grid", False, 256, 512)
    assert tpu.vmem_limit_bytes and tpu.vmem_limit_bytes >= 32 << 20
    cpu = resolve_config(opts(), dtype=jnp.float32, hidden_size=64, backend="cpu")
    assert (cpu.schedule, cpu.interpret) == ("grid", True)
    refusals = [
        (opts(block_v=384), "gpu", jnp.bfloat16, "loss.options.block_v=384"),  # not a power of two
        (opts(block_t=8), "gpu", jnp.bfloat16, "loss.options.block_t=8"),  # below 16 for tl.dot
        (opts(block_t=8), "tpu", jnp.bfloat16, "multiple of 16"),  # bf16 packs 16 sublanes
        (opts(interpret=False), "cpu", jnp.float32, "interpret"),
        (opts(schedule="grid"), "gpu", jnp.float32, "schedule=grid"),
        (opts(schedule="loop"), "tpu", jnp.float32, "schedule=loop"),
    ]
    for options, backend, dtype, text in refusals:
        with pytest.raises(UserError, match=re.escape(text)):
            resolve_config(options, dtype=dtype, hidden_size=64, backend=backend)
    # f32 on TPU tiles at 8 sublanes: block_t=8 is fine there.
    assert resolve_config(opts(block_t=8), dtype=jnp.float32, hidden_size=64, backend="tpu").block_t == 8


def test_jax_loss_is_correct_with_vocab_sharded_head():
    """tp > 1 for the reference: GSPMD partitions the head matmul over the vocabulary and
    adds the collectives of the log-sum-exp and the target gather."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.asarray(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs the 8 virtual CPU devices of conftest.py")
    mesh = Mesh(devices.reshape(2, 4), ("fsdp", "tp"))
    inputs = _inputs(4, 6, 8, 44, seed=8)  # V=44 does not even divide over tp=4
    settings = LossSettings(beta=0.1, aggregation="sequence_mean")
    want = _run_plugin(JaxLoss(), inputs, settings)
    sharded = dict(inputs)
    for k, v in inputs.items():
        spec = P(None, "tp") if k == "head_weight" else P("fsdp")
        sharded[k] = jax.device_put(v, NamedSharding(mesh, spec))
    got = _run_plugin(JaxLoss(), sharded, settings)
    assert got[2][1].sharding.spec == P(None, "tp")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_entropy_bonus_against_numpy(aggregation):
    """``entropy_coef`` adds ``-coef * H`` per valid token, aggregated like the policy term;
    its gradient to the hidden states is ``-coef * w * dH/dz @ W^T / T`` with
    ``dH/dz_j = -p_j (log p_j + H)`` — both computed here in float64 NumPy."""
    b, t, d, v, temp, coef = 3, 4, 8, 50, 0.8, 0.3
    inputs = _inputs(b, t, d, v, seed=11, lengths=[4, 2, 0], temperature=temp)
    base = LossSettings(aggregation=aggregation, temperature=temp)
    with_bonus = LossSettings(aggregation=aggregation, temperature=temp, entropy_coef=coef)
    plugin = JaxLoss()
    loss0, _, (dh0, dw0) = _run_plugin(plugin, inputs, base, off_policy=False, ref=False)
    loss1, metrics, (dh1, dw1) = _run_plugin(plugin, inputs, with_bonus, off_policy=False, ref=False)

    h = np.asarray(inputs["hidden"], np.float64)
    w = np.asarray(inputs["head_weight"], np.float64)
    mask = np.asarray(inputs["mask"], np.float64)
    z = h @ w / temp  # B T V
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    p = np.exp(logp)
    ent = -(p * logp).sum(-1)  # B T
    if aggregation == "token_mean":
        weights = mask / mask.sum()
    else:
        weights = mask / np.maximum(mask.sum(1, keepdims=True), 1) / b
    np.testing.assert_allclose(float(loss1 - loss0), -coef * float((weights * ent).sum()), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["entropy"], (ent * mask).sum() / mask.sum(), rtol=1e-5)
    dz = -coef * weights[..., None] * (-p * (logp + ent[..., None])) / temp  # d bonus / d (h @ w)
    np.testing.assert_allclose(np.asarray(dh1 - dh0), dz @ w.T, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw1 - dw0), np.einsum("btd,btv->dv", h, dz), rtol=1e-4, atol=1e-6)
    assert np.abs(dz @ w.T).max() > 1e-3  # the bonus really moves the gradient


@pytest.mark.parametrize("impl", [JaxLoss, PallasLoss])
def test_token_logprobs_equal_compute_logprobs(impl):
    """The forward-only log-prob path (the reference pass) equals ``compute``'s, for both
    built-ins and for the contract's default (which runs ``compute``)."""
    from grpo.core.contracts import LossPlugin

    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(16, 300)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 300, (2, 5)), jnp.int32)
    plugin = impl()
    options = plugin.parse_options({"interpret": True} if impl is PallasLoss else {})
    settings = LossSettings(temperature=0.7)
    _, metrics = plugin.compute(hidden=hidden, head_weight=head, targets=targets, mask=jnp.ones((2, 5)),
                                advantages=jnp.zeros(2), old_logprobs=None, ref_logprobs=None,
                                settings=settings, options=options)
    got = plugin.token_logprobs(hidden=hidden, head_weight=head, targets=targets, settings=settings, options=options)
    np.testing.assert_allclose(np.asarray(got), np.asarray(metrics["logprobs"]), atol=1e-5)
    default = LossPlugin.token_logprobs(plugin, hidden=hidden, head_weight=head, targets=targets,
                                        settings=settings, options=options)
    np.testing.assert_allclose(np.asarray(default), np.asarray(metrics["logprobs"]), atol=1e-6)


def test_truncated_settings_make_every_jax_logprob_truncated_and_pallas_refuse():
    """Issue 49 item 5: with ``settings.top_k``/``top_p`` (``loss.truncated_policy``) the jax
    loss's log-probs, in ``compute`` (old and current) and in ``token_logprobs`` (the
    reference pass), are the truncated ones of its own logits, by a numpy reference (the
    target renormalised over the top-p nucleus of ``logits / T``, the nucleus plus the
    target when it falls outside, counted in ``truncated_policy/outside_frac``); the
    defaults keep the full log-softmax and no such metric; the fused kernel refuses."""
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(16, 40)), jnp.float32)
    scaled = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64) / 0.7
    # Every other target the most likely token (always kept), the rest random (often not).
    targets = jnp.asarray(np.where(np.arange(5) % 2 == 0, scaled.argmax(-1), rng.integers(0, 40, (2, 5))), jnp.int32)
    mask = jnp.ones((2, 5))
    plugin, options = JaxLoss(), JaxLoss().parse_options({})
    settings = LossSettings(temperature=0.7, top_p=0.6)
    args = dict(hidden=hidden, head_weight=head, targets=targets, mask=mask, advantages=jnp.ones(2),
                old_logprobs=None, ref_logprobs=None, options=options)
    _, metrics = plugin.compute(**args, settings=settings)
    ref = plugin.token_logprobs(hidden=hidden, head_weight=head, targets=targets, settings=settings, options=options)
    want, outside = np.zeros((2, 5)), np.zeros((2, 5), bool)
    for b in range(2):
        for t in range(5):
            row, y = scaled[b, t], int(targets[b, t])
            order = np.argsort(-row)
            p = np.exp(row[order] - row.max()) / np.exp(row[order] - row.max()).sum()
            kept = set(order[: max(int(np.sum(np.cumsum(p) - p < 0.6)), 1)].tolist())
            outside[b, t] = y not in kept
            support = sorted(kept | {y})
            want[b, t] = row[y] - np.log(np.exp(row[support]).sum())
    assert outside.any() and not outside.all()  # both cases are exercised
    np.testing.assert_allclose(np.asarray(metrics["logprobs"]), want, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ref), want, atol=1e-4)
    np.testing.assert_allclose(float(metrics["truncated_policy/outside_frac"]), outside.mean(), atol=1e-6)
    _, full = plugin.compute(**args, settings=LossSettings(temperature=0.7))
    assert "truncated_policy/outside_frac" not in full
    np.testing.assert_allclose(np.asarray(full["logprobs"]), (scaled - np.log(np.exp(scaled).sum(-1, keepdims=True)))[
        np.arange(2)[:, None], np.arange(5)[None], np.asarray(targets)], atol=1e-4)
    assert JaxLoss.supports_truncation and not PallasLoss.supports_truncation
    pallas = PallasLoss()
    with pytest.raises(ValueError, match="loss.impl=pallas cannot compute truncated log-probs"):
        pallas.compute(**dict(args, options=pallas.parse_options({"interpret": True})), settings=settings)
