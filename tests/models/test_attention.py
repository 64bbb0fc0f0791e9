"""Blocked attention (``model.attention``): the splash (TPU) and Pallas GPU kernels against
the plain XLA reference, sharded and unsharded, inside the model against transformers,
in prefill, under remat, in a trainer step, and the config's refusals.

The Pallas kernels run in interpret mode on CPU (exactly their TPU/GPU semantics, slowly);
their TPU compile is checked by ``grpo plan`` (tests/engine/planning/test_plan.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _model_fixtures import checkpoint, hf_logits, logits_of, mesh, packed_vs_alone, padded_batch
from grpo.core.config import attention_plugin, load_config, resolve_layout
from grpo.core.contracts import Topology
from grpo.core.errors import ConfigError
from grpo.kernels.attention import PallasGpuAttention, SplashAttention, reference_attention
from grpo.models.layers.attention import head_specs, sharded
from grpo.models.decoder import positions_from_mask
from grpo.models.loading import load_hf

KERNELS = {"splash": SplashAttention(interpret=True), "pallas_gpu": PallasGpuAttention(interpret=True)}


def _inputs(dtype=jnp.float32, B=3, T=20, H=6, K=2, E=16, seed=0):
    """q/k/v and segment ids of a full row, a left-padded and a right-padded one. T=20 is a
    multiple of neither kernel's blocks; 6 query heads share 2 KV heads."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, H, E), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, K, E), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, K, E), jnp.float32).astype(dtype)
    real = np.ones((B, T), bool)
    real[1, :7] = False  # left padding (a prompt)
    real[2, 13:] = False  # right padding (a completion that stopped)
    weight = jax.random.normal(ks[3], (B, T, H, E), jnp.float32)
    return q, k, v, jnp.asarray(real.astype(np.int32)), jnp.asarray(real), weight


def _value_and_grads(fn, q, k, v, seg, real, weight):
    """A loss over the real rows' outputs, and its gradients with respect to q, k, v."""

    def loss(q, k, v):
        out = fn(q, k, v, seg, scale=0.25)
        return jnp.sum(jnp.where(real[:, :, None, None], out.astype(jnp.float32) * weight, 0.0)), out

    (value, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return value, out, grads


def _check(got, ref, real, tol):
    value, out, grads = got
    rvalue, rout, rgrads = ref
    m = np.asarray(real)[:, :, None, None]
    assert np.all(np.isfinite(np.asarray(out, np.float32)))  # padding rows too: never NaN
    assert abs(float(value) - float(rvalue)) <= tol * max(1.0, abs(float(rvalue)))
    np.testing.assert_allclose(np.where(m, np.asarray(out, np.float32), 0), np.where(m, np.asarray(rout, np.float32), 0), atol=tol)
    for g, r in zip(grads, rgrads):
        assert np.abs(np.asarray(r, np.float32)).max() > 0.1
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matches_reference_values_and_gradients_f32(name):
    q, k, v, seg, real, w = _inputs()
    ref = _value_and_grads(reference_attention, q, k, v, seg, real, w)
    _check(_value_and_grads(KERNELS[name], q, k, v, seg, real, w), ref, real, 1e-5)


@pytest.mark.slow
def test_splash_bf16_is_close_to_the_f32_reference():
    q, k, v, seg, real, w = _inputs(jnp.bfloat16)
    ref = _value_and_grads(reference_attention, *(x.astype(jnp.float32) for x in (q, k, v)), seg, real, w)
    got = _value_and_grads(KERNELS["splash"], q, k, v, seg, real, w)
    assert got[1].dtype == jnp.bfloat16
    _check(got, ref, real, 0.1)
    # and much closer than bf16's step on the whole output
    err = np.abs(np.asarray(got[1], np.float32) - np.asarray(ref[1]))[np.asarray(real)].max()
    assert err < 0.03, err


def _serving_rules():
    from grpo.plugins.rollout import SERVING_ACTIVATION_RULES

    return dict(SERVING_ACTIVATION_RULES, batch=("dp",))


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, rules, H, K",
    [
        ((2, 2, 2), "serving", 8, 2),  # serving: heads over (tp, fsdp), KV heads over tp: sliced per device
        ((1, 2, 4), None, 8, 2),  # 2 KV heads do not split 4 ways: heads split as the KV heads are
    ],
)
def test_sharded_kernel_matches_reference(shape, rules, H, K):
    from grpo.sharding import ACTIVATION_RULES

    rules = ACTIVATION_RULES if rules is None else _serving_rules()
    m = mesh(*shape)
    q, k, v, seg, real, w = _inputs(B=4, H=H, K=K)
    qspec, kspec, rest = head_specs(q.shape, k.shape, m, rules)
    if rules is not ACTIVATION_RULES:
        assert qspec[2] == ("tp", "fsdp") and kspec[2] == "tp" and rest == ("fsdp",)
    fn = functools.partial(sharded, KERNELS["splash"], mesh=m, rules=rules)
    got = jax.jit(lambda *a: _value_and_grads(fn, *a))(q, k, v, seg, real, w)
    _check(got, _value_and_grads(reference_attention, q, k, v, seg, real, w), real, 1e-5)


# --------------------------------------------------------------------------- in the model


@functools.cache
def _model(name, kernel, shape=None, **kwargs):
    impl = KERNELS[kernel] if kernel != "xla" else "xla"
    return load_hf(checkpoint(name), mesh(*shape) if shape else None, attention_impl=impl, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, kernel, shape",
    [("qwen3_untied", "splash", None), ("llama_untied", "splash", (2, 2, 2)), ("llama_untied", "pallas_gpu", None)],
)
def test_model_with_kernel_matches_transformers(name, kernel, shape):
    tokens, mask = padded_batch()
    ours = logits_of(_model(name, kernel, shape), tokens, mask)
    ref = hf_logits(checkpoint(name), tokens, mask)
    diff = np.abs(ours - ref)[mask].max()
    assert diff <= 1e-4, diff
    assert np.abs(ref[mask]).max() > 1.0


@pytest.mark.slow
def test_prefill_with_splash_then_xla_decode_equals_the_full_forward():
    tokens, mask = padded_batch()
    model = _model("llama_untied", "splash")
    full = logits_of(_model("llama_untied", "xla"), tokens, mask)
    P = 6
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill_then_decode(state, tokens, mask):
        m = nnx.merge(graphdef, state)
        positions = positions_from_mask(mask)
        cache = m.init_cache(tokens.shape[0], P)
        h, cache = m(tokens[:, :P], positions[:, :P], mask[:, :P], cache=cache, write_index=0)
        cache = jax.tree.map(lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, 3), (0, 0), (0, 0)]), cache)
        hs = [h]
        for t in range(P, P + 3):  # decode steps: T=1 against the cache, the XLA path
            h, cache = m(tokens[:, t:t + 1], positions[:, t:t + 1], mask, cache=cache, write_index=t)
            hs.append(h)
        return m.logits(jnp.concatenate(hs, axis=1))

    got = np.asarray(prefill_then_decode(state, jnp.asarray(tokens), jnp.asarray(mask)))
    np.testing.assert_allclose(got[mask], full[mask], atol=1e-4)


def _forward_kernels(jaxpr) -> int:
    """How many splash forward kernels a (nested) jaxpr runs."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call" and "fwd" in str(eqn.params.get("name", "")):
            n += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _forward_kernels(inner)
    return n


@pytest.mark.slow
def test_remat_dots_keeps_the_kernels_residuals_and_gradients():
    tokens, mask = padded_batch()
    positions = positions_from_mask(jnp.asarray(mask))
    grads, kernels = {}, {}
    for remat in ("none", "dots", "full"):
        graphdef, state = nnx.split(_model("llama_untied", "splash", None, remat=remat))

        def loss_fn(state):
            m = nnx.merge(graphdef, state)
            hidden, _ = m(jnp.asarray(tokens), positions, jnp.asarray(mask))
            return -(jax.nn.log_softmax(m.logits(hidden), axis=-1)[..., 0] * mask).sum()

        kernels[remat] = _forward_kernels(jax.make_jaxpr(jax.grad(loss_fn))(state).jaxpr)
        if remat != "full":
            grads[remat] = np.asarray(jax.jit(jax.grad(loss_fn))(state)["layers"]["k_proj"][...])
    # full recomputes the whole layer, attention forward included; dots keeps the kernel's
    # output and log-sum-exp and reruns only the cheap parts around it.
    assert kernels == {"none": 1, "dots": 1, "full": 2}
    assert np.abs(grads["none"]).max() > 0
    np.testing.assert_allclose(grads["dots"], grads["none"], atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- config


BASE = {"model": {"source": "random", "random": {"preset": "tiny"}}}


def test_auto_resolves_per_platform_and_reports_unknown_names():
    cfg = load_config(BASE)
    assert cfg.model.attention == "auto"
    assert [attention_plugin(cfg.model, p)[0] for p in ("tpu", "gpu", "cpu")] == ["splash", "pallas_gpu", "xla"]
    with pytest.raises(ConfigError, match=r"model\.attention: Unknown attention plugin 'flash'.*splash"):
        load_config(BASE, ["model.attention=flash"])


@pytest.mark.parametrize(
    "options, text",
    [
        ({"block_q": 100}, "model.attention_options.block_q: must be a positive multiple of 128"),
        ({"block_q_dkv": 2048, "block_kv_dkv": 4096}, "CompileTimeScopedVmemOom"),
        ({"block_kv": 512, "block_kv_compute": 384}, "block_kv_compute=384 must divide block_kv=512"),
        ({"block": 128}, "model.attention_options.block"),
    ],
)
def test_bad_block_sizes_are_refused_before_compiling(options, text):
    with pytest.raises(ConfigError, match="model.attention_options") as err:
        load_config(dict(BASE, model=dict(BASE["model"], attention="splash", attention_options=options)))
    assert text in str(err.value)


@pytest.mark.parametrize("name, platform", [("splash", "gpu"), ("pallas_gpu", "tpu")])
def test_a_kernel_the_platform_cannot_run_is_refused(name, platform):
    cfg = load_config(BASE, [f"model.attention={name}"])
    with pytest.raises(ConfigError) as err:
        resolve_layout(cfg, Topology(process_count=1, local_device_count=8, platform=platform))
    assert f"model.attention={name!r}" in str(err.value) and f"cannot run on {platform}" in str(err.value)
    # CPU runs both, interpreted (the tests' way)
    resolve_layout(cfg, Topology(process_count=1, local_device_count=8, platform="cpu"))


# --------------------------------------------------------------------------- trainer


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["splash", "pallas_gpu"])
def test_trainer_step_with_each_attention(attention, tmp_path, example_plugin):
    from _runs import _config

    from grpo.engine.runs.metrics import read_metrics
    from grpo.engine.trainer import Trainer

    # The third-party `length` task (tests/fixtures/example_plugin) rewards longer
    # completions: a random policy gets non-zero advantages and a real update.
    trainer = Trainer(_config(**{"model.attention": attention, "task": {"name": "length"}}), tmp_path)
    impl = trainer.policy.model.attention_impl
    assert type(impl) is type(KERNELS[attention]) and impl.interpret
    trainer.run()
    [row] = read_metrics(tmp_path)
    assert np.isfinite(row["loss"]) and row["grad_norm"] > 0
    # The sampler's log-probs come from prefill (this kernel) and decode (XLA attention);
    # the trainer's from the kernel alone: they agree.
    assert row["logprob_gap/sampler_trainer"] < 1e-4


# --------------------------------------------------------------------------- start-up self-check


@pytest.mark.slow
def test_self_check_passes_the_kernels_and_names_what_is_wrong():
    """The check itself, against the reference (f32 and bf16) and broken kernels (the
    built-in kernels pass it in every trainer step below: build_model checks them)."""
    from grpo.kernels.attention import self_check

    assert self_check(reference_attention, head_dim=16) is None
    assert self_check(reference_attention, dtype=jnp.bfloat16, head_dim=16) is None

    def scaled(q, k, v, s, *, scale):  # a wrong scale: the softmax sharpens
        return reference_attention(q, k, v, s, scale=2 * scale)

    def leaks_gradient(q, k, v, s, *, scale):  # right values, no gradient into k
        return reference_attention(q, jax.lax.stop_gradient(k), v, s, scale=scale)

    assert "outputs differ from the XLA reference" in self_check(scaled, head_dim=16)
    assert self_check(leaks_gradient, head_dim=16).startswith("its dk differ")


@pytest.fixture
def fresh_checks(monkeypatch):
    """No kernel checked yet in this process (the check is cached per process)."""
    from grpo.models import loading

    monkeypatch.setattr(loading, "_CHECKED", {})
    monkeypatch.setattr(loading, "_WARNED", set())
    return loading._CHECKED


@pytest.mark.parametrize("kernel, reason", [
    ("uncompilable", "it failed to compile or run (RuntimeError: Mosaic failed to compile the kernel: unsupported "
                     "block shape)"),
    ("wrong", "its outputs differ from the XLA reference's"),
])
def test_a_third_party_kernel_that_fails_its_check(kernel, reason, example_plugin, fresh_checks, monkeypatch, caplog):
    """Named explicitly: exit 2 naming the kernel and why. Under ``auto`` (made to pick it
    on CPU): xla, with one warning line naming it. Checked once per process and platform."""
    import logging

    from grpo.core import contracts
    from grpo.core.errors import UserError
    from grpo.kernels import attention as attention_mod
    from grpo.models.loading import build_model

    calls = []
    real_check = attention_mod.self_check
    monkeypatch.setattr(attention_mod, "self_check", lambda *a, **kw: calls.append(1) or real_check(*a, **kw))
    one = jax.make_mesh((1, 1, 1), ("dp", "fsdp", "tp"), devices=jax.devices()[:1])
    cfg = load_config(BASE, [f"model.attention={kernel}"])
    with pytest.raises(UserError) as err:
        build_model(cfg.model, one)
    assert err.value.exit_code == 2
    assert f"model.attention={kernel!r}: the attention kernel {kernel!r} failed its start-up check on cpu" in str(err.value)
    assert reason in str(err.value) and "second line" not in str(err.value)
    monkeypatch.setitem(contracts.AUTO_ATTENTION, "cpu", kernel)
    with caplog.at_level(logging.WARNING, logger="grpo"):
        for _ in range(2):
            model = build_model(load_config(BASE).model, one)
            assert model.attention_impl == "xla"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]  # one line, however many models are built
    assert warnings[0].startswith(f"model.attention=auto: the attention kernel {kernel!r} failed its start-up check")
    assert warnings[0].endswith("using xla instead") and reason in warnings[0]
    assert len(calls) == 1  # checked once: the explicit build, the auto builds read the cache


@pytest.mark.slow
@pytest.mark.parametrize("kernel, shape", [("splash", (2, 2, 2)), ("pallas_gpu", None)])
def test_model_with_kernel_on_packed_sequences_equals_each_alone(kernel, shape):
    # The kernels read the packed segment ids (splash under shard_map on a 2x2x2 mesh).
    assert packed_vs_alone(_model("llama_untied", kernel, shape), lengths=(5, 7, 4, 3, 6), bin_length=16) <= 1e-4
