"""The policy update: exact gradient accumulation, non-finite skip, reference log-probs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo.core.contracts import LossSettings, MeshLayout
from grpo.core.plugins import load_plugins
from grpo.engine.mesh import build_mesh
from grpo.engine.update import UpdateBatch, UpdateStep, token_logprobs


@pytest.fixture(scope="module")
def tiny():
    from grpo.models.loading import random_init

    mesh = build_mesh(MeshLayout(dp=1, fsdp=8, tp=1))
    model = random_init("tiny", mesh, seed=0)
    graphdef, params = nnx.split(model)
    return mesh, model, graphdef, params


def _batch(vocab, *, b=8, lp=5, n=6, seed=0):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, vocab, (b, lp)).astype(np.int32)
    pmask = np.ones((b, lp), np.int32)
    pmask[::3, :2] = 0  # left padding on some rows
    tokens = rng.integers(3, vocab, (b, n)).astype(np.int32)
    lengths = rng.integers(1, n + 1, b)
    lengths[1] = n
    mask = (np.arange(n)[None] < lengths[:, None]).astype(np.int32)
    adv = rng.normal(size=b).astype(np.float32)
    adv[2] = 0.0
    return UpdateBatch(
        jnp.asarray(prompt), jnp.asarray(pmask), jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(adv), None, None
    )


def _step(graphdef, micro, aggregation, optimizer=None):
    loss = load_plugins(entry_points=False).get("loss", "jax")
    return UpdateStep(
        graphdef=graphdef,
        loss=loss,
        loss_options=loss.parse_options({}),
        settings=LossSettings(aggregation=aggregation, max_completion_length=6, temperature=0.7),
        optimizer=optimizer or optax.sgd(1e-2),
        micro_batches=micro,
    )


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_micro_batched_gradients_equal_full_batch(tiny, aggregation):
    _, model, graphdef, params = tiny
    batch = _batch(model.config.vocab_size)
    full_loss, full_grads, full_m, full_lp = jax.jit(_step(graphdef, 1, aggregation).grads)(params, batch)
    for m in (4,):
        loss, grads, metrics, lp = jax.jit(_step(graphdef, m, aggregation).grads)(params, batch)
        np.testing.assert_allclose(float(loss), float(full_loss), rtol=1e-5, atol=1e-7)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(full_grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lp), np.asarray(full_lp), atol=1e-5)
        np.testing.assert_allclose(float(metrics["num_tokens"]), float(full_m["num_tokens"]))
    assert float(full_m["num_tokens"]) == float(np.asarray(batch.mask).sum())
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(full_grads))


def test_logprobs_match_reference_helper(tiny):
    _, model, graphdef, params = tiny
    batch = _batch(model.config.vocab_size, seed=1)
    _, _, _, lp = jax.jit(_step(graphdef, 1, "token_mean").grads)(params, batch)
    ref = token_logprobs(model, batch, 0.7)
    np.testing.assert_allclose(np.asarray(lp) * np.asarray(batch.mask), np.asarray(ref), atol=1e-5)


def test_nonfinite_step_is_skipped(tiny):
    _, model, graphdef, params = tiny
    batch = _batch(model.config.vocab_size, seed=2)
    opt = optax.adam(1e-2)
    step = jax.jit(_step(graphdef, 2, "token_mean", opt).__call__)
    opt_state = opt.init(params)
    bad = batch._replace(advantages=batch.advantages.at[0].set(jnp.nan))
    new_params, new_opt, metrics, _ = step(params, opt_state, bad)
    assert not bool(metrics["finite"])
    for a, b in zip(jax.tree.leaves((new_params, new_opt)), jax.tree.leaves((params, opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    new_params, _, metrics, _ = step(params, opt_state, batch)
    assert bool(metrics["finite"])
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)))


def test_per_shard_pallas_loss_equals_global_jax_loss(tiny):
    """The Pallas loss runs per device under shard_map; loss, metrics and gradients equal
    the plain JAX loss computed on the global batch."""
    mesh, model, graphdef, params = tiny
    batch = _batch(model.config.vocab_size, seed=3)
    plugins = load_plugins(entry_points=False)
    pallas = plugins.get("loss", "pallas")
    assert pallas.per_shard
    settings = LossSettings(aggregation="sequence_mean", max_completion_length=6, temperature=0.7, beta=0.0)
    ref = UpdateStep(graphdef=graphdef, loss=plugins.get("loss", "jax"),
                     loss_options=plugins.get("loss", "jax").parse_options({}), settings=settings,
                     optimizer=optax.sgd(1e-2), micro_batches=1, mesh=mesh)
    fused = UpdateStep(graphdef=graphdef, loss=pallas, loss_options=pallas.parse_options({"interpret": True}),
                       settings=settings, optimizer=optax.sgd(1e-2), micro_batches=1, mesh=mesh)
    want = jax.jit(ref.grads)(params, batch)
    got = jax.jit(fused.grads)(params, batch)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    for key in ("num_tokens", "clip_frac/low", "ratio/mean"):
        np.testing.assert_allclose(float(got[2][key]), float(want[2][key]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want[3]), atol=1e-5)
