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
from grpo.engine.parallel.mesh import build_mesh
from grpo.engine.training.update import (
    UpdateBatch,
    UpdateStep,
    completion_hidden,
    head_for,
)


def token_logprobs(model, batch: UpdateBatch, temperature: float) -> jax.Array:
    """Per-token log-probs [B, N] of the completion under ``model``, materialising the
    logits: an independent reference for the engine's loss-plugin paths."""
    hidden = completion_hidden(model, batch.prompt_tokens, batch.prompt_mask, batch.tokens, batch.mask)
    logits = jnp.einsum("bnd,dv->bnv", hidden, head_for(model, hidden), preferred_element_type=jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    out = jnp.take_along_axis(logp, batch.tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.where(batch.mask > 0, out, 0.0)


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
    """Also, under token_mean, with loss.mask_truncated's rows: they leave the loss and its
    normalizer (so micro-batches stay exact), whatever their advantages."""
    _, model, graphdef, params = tiny
    batch = _batch(model.config.vocab_size)
    loss_mask = np.asarray(batch.mask)
    if aggregation == "token_mean":
        truncated = np.array([True, False, False, True, False, False, False, False])
        batch = batch._replace(truncated=jnp.asarray(truncated))
        loss_mask = loss_mask * ~truncated[:, None]
    full = jax.jit(_step(graphdef, 1, aggregation).grads)
    full_loss, full_grads, full_m, full_lp = full(params, batch)
    for m in (4,):
        loss, grads, metrics, lp = jax.jit(_step(graphdef, m, aggregation).grads)(params, batch)
        np.testing.assert_allclose(float(loss), float(full_loss), rtol=1e-5, atol=1e-7)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(full_grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lp), np.asarray(full_lp), atol=1e-5)
        np.testing.assert_allclose(float(metrics["num_tokens"]), float(full_m["num_tokens"]))
    assert float(full_m["num_tokens"]) == float(loss_mask.sum())
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(full_grads))
    if batch.truncated is not None:
        moved = batch._replace(advantages=batch.advantages.at[0].set(5.0).at[3].set(-5.0))
        loss2, grads2, _, _ = full(params, moved)
        assert float(loss2) == float(full_loss)
        for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(full_grads)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_metric_parts_combine_by_token_mean_min_and_max():
    """Micro-batch metrics fold as the update folds them: token-weighted means, and
    ``/min`` / ``/max`` as extremes (an empty part reports the identities); a batch with
    no valid token reports 0 for the extremes, not inf."""
    from grpo.engine.training.update import _combine, _finish, _identity

    inf = float("inf")
    parts = [{"num_tokens": 2.0, "ratio/mean": 1.0, "s/min": 0.5, "s/max": 2.0},
             {"num_tokens": 0.0, "ratio/mean": 0.0, "s/min": inf, "s/max": -inf},
             {"num_tokens": 6.0, "ratio/mean": 3.0, "s/min": 0.8, "s/max": 1.5}]

    def fold(ps):
        acc = {k: _identity(k) for k in ps[0]}
        for p in ps:
            acc = {k: _combine(k, acc[k], jnp.float32(v), jnp.float32(p["num_tokens"])) for k, v in p.items()}
        return {k: float(v) for k, v in _finish(acc, weighted=True).items()}

    assert fold(parts) == {"num_tokens": 8.0, "ratio/mean": 2.5, "s/min": 0.5, "s/max": 2.0}
    assert fold(parts[1:2]) == {"num_tokens": 0.0, "ratio/mean": 0.0, "s/min": 0.0, "s/max": 0.0}


def test_logprobs_match_reference_helper(tiny):
    _, model, graphdef, params = tiny
    batch = _batch(model.config.vocab_size, seed=1)
    _, _, _, lp = jax.jit(_step(graphdef, 1, "token_mean").grads)(params, batch)
    ref = token_logprobs(model, batch, 0.7)
    np.testing.assert_allclose(np.asarray(lp) * np.asarray(batch.mask), np.asarray(ref), atol=1e-5)


def test_loss_mask_trains_only_model_tokens_over_the_whole_sequence(tiny):
    """Multi-turn: the forward attends over every real token (``mask``), the loss and its
    token-mean normaliser count only ``loss_mask``. Reference: on-policy GRPO's gradient
    is that of -sum(adv * logp * loss_mask) / sum(loss_mask), over two micro-batches."""
    _, model, graphdef, params = tiny
    batch = _batch(model.config.vocab_size, seed=2)
    rng = np.random.default_rng(5)
    loss_mask = np.asarray(batch.mask) * (rng.random(batch.mask.shape) < 0.6)
    loss_mask[:, 0] = np.asarray(batch.mask)[:, 0]
    batch = batch._replace(loss_mask=jnp.asarray(loss_mask.astype(np.int32)))

    def reference(p):
        lp = token_logprobs(nnx.merge(graphdef, p), batch, 0.7)
        m = batch.loss_mask.astype(jnp.float32)
        return -jnp.sum(batch.advantages[:, None] * lp * m) / jnp.sum(m)

    ref_grads = jax.jit(jax.grad(reference))(params)
    # Two micro-batches: the global normaliser counts loss_mask across them.
    _, grads, metrics, lp = jax.jit(_step(graphdef, 2, "token_mean").grads)(params, batch)
    assert float(metrics["num_tokens"]) == float(loss_mask.sum())
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    ref_lp = np.asarray(token_logprobs(model, batch, 0.7))
    np.testing.assert_allclose(np.asarray(lp) * loss_mask, ref_lp * loss_mask, atol=1e-5)


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


@pytest.mark.slow
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


def test_loss_call_without_a_normalizer_uses_the_global_batchs_on_every_path(tiny):
    """``LossCall(args)`` with the normaliser left out: the per-shard (Pallas) path and the
    global (JAX) path both divide by the global batch's (it used to hand the shards 0:
    a NaN loss), and both equal the loss with the global normaliser passed explicitly."""
    from grpo.engine.training.update import LossCall

    mesh, model, graphdef, params = tiny
    batch = _batch(model.config.vocab_size, seed=5)
    plugins = load_plugins(entry_points=False)
    settings = LossSettings(aggregation="token_mean", max_completion_length=6, temperature=0.7)
    step = _step(graphdef, 1, "token_mean")
    args = dict(step._loss_args(params, batch), mask=batch.mask, advantages=batch.advantages, old_logprobs=None,
                ref_logprobs=None)
    jax_loss, pallas = plugins.get("loss", "jax"), plugins.get("loss", "pallas")
    calls = {
        "jax": LossCall(jax_loss, jax_loss.parse_options({}), settings, mesh),
        "pallas": LossCall(pallas, pallas.parse_options({"interpret": True}), settings, mesh),
    }
    assert calls["pallas"]._per_shard(8) and not calls["jax"]._per_shard(8)
    explicit = float(jax.jit(lambda a: calls["jax"](a, settings.normalizer(a["mask"]))[0])(args))
    for impl, call in calls.items():
        omitted = float(jax.jit(lambda a: call(a)[0])(args))
        assert np.isfinite(omitted), impl
        np.testing.assert_allclose(omitted, explicit, rtol=1e-5, err_msg=impl)
    # An independent value: token_mean of -A * 1 (on-policy ratio) over the valid tokens.
    mask = np.asarray(batch.mask, np.float64)
    want = -np.sum(np.asarray(batch.advantages, np.float64)[:, None] * mask) / mask.sum()
    np.testing.assert_allclose(explicit, want, rtol=1e-5)


# --------------------------------------------------------------------------- recipe precision


@pytest.fixture(scope="module")
def tiny_bf16():
    """The recipes' precision: bf16 parameters and bf16 compute."""
    from grpo.models.loading import random_init

    mesh = build_mesh(MeshLayout(dp=1, fsdp=8, tp=1))
    model = random_init("tiny", mesh, seed=0, param_dtype="bfloat16", compute_dtype="bfloat16")
    graphdef, params = nnx.split(model)
    return mesh, model, graphdef, params


def _changed_fraction(new, old) -> float:
    changed = sum(int(np.sum(np.asarray(a) != np.asarray(b))) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)))
    return changed / sum(np.asarray(a).size for a in jax.tree.leaves(old))


@pytest.mark.slow
def test_master_weights_train_bf16_at_recipe_lr_exactly_like_f32(tiny_bf16):
    """AdamW at lr 1e-6 on bf16 parameters: the f32 master moves exactly as an f32 run of
    the same model does; the bf16 parameters are the master rounded. Without the master,
    almost every bf16 update rounds away (the bug the master fixes)."""
    from grpo.engine.training.update import MasterWeights, init_optimizer_state

    _, model, graphdef, params = tiny_bf16
    batch = _batch(model.config.vocab_size, seed=4)
    opt = optax.adamw(1e-6, b1=0.9, b2=0.99, weight_decay=0.01)
    mixed = UpdateStep(**{**_step(graphdef, 2, "token_mean", opt).__dict__, "master_weights": True})
    state = init_optimizer_state(opt, params, master_weights=True)
    assert isinstance(state, MasterWeights)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating))

    # The f32 run: the same values held in f32 (the model computes in bf16 either way).
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    plain = _step(graphdef, 2, "token_mean", opt)
    run_mixed, run_plain = jax.jit(mixed.__call__), jax.jit(plain.__call__)
    p_mixed, s_mixed, p32, s32 = params, state, params32, opt.init(params32)
    for _ in range(3):
        p_mixed, s_mixed, m_mixed, _ = run_mixed(p_mixed, s_mixed, batch)
        p32, s32, m32, _ = run_plain(p32, s32, batch)
        assert bool(m_mixed["finite"])
    for a, b in zip(jax.tree.leaves(s_mixed.master), jax.tree.leaves(p32)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    for p, m in zip(jax.tree.leaves(p_mixed), jax.tree.leaves(s_mixed.master)):
        assert p.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(jnp.bfloat16)))
    assert _changed_fraction(s_mixed.master, state.master) > 0.95

    # The same three steps without a master: the bf16 weights barely move.
    naive = jax.jit(_step(graphdef, 2, "token_mean", opt).__call__)
    p_naive, s_naive = params, opt.init(params)
    for _ in range(3):
        p_naive, s_naive, _, _ = naive(p_naive, s_naive, batch)
    assert _changed_fraction(p_naive, params) < 0.2


def test_gradients_accumulate_in_f32(tiny_bf16):
    _, model, graphdef, params = tiny_bf16
    batch = _batch(model.config.vocab_size, seed=5)
    _, grads, _, _ = jax.jit(_step(graphdef, 4, "token_mean").grads)(params, batch)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("impl", ["jax", "pallas"])
def test_reference_pass_is_micro_batched_through_the_loss_plugin(tiny, impl):
    """beta > 0: the reference log-probs come micro-batch by micro-batch from the loss
    plugin's own path (Pallas: the fused kernel, per device) and equal the materialising
    reference within 1e-4 in f32."""
    mesh, model, graphdef, params = tiny
    batch = _batch(model.config.vocab_size, seed=6)
    plugins = load_plugins(entry_points=False)
    loss = plugins.get("loss", impl)
    options = loss.parse_options({"interpret": True} if impl == "pallas" else {})
    want = np.asarray(token_logprobs(model, batch, 0.7))
    for micro in (1, 4):
        step = UpdateStep(graphdef=graphdef, loss=loss, loss_options=options,
                          settings=LossSettings(beta=0.1, temperature=0.7, max_completion_length=6),
                          optimizer=optax.sgd(1e-2), micro_batches=micro, mesh=mesh)
        got = np.asarray(step.jit_reference()(params, batch))
        np.testing.assert_allclose(got, want, atol=1e-4)
        assert np.all(got[np.asarray(batch.mask) == 0] == 0.0)


def _reference_temp_bytes(impl: str, vocab: int, micro: int) -> int:
    from grpo.models.loading import random_init
    from grpo.plugins.losses import _pallas

    model = random_init(_tiny_config(vocab), None, seed=0)
    graphdef, params = nnx.split(model)
    loss = load_plugins(entry_points=False).get("loss", impl)
    options = loss.parse_options({"interpret": True} if impl == "pallas" else {})
    step = UpdateStep(graphdef=graphdef, loss=loss, loss_options=options,
                      settings=LossSettings(beta=0.1, max_completion_length=32), optimizer=optax.sgd(1e-2),
                      micro_batches=micro)
    b, lp, n = 16, 8, 32
    spec = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    batch = UpdateBatch(spec((b, lp)), spec((b, lp)), spec((b, n)), spec((b, n)), spec((b,), jnp.float32), None, None)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    if impl == "pallas":
        with _pallas.opaque_kernels():  # compiled kernels read their operands in place
            compiled = jax.jit(step.reference_logprobs).lower(abstract, batch).compile()
    else:
        compiled = jax.jit(step.reference_logprobs).lower(abstract, batch).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _tiny_config(vocab: int):
    import dataclasses

    from grpo.models.presets import preset_config

    return dataclasses.replace(preset_config("tiny"), vocab_size=vocab, tie_word_embeddings=False)


def test_reference_pass_never_holds_the_step_logits():
    """Compiled temp memory of the reference pass as the vocabulary grows by dV: the jax
    loss holds one micro-batch's logits (not the step's), the fused loss none at all."""
    dv = 8192
    rows_tokens = 16 * 32  # the step's completion tokens
    for impl, micro in (("jax", 4), ("pallas", 4)):
        growth = _reference_temp_bytes(impl, 512 + dv, micro) - _reference_temp_bytes(impl, 512, micro)
        step_logits = rows_tokens * dv * 4
        if impl == "jax":
            # ~ one micro-batch, two at most: with grpo's CPU set-up (XLA's own emitters, no
            # YNNPACK fusions, grpo/core/cpu.py) the compiled pass holds 2.03 micro-batches'
            # logits at this size, far from the step's 4.
            assert step_logits / micro / 2 <= growth < step_logits * 0.6, growth
        else:
            assert growth < step_logits / micro / 16, growth  # far below one micro-batch's logits


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["jax", "pallas"])
def test_one_head_precision_rule_under_mixed_precision(impl):
    """f32 parameters, bf16 compute: the policy loss, the reference pass and the sampler
    take the head matmul at one precision, so at identical weights their log-probs agree
    (before: the jax loss promoted the head to f32, 7.6e-4 apart, a non-zero KL at step 0)."""
    from grpo.engine.rollout.sampler import Sampler, SamplingParams
    from grpo.models.loading import random_init

    mesh = build_mesh(MeshLayout(dp=1, fsdp=8, tp=1))
    model = random_init("tiny", mesh, seed=1, param_dtype="float32", compute_dtype="bfloat16")
    graphdef, params = nnx.split(model)
    loss = load_plugins(entry_points=False).get("loss", impl)
    options = loss.parse_options({"interpret": True} if impl == "pallas" else {})
    settings = LossSettings(beta=0.1, temperature=0.7, max_completion_length=6)
    step = UpdateStep(graphdef=graphdef, loss=loss, loss_options=options, settings=settings,
                      optimizer=optax.sgd(1e-2), micro_batches=2, mesh=mesh)

    prompts = jnp.asarray(np.random.default_rng(0).integers(3, 200, (4, 5)), jnp.int32)
    sampler = Sampler(graphdef, mesh=mesh, batch_axes=("dp", "fsdp"), sampling=SamplingParams(
        max_new_tokens=6, num_generations=2, temperature=0.7, eos_ids=(), pad_id=0, early_stop_chunk=0))
    out = sampler.generate(params, prompts, jnp.ones_like(prompts), jax.random.key(0))
    batch = UpdateBatch(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask,
                        jnp.zeros(out.tokens.shape[0], jnp.float32), None, None)
    ref = np.asarray(step.jit_reference()(params, batch))
    batch = batch._replace(ref_logprobs=jnp.asarray(ref))
    _, _, metrics, policy = jax.jit(step.grads)(params, batch)
    mask = np.asarray(out.mask) > 0
    np.testing.assert_allclose(np.asarray(policy)[mask], ref[mask], atol=1e-6)
    assert abs(float(metrics["kl"])) < 1e-6
    # Cached bf16 decode vs one full bf16 forward: same head rule; the rest is bf16 noise.
    gap = np.abs(np.asarray(out.logprobs)[mask] - ref[mask])
    assert gap.mean() < 5e-3, gap.mean()


# --------------------------------------------------------------------------- packed update


def _packing_loss():
    """The jax loss as the packed update calls it. Until it declares ``supports_packing``
    itself, a token-level stand-in (segment ids ignored: exact for token_mean / constant
    aggregation of a token-level objective, which never reduce per sequence)."""
    loss = load_plugins(entry_points=False).get("loss", "jax")
    if getattr(loss, "supports_packing", False):
        return loss

    class TokenLevel(type(loss)):
        supports_packing = True

        def compute(self, *, segment_ids=None, **kwargs):  # noqa: ARG002
            return super().compute(**kwargs)

    return TokenLevel()


@pytest.mark.slow
@pytest.mark.parametrize("micro, aggregation", [(2, "sequence_mean")])  # per segment: the head layout renumbers them
def test_packed_update_equals_padded(tiny, micro, aggregation):
    """Same rows packed into bins, in four micro-batch schedules (every bin its own
    micro-batch; one micro-batch of every bin; one of 8 bins, the used ones and padding,
    with the head on every slot: the coarse shape grid; each in a layout with spare
    micro-batches that never run; and one micro-batch in a layout of one, which runs no
    loop: issue 50, a shorter compile): equal loss, gradients, metrics and per-token
    log-probs (unpacked to the rows) to the padded batch's, for the update and the
    forward-only log-prob pass. The schedule changes only the summation order (the
    global normaliser is the same)."""
    from grpo.engine.training.packing import pack_batch, schedule_packing, sequence_lengths, unpack_logprobs

    _, model, graphdef, params = tiny
    batch = _batch(model.config.vocab_size, seed=3)
    rng = np.random.default_rng(4)
    loss_mask = jnp.asarray(np.asarray(batch.mask) * rng.integers(0, 2, batch.mask.shape))  # multi-turn
    old = jnp.asarray(rng.normal(-1.0, 0.1, batch.mask.shape).astype(np.float32))
    batch = batch._replace(loss_mask=loss_mask, old_logprobs=old, truncated=jnp.asarray(np.arange(8) == 5))
    step = _step(graphdef, micro, aggregation)
    step = UpdateStep(**{**step.__dict__, "loss": _packing_loss()})
    lengths = np.asarray(sequence_lengths(batch.prompt_mask, batch.mask))
    loss_r, g_r, m_r, lp_r = jax.jit(step.grads)(params, batch)
    trained = np.asarray(batch.trained) > 0
    completions = np.asarray(batch.mask).sum(axis=1)
    # Issue 50: the coarse shape grid (one bin width, the widest; one head width, every
    # slot) computes padding bins and a full head, and changes nothing but the summation.
    loops = {}  # the update's loops by micro-batch slots
    for max_per, pers, buckets, capacity in ((8, None, 8, 12), (1, None, 8, 12), (8, (8,), 1, 12), (8, (8,), 1, 8)):
        plan = schedule_packing(lengths, bin_length=22, devices=1, max_per=max_per, rows=capacity,  # rows are 11 wide
                                completions=completions, pers=pers, head_buckets=buckets)
        assert plan.used < 8  # really packed
        assert plan.micro_batches == (1 if max_per == 8 else plan.used)
        assert plan.row.shape[0] > plan.micro_batches if capacity == 12 else plan.row.shape[0] == 1
        if pers is None:  # the head sees only the predicting slots, fewer than a micro-batch's
            assert plan.head < plan.per * 22
        else:  # padding bins computed, the head on every slot
            assert plan.bins > plan.used and plan.head == plan.per * 22
        packed, place = pack_batch(
            prompt_tokens=batch.prompt_tokens, prompt_mask=batch.prompt_mask, tokens=batch.tokens, mask=batch.mask,
            row=plan.row, index=plan.index, segment_ids=plan.segment_ids, loss_mask=step.loss_tokens(batch),
            trained=batch.trained, advantages=batch.advantages, old_logprobs=batch.old_logprobs,
            head_rows=1, head=plan.head,
        )
        assert packed.head_index.shape == (plan.row.shape[0], 1, plan.head)
        packed = packed._replace(normalizer=step.settings.normalizer(step.loss_tokens(batch)),
                                 micro_batches=jnp.int32(plan.micro_batches))
        loss_p, g_p, m_p, lp_p = jax.jit(step.grads)(params, packed)
        loops[plan.row.shape[0]] = jax.jit(step.grads).lower(params, packed).as_text().count("stablehlo.while")
        np.testing.assert_allclose(float(loss_p), float(loss_r), rtol=1e-5, atol=1e-7)
        for a, b in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_r)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
        for k in m_r:
            np.testing.assert_allclose(float(m_p[k]), float(m_r[k]), rtol=1e-5, atol=1e-6, err_msg=k)
        rows = lambda x: np.asarray(unpack_logprobs(x, place, rows=8, length=6))  # noqa: E731
        np.testing.assert_allclose(rows(lp_p)[trained], np.asarray(lp_r)[trained], atol=1e-5)
    assert loops[1] < min(v for k, v in loops.items() if k > 1)  # one slot: no micro-batch loop
    fwd = rows(jax.jit(step.policy_logprobs)(params, packed))
    np.testing.assert_allclose(fwd, np.asarray(jax.jit(step.policy_logprobs)(params, batch)), atol=1e-5)
    assert np.abs(fwd[trained]).min() > 0  # real log-probs, not zeros
