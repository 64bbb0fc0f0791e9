"""The fused ``pallas`` loss against the ``jax`` reference, in Pallas interpret mode on CPU.

f32: loss, metrics and gradients w.r.t. the hidden states and the head weight agree
within 1e-4 (absolute and relative), on awkward shapes: V not a multiple of block_v, the
B*T token rows not a multiple of block_t, fully masked rows, zero advantages, on- and
off-policy, beta > 0, every aggregation, both kernel schedules.

bf16 tolerance (hidden states and head weight in bf16; both implementations accumulate
the matmuls and the softmax in f32 and return bf16 gradients): against the jax loss in
bf16, log-probs and loss within 1e-4 and every gradient element within 2^-6 of the
largest gradient magnitude (a couple of bf16 ulps: the kernels round dlogits to bf16 for
the MXU/tensor-core matmuls, as XLA does). Against the f32 reference, the error is the
bf16 rounding of the inputs: log-probs within 5e-2, gradients within 5e-2 of the max.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from _losses import _inputs, _run_plugin

from grpo.core.cli import cli
from grpo.core.contracts import LossSettings
from grpo.plugins.losses import JaxLoss, PallasLoss
from grpo.kernels import head_logprobs
from grpo.plugins.losses import _jax, _pallas

pytestmark = pytest.mark.slow

METRICS = ("clip_frac/low", "clip_frac/high", "ratio/mean", "kl", "approx_kl", "entropy", "num_tokens")


def _assert_close(got, want, tol=1e-4):
    loss, metrics, (dh, dw) = got
    rloss, rmetrics, (rdh, rdw) = want
    np.testing.assert_allclose(loss, rloss, atol=tol, rtol=tol)
    for k in METRICS:
        np.testing.assert_allclose(metrics[k], rmetrics[k], atol=tol, rtol=tol, err_msg=k)
    np.testing.assert_allclose(metrics["logprobs"], rmetrics["logprobs"], atol=tol, rtol=tol)
    np.testing.assert_allclose(dh, rdh, atol=tol, rtol=tol, err_msg="d hidden")
    np.testing.assert_allclose(dw, rdw, atol=tol, rtol=tol, err_msg="d head_weight")


# name -> (B, T, D, V, lengths, advantages override, off_policy, settings, pallas options)
CASES = {
    # 21 token rows over block_t=8; V=300 over block_v=128 (tail block of 44); an empty row.
    "grid-offpolicy-beta-token_mean": (
        3, 7, 16, 300, [7, 0, 4], None, True,
        LossSettings(beta=0.1, temperature=0.7, aggregation="token_mean"),
        {"block_t": 8, "block_v": 128}),
    # On-policy, one row with a zero advantage, one row fully masked.
    "grid-onpolicy-sequence_mean-zero_adv": (
        3, 5, 16, 200, [5, 3, 0], [0.0, 1.3, -0.7], False,
        LossSettings(aggregation="sequence_mean"),
        {"block_t": 8, "block_v": 128}),
    # T=13 > block_t: several row blocks; asymmetric clip; constant normaliser.
    "grid-offpolicy-constant-asym": (
        2, 13, 32, 260, [13, 9], None, True,
        LossSettings(epsilon_low=0.2, epsilon_high=0.28, beta=0.05, aggregation="constant",
                     max_completion_length=16),
        {"block_t": 16, "block_v": 128}),
    # The GPU (Triton) schedule, interpreted: in-kernel loops over vocab and hidden chunks.
    "loop-offpolicy-beta-token_mean": (
        3, 7, 24, 300, [7, 0, 4], None, True,
        LossSettings(beta=0.1, temperature=0.7, aggregation="token_mean"),
        {"schedule": "loop", "block_t": 16, "block_v": 128, "block_d": 16}),
    "loop-onpolicy-sequence_mean-zero_adv": (
        3, 5, 16, 200, [5, 3, 0], [0.0, 1.3, -0.7], False,
        LossSettings(aggregation="sequence_mean"),
        {"schedule": "loop", "block_t": 16, "block_v": 128, "block_d": 16}),
    # The entropy bonus: its gradient flows through the kernels' backward (both schedules).
    "grid-offpolicy-entropy_bonus": (
        3, 7, 16, 300, [7, 0, 4], None, True,
        LossSettings(temperature=0.7, entropy_coef=0.2),
        {"block_t": 8, "block_v": 128}),
    "loop-onpolicy-entropy_bonus-zero_adv": (
        3, 5, 16, 200, [5, 3, 0], [0.0, 0.0, 0.0], False,
        LossSettings(aggregation="sequence_mean", entropy_coef=0.5),
        {"schedule": "loop", "block_t": 16, "block_v": 128, "block_d": 16}),
}


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_pallas_matches_jax_f32(name):
    b, t, d, v, lengths, adv, off_policy, settings, options = CASES[name]
    inputs = _inputs(b, t, d, v, seed=len(name), lengths=lengths, temperature=settings.temperature)
    if adv is not None:
        inputs["advantages"] = jnp.asarray(adv, jnp.float32)
    ref = settings.beta > 0
    want = _run_plugin(JaxLoss(), inputs, settings, off_policy=off_policy, ref=ref)
    got = _run_plugin(PallasLoss(), inputs, settings, options=options, off_policy=off_policy, ref=ref)
    _assert_close(got, want)
    # The case exercises what it claims to: real gradients, clipping when off-policy.
    assert float(jnp.abs(want[2][1]).max()) > 1e-3
    if off_policy:
        assert float(want[1]["clip_frac/low"]) + float(want[1]["clip_frac/high"]) > 0
    if lengths and 0 in lengths:
        row = lengths.index(0)
        assert float(jnp.abs(got[2][0][row]).max()) == 0.0  # an empty row gets no gradient


def test_zero_advantages_give_zero_gradient():
    inputs = _inputs(2, 6, 16, 150, seed=5)
    inputs["advantages"] = jnp.zeros((2,))
    settings = LossSettings()
    loss, metrics, (dh, dw) = _run_plugin(PallasLoss(), inputs, settings, options={"block_t": 8, "block_v": 128})
    assert float(loss) == 0.0
    assert float(jnp.abs(dh).max()) == 0.0 and float(jnp.abs(dw).max()) == 0.0
    assert np.all(np.isfinite(metrics["logprobs"]))


def test_loop_schedule_vocab_chunks_of_dw():
    """The loop schedule's dW goes through f32 buffers of dw_chunk columns; the last chunk
    overlaps the one before it. 300 columns in chunks of 128: starts 0, 128, 172."""
    x = _inputs(2, 7, 16, 300, seed=11)
    g = jax.random.normal(jax.random.PRNGKey(0), (2, 7))
    cfg = head_logprobs.KernelConfig(block_t=16, block_v=128, block_d=16, schedule="loop", interpret=True,
                               backend="cpu", dw_chunk=128)

    def fused(h, w):
        lp, _ = head_logprobs.fused_token_logprobs(hidden=h, head_weight=w, targets=x["targets"], temperature=1.3,
                                             config=cfg)
        return jnp.sum(lp * g)

    def reference(h, w):
        lp, _ = _jax.token_logprobs(hidden=h, head_weight=w, targets=x["targets"], temperature=1.3)
        return jnp.sum(lp * g)

    got = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(x["hidden"], x["head_weight"])
    want = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(x["hidden"], x["head_weight"])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_grid_schedule_under_tpu_interpreter_with_race_detection():
    """TPU semantics: the TPU interpreter runs the grid on 2 simulated cores (the
    'parallel' axis split between them), fills uninitialised memory with NaN and checks
    for races between the cores."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
    from jax.experimental.pallas import tpu as pltpu

    x = _inputs(2, 5, 16, 200, seed=2)  # 10 rows over block_t=8, 200 columns over block_v=128
    g = jax.random.normal(jax.random.PRNGKey(1), (2, 5))
    params = pltpu.InterpretParams(uninitialized_memory="nan", detect_races=True, num_cores_or_threads=2)
    cfg = head_logprobs.KernelConfig(block_t=8, block_v=128, block_d=64, schedule="grid", interpret=params, backend="cpu")

    def fused(h, w):
        lp, ent = head_logprobs.fused_token_logprobs(hidden=h, head_weight=w, targets=x["targets"], temperature=0.8,
                                               config=cfg)
        return jnp.sum(lp * g), ent

    def reference(h, w):
        lp, ent = _jax.token_logprobs(hidden=h, head_weight=w, targets=x["targets"], temperature=0.8)
        return jnp.sum(lp * g), ent

    pltpu.reset_tpu_interpret_mode_state()
    got = jax.value_and_grad(fused, argnums=(0, 1), has_aux=True)(x["hidden"], x["head_weight"])
    want = jax.jit(jax.value_and_grad(reference, argnums=(0, 1), has_aux=True))(x["hidden"], x["head_weight"])
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("schedule", ["grid", "loop"])
def test_bf16_tolerance(schedule):
    x32 = _inputs(2, 13, 32, 300, seed=7, temperature=0.7)
    x16 = dict(x32, hidden=x32["hidden"].astype(jnp.bfloat16), head_weight=x32["head_weight"].astype(jnp.bfloat16))
    settings = LossSettings(beta=0.05, temperature=0.7)
    options = {"schedule": schedule, "block_t": 16, "block_v": 128}
    got = _run_plugin(PallasLoss(), x16, settings, options=options)
    bf16 = _run_plugin(JaxLoss(), x16, settings)
    f32 = _run_plugin(JaxLoss(), x32, settings)
    assert got[2][0].dtype == jnp.bfloat16 and got[2][1].dtype == jnp.bfloat16

    def grad_err(a, b):
        a, b = np.float32(a), np.float32(b)
        return float(np.abs(a - b).max() / np.abs(b).max())

    np.testing.assert_allclose(got[1]["logprobs"], bf16[1]["logprobs"], atol=1e-4)
    np.testing.assert_allclose(got[0], bf16[0], atol=1e-4)
    for i in (0, 1):
        assert grad_err(got[2][i], bf16[2][i]) <= 2**-6
        assert grad_err(got[2][i], f32[2][i]) <= 5e-2
    np.testing.assert_allclose(got[1]["logprobs"], f32[1]["logprobs"], atol=5e-2)


def test_micro_batches_pallas_sequence_mean():
    inputs = _inputs(4, 5, 16, 200, seed=4, lengths=[5, 2, 0, 4])
    settings = LossSettings(aggregation="sequence_mean", beta=0.1)
    options = {"block_t": 8, "block_v": 128}
    full_loss, _, (full_dh, full_dw) = _run_plugin(PallasLoss(), inputs, settings, options=options)
    parts = [_run_plugin(PallasLoss(), inputs, settings, options=options, normalizer=4.0, rows=r)
             for r in (slice(0, 2), slice(2, 4))]
    np.testing.assert_allclose(sum(p[0] for p in parts), full_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jnp.concatenate([p[2][0] for p in parts]), full_dh, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(parts[0][2][1] + parts[1][2][1], full_dw, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- lowering for TPU and GPU


def _export(platform, cfg, dtype=jnp.bfloat16, v=1000):
    """Lower value+grad for another platform (no device needed): the Mosaic and Triton
    lowering rules run, so their constraints (tiling, power-of-two sizes, supported ops)
    are checked here; the final Mosaic/PTX compilation is not."""
    from jax import export

    def step(h, w, t, g):
        def f(h, w):
            lp, _ = head_logprobs.fused_token_logprobs(hidden=h, head_weight=w, targets=t, temperature=0.9, config=cfg)
            return jnp.sum(lp * g)

        return jax.value_and_grad(f, argnums=(0, 1))(h, w)

    args = (jax.ShapeDtypeStruct((2, 100, 64), dtype), jax.ShapeDtypeStruct((64, v), dtype),
            jax.ShapeDtypeStruct((2, 100), jnp.int32), jax.ShapeDtypeStruct((2, 100), jnp.float32))
    checks = [export.DisabledSafetyCheck.custom_call(n) for n in ("__gpu$xla.gpu.triton", "tpu_custom_call")]
    return export.export(jax.jit(step), platforms=[platform], disabled_checks=checks)(*args).mlir_module()


@pytest.mark.parametrize("platform, backend, target", [("tpu", "tpu", "tpu_custom_call"),
                                                       ("cuda", "gpu", "xla.gpu.triton")])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_for_tpu_and_gpu(platform, backend, target, dtype):
    from grpo.plugins.losses import PallasLossOptions

    cfg = _pallas.resolve_config(PallasLossOptions(), dtype=dtype, hidden_size=64, backend=backend)
    assert not cfg.interpret
    module = _export(platform, cfg, dtype)
    assert module.count(target) == 3  # forward, dH, dW


def test_refused_block_sizes_really_fail_to_lower():
    """What resolve_config/Options refuse is what the backends' lowering rejects."""
    k = head_logprobs.KernelConfig
    with pytest.raises(ValueError, match="power of 2"):
        _export("cuda", k(block_t=64, block_v=384, block_d=64, schedule="loop", interpret=False, backend="gpu"))
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        _export("tpu", k(block_t=8, block_v=100, block_d=64, schedule="grid", interpret=False, backend="tpu"),
                jnp.float32)
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        _export("tpu", k(block_t=12, block_v=128, block_d=64, schedule="grid", interpret=False, backend="tpu"),
                jnp.float32)


# --------------------------------------------------------------------------- benchmark


def _bench(*args):
    result = CliRunner().invoke(cli, ["bench", "loss", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_bench_runs_both_impls_and_they_agree():
    shape = ["--batch", "2", "--time", "9", "--vocab", "300", "--hidden", "16", "--dtype", "f32",
             "--mode", "off_policy", "--beta", "0.1", "--iters", "1", "--warmup", "0", "--json"]
    jx = _bench("--impl", "jax", *shape)
    pa = _bench("--impl", "pallas", "--block-size", "128", "--time-block", "8", *shape)
    for key in ("impl", "device", "shape", "dtype", "loss", "first_call_s", "avg_step_ms", "compiled_temp_bytes",
                "peak_bytes_in_use"):
        assert key in jx and key in pa, key
    assert pa["kernel"] == {"block_t": 8, "block_v": 128, "block_d": 64, "schedule": "grid", "interpret": True}
    assert pa["loss"] == pytest.approx(jx["loss"], abs=1e-5)
    assert jx["grad_finite"] and pa["grad_finite"]


def test_bench_compiled_memory_has_no_logits_buffer():
    """Compile only: the jax loss holds [B, T, V] f32 logits (and more); the pallas loss
    holds nothing of that size. In interpret mode XLA copies every kernel operand into the
    interpreter's loop carry (a few copies of W); with --opaque-kernels the kernels are
    opaque calls that read their operands in place, as on TPU/GPU."""
    shape = ["--batch", "2", "--time", "256", "--vocab", "4000", "--hidden", "32", "--dtype", "f32",
             "--compile-only", "--json"]
    jx = _bench("--impl", "jax", *shape)
    pa = _bench("--impl", "pallas", *shape)
    opaque = _bench("--impl", "pallas", "--opaque-kernels", *shape)
    logits = 2 * 256 * 4000 * 4
    assert jx["logits_bytes_f32"] == logits and "avg_step_ms" not in jx
    assert jx["compiled_temp_bytes"] >= logits
    w_bytes = 32 * 4096 * 4  # W padded to whole vocab blocks
    assert pa["compiled_temp_bytes"] <= 6 * w_bytes + (1 << 20) < logits
    assert opaque["compiled_temp_bytes"] <= jx["compiled_temp_bytes"] // 64
    assert opaque["kernel"]["opaque"] is True


def test_bench_refusals():
    result = CliRunner().invoke(cli, ["bench", "loss", "--impl", "jax", "--block-size", "128", "--compile-only"])
    assert result.exit_code == 2 and "--impl pallas" in result.output
    result = CliRunner().invoke(cli, ["bench", "loss", "--impl", "pallas", "--block-size", "100", "--compile-only"])
    assert result.exit_code == 2 and "block_v" in result.output
    result = CliRunner().invoke(cli, ["bench", "loss", "--impl", "pallas", "--opaque-kernels"])
    assert result.exit_code == 2 and "--compile-only" in result.output


# --------------------------------------------------------------------------- GPU (Triton)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_triton_kernels_match_jax_on_gpu(dtype):
    x = _inputs(2, 100, 128, 1000, seed=9, dtype=dtype)
    settings = LossSettings(beta=0.05, temperature=0.9)
    got = _run_plugin(PallasLoss(), x, settings)  # auto: loop schedule, compiled by Triton
    want = _run_plugin(JaxLoss(), x, settings)
    if dtype == jnp.float32:
        _assert_close(got, want, tol=1e-4)
    else:
        np.testing.assert_allclose(got[1]["logprobs"], want[1]["logprobs"], atol=1e-3)
        for i in (0, 1):
            a, b = np.float32(got[2][i]), np.float32(want[2][i])
            assert float(np.abs(a - b).max() / np.abs(b).max()) <= 2**-6
