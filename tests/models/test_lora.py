"""LoRA and QLoRA: adapters in the scanned decoder, the adapter-only update, the frozen
(quantized) base, the reference with adapters off, checkpoints and bad input.

The independent reference for the adapter path is the *merged* model: the base
architecture with every targeted weight replaced by ``W + (alpha / r) A @ B``, run through
the ordinary full-fine-tuning update (a different code path: one matmul per projection,
no adapter einsums, no frozen/trainable split)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo.core.config import LoraConfig, load_config
from grpo.core.contracts import LossSettings, MeshLayout
from grpo.core.errors import ConfigError, UserError
from grpo.core.plugins import load_plugins
from grpo.engine.parallel.mesh import build_mesh
from grpo.engine.training.update import UpdateBatch, UpdateStep
from grpo.models import quant
from grpo.models.lora import (
    apply_lora,
    count_params,
    lora_delta,
    merge_params,
    split_params,
)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(MeshLayout(dp=1, fsdp=8, tp=1))


def _model(mesh, lora=None, seed=0):
    from grpo.models.loading import random_init

    model = random_init("tiny", mesh, seed=seed)
    if lora is not None:
        apply_lora(model, lora, seed=seed)
    return model


def _batch(vocab, *, b=8, lp=5, n=6, seed=0, dropout_keys=False):
    rng = np.random.default_rng(seed)
    pmask = np.ones((b, lp), np.int32)
    pmask[::3, :2] = 0
    lengths = rng.integers(1, n + 1, b)
    mask = (np.arange(n)[None] < lengths[:, None]).astype(np.int32)
    keys = None
    if dropout_keys:
        keys = jnp.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed + 7), b)))
    return UpdateBatch(
        prompt_tokens=jnp.asarray(rng.integers(3, vocab, (b, lp)).astype(np.int32)),
        prompt_mask=jnp.asarray(pmask),
        tokens=jnp.asarray(rng.integers(3, vocab, (b, n)).astype(np.int32)),
        mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=b).astype(np.float32)),
        old_logprobs=None,
        ref_logprobs=None,
        dropout_keys=keys,
    )


def _step(graphdef, *, micro=1, beta=0.0, optimizer=None, mesh=None):
    loss = load_plugins(entry_points=False).get("loss", "jax")
    return UpdateStep(
        graphdef=graphdef, loss=loss, loss_options=loss.parse_options({}),
        settings=LossSettings(aggregation="token_mean", max_completion_length=6, temperature=0.7, beta=beta),
        optimizer=optimizer or optax.sgd(1e-2), micro_batches=micro, mesh=mesh,
    )


def _randomise(adapters, scale=0.05, seed=3):
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


# --------------------------------------------------------------------------- config


def test_lora_config_defaults_and_target_patterns():
    cfg = LoraConfig()
    assert cfg.rank == 16 and cfg.dropout == 0.0 and cfg.base_quantization == "none"
    assert cfg.projections() == tuple(ALL)
    assert LoraConfig(targets=["all-linear"]).projections() == tuple(ALL)
    assert LoraConfig(targets=[r"layers\.[qv]_proj"]).projections() == ("q_proj", "v_proj")
    assert LoraConfig(targets=["_proj$"]).projections(("q_proj", "o_proj")) == ("q_proj", "o_proj")
    # Full fine-tuning of bf16 keeps master weights; LoRA adapters are f32 themselves.
    base = {"model": {"source": "random", "param_dtype": "bfloat16", "compute_dtype": "bfloat16"}}
    assert load_config(base).master_weights
    assert not load_config(base, ["model.lora.rank=4"]).master_weights


def test_targets_matching_nothing_are_a_config_error_naming_the_field():
    with pytest.raises(ConfigError) as err:
        load_config({"model": {"source": "random"}}, ['model.lora.targets=["attention"]'])
    text = str(err.value)
    assert "model.lora.targets" in text and "'attention' matches no projection" in text and "layers.q_proj" in text
    with pytest.raises(ConfigError, match="not a projection name or a valid regular expression"):
        load_config({"model": {"source": "random"}}, ['model.lora.targets=["q_proj("]'])


def test_rank_too_large_and_missing_family_projections_are_user_errors(mesh):
    from grpo.models.lora import resolve_spec
    from grpo.models.presets import preset_config

    tiny = preset_config("tiny")  # hidden 64, 4 heads x 16, kv 2 x 16, mlp 128
    with pytest.raises(UserError) as err:
        resolve_spec(tiny, LoraConfig(rank=40, targets=["k_proj", "q_proj"]))
    text = str(err.value)
    # k_proj is 64 x 32: rank 40 is too large; q_proj (64 x 64) is fine.
    assert "model.lora.rank=40" in text and "layers.k_proj" in text and "at most 32" in text
    assert "layers.q_proj" not in text
    spec = resolve_spec(tiny, LoraConfig(rank=32, targets=["k_proj", "q_proj"]))
    assert spec.targets == ("q_proj", "k_proj") and spec.scale == 32.0 / 32


def test_cli_reports_bad_lora_input_with_exit_2_and_no_traceback(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {source: random}\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for sets, needle in ((['model.lora.targets=["nothing_here"]'], "model.lora.targets"),
                         (["model.lora.rank=1000"], "model.lora.rank=1000")):
        args = [sys.executable, "-m", "grpo.core.cli", "config", "validate", str(cfg)]
        for s in sets:
            args += ["--set", s]
        out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 2, out.stderr
        assert needle in out.stderr and "Traceback" not in out.stderr


# --------------------------------------------------------------------------- the adapter path


@pytest.fixture(scope="module")
def lora_tiny(mesh):
    """(mesh, base model, LoRA model, graphdef, adapters, base state) — the same seed, so
    the LoRA model's base is the base model's weights."""
    base = _model(mesh)
    lora = _model(mesh, LoraConfig(rank=4, alpha=8.0, targets=ALL))
    graphdef, state = nnx.split(lora)
    adapters, frozen = split_params(state)
    return mesh, base, lora, graphdef, adapters, frozen


def test_step0_log_probs_equal_the_base_model_exactly(lora_tiny):
    _, base, lora, graphdef, adapters, frozen = lora_tiny
    batch = _batch(base.config.vocab_size)
    gd_base, p_base = nnx.split(base)
    _, _, _, lp_base = jax.jit(_step(gd_base).grads)(p_base, batch)
    _, _, _, lp_lora = jax.jit(_step(graphdef).grads)(adapters, batch, frozen)
    np.testing.assert_array_equal(np.asarray(lp_lora), np.asarray(lp_base))
    # B = 0 at init; A is not.
    for name in ALL:
        assert not np.any(np.asarray(getattr(lora.lora, f"{name}_b")[...]))
        assert np.any(np.asarray(getattr(lora.lora, f"{name}_a")[...]))


def test_use_adapters_switches_the_adapter_term_off_and_on(lora_tiny):
    _, base, _, graphdef, adapters, frozen = lora_tiny
    moved = _randomise(adapters)  # B != 0: the adapters change the output
    tokens = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6) % base.config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))

    @functools.partial(jax.jit, static_argnums=0)
    def hidden(enabled, state):
        model = nnx.merge(graphdef, state, frozen)
        assert model.use_adapters(enabled) is model
        return model(tokens, positions)[0]

    off = np.asarray(hidden(False, moved))
    # Off, the adapters are not read at all; the base model's output, up to how XLA
    # compiles another program.
    np.testing.assert_array_equal(off, np.asarray(hidden(False, adapters)))
    gd_base, p_base = nnx.split(base)
    plain = jax.jit(lambda s: nnx.merge(gd_base, s)(tokens, positions)[0])(p_base)
    np.testing.assert_allclose(off, np.asarray(plain), rtol=0, atol=1e-5)
    assert np.abs(np.asarray(hidden(True, moved)) - off).max() > 1e-3


def _merged_loss_fn(base, step_base, batch, graphdef, frozen):
    """Loss of the merged model as a function of the adapters: the independent reference
    (the base architecture's own update on ``W + (alpha / r) A @ B``)."""
    _, p_base = nnx.split(base)
    normalizer = step_base.settings.normalizer(batch.mask)

    def loss(adapters):
        with_adapters = nnx.merge(graphdef, merge_params(adapters, frozen))
        merged = []
        for path, var in nnx.to_flat_state(p_base):
            key = ".".join(map(str, path))
            name = key.split(".", 1)[1] if key.startswith("layers.") else None
            delta = lora_delta(with_adapters, name) if name in ALL else None
            merged.append((path, var if delta is None else var.replace(var[...] + delta)))
        return step_base.loss_and_metrics(nnx.from_flat_state(merged), batch, normalizer)[0]

    return loss


@pytest.mark.slow
def test_lora_gradients_equal_the_merged_model_and_finite_differences(lora_tiny):
    _, base, _, graphdef, adapters, frozen = lora_tiny
    batch = _batch(base.config.vocab_size, seed=1)
    adapters = _randomise(adapters)
    gd_base, _ = nnx.split(base)
    grads_fn = jax.jit(_step(graphdef).grads)
    # Old log-probs of the current adapters: the ratio is 1 here but moves with them, so
    # the loss value (not only its gradient) depends on the adapters.
    batch = batch._replace(old_logprobs=grads_fn(adapters, batch, frozen)[3])
    loss, grads, _, _ = grads_fn(adapters, batch, frozen)
    ref_fn = _merged_loss_fn(base, _step(gd_base), batch, graphdef, frozen)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(ref_fn))(adapters)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-7)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        assert float(jnp.abs(r).max()) > 0, path
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-6, err_msg=str(path))
    # A directional finite difference of the adapter loss itself (central, f32).
    lora_loss = lambda a: grads_fn(a, batch, frozen)[0]  # noqa: E731
    direction = _randomise(jax.tree.map(jnp.zeros_like, adapters), scale=1.0, seed=11)
    eps = 1e-3
    plus = lora_loss(jax.tree.map(lambda a, v: a + eps * v, adapters, direction))
    minus = lora_loss(jax.tree.map(lambda a, v: a - eps * v, adapters, direction))
    fd = (float(plus) - float(minus)) / (2 * eps)
    analytic = sum(float(jnp.vdot(g, v)) for g, v in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    assert abs(fd - analytic) <= 2e-2 * abs(analytic) + 1e-4, (fd, analytic)


@pytest.mark.slow
def test_micro_batched_lora_gradients_with_dropout_equal_the_full_batch(lora_tiny):
    """Per-row dropout keys: a row's mask does not depend on its micro-batch."""
    mesh, base, _, _, _, _ = lora_tiny
    model = _model(mesh, LoraConfig(rank=4, alpha=8.0, dropout=0.3, targets=ALL))
    graphdef, state = nnx.split(model)
    adapters, frozen = split_params(state)
    adapters = _randomise(adapters)
    batch = _batch(base.config.vocab_size, seed=2, dropout_keys=True)
    full = jax.jit(_step(graphdef).grads)(adapters, batch, frozen)
    micro = jax.jit(_step(graphdef, micro=4).grads)(adapters, batch, frozen)
    np.testing.assert_allclose(float(micro[0]), float(full[0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(micro[1]), jax.tree.leaves(full[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
    # Dropout is on: other keys give other gradients; no keys (the sampler's path) none.
    other = batch._replace(dropout_keys=jnp.asarray(jax.random.key_data(jax.random.split(jax.random.key(99), 8))))
    g_other = jax.jit(_step(graphdef).grads)(adapters, other, frozen)[1]
    g_none = jax.jit(_step(graphdef).grads)(adapters, batch._replace(dropout_keys=None), frozen)[1]
    leaf = lambda g: np.asarray(jax.tree.leaves(g)[0])  # noqa: E731
    assert not np.allclose(leaf(g_other), leaf(full[1]))
    assert not np.allclose(leaf(g_none), leaf(full[1]))


def test_a_step_trains_only_the_adapters_and_the_reference_is_the_base(lora_tiny):
    _, base, _, graphdef, adapters, frozen = lora_tiny
    batch = _batch(base.config.vocab_size, seed=4)
    opt = optax.adam(1e-2)
    step = _step(graphdef, beta=0.1, optimizer=opt)
    opt_state = opt.init(adapters)
    # Optimizer state exists for the adapters only: two moments of each, nothing else.
    n_adapter = count_params(adapters)
    assert count_params(opt_state) == 2 * n_adapter + 1  # + the step count
    assert n_adapter < count_params(frozen) / 10
    frozen_before = [np.asarray(x).copy() for x in jax.tree.leaves(frozen)]
    adapters_before = jax.tree.map(lambda x: np.asarray(x).copy(), adapters)

    # Reference = the base: with adapters that differ from zero it still equals the base.
    moved = _randomise(adapters)
    ref = jax.jit(step.reference_logprobs)(moved, batch, frozen)
    gd_base, p_base = nnx.split(base)
    base_ref = jax.jit(_step(gd_base, beta=0.1).reference_logprobs)(p_base, batch)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(base_ref))
    batch = batch._replace(ref_logprobs=ref)

    new_adapters, new_opt, metrics, _ = jax.jit(step.__call__)(adapters, opt_state, batch, frozen)
    assert bool(metrics["finite"])
    for before, after in zip(frozen_before, jax.tree.leaves(frozen)):
        np.testing.assert_array_equal(before, np.asarray(after))
    changed = [not np.array_equal(a, np.asarray(b))
               for a, b in zip(jax.tree.leaves(adapters_before), jax.tree.leaves(new_adapters))]
    # Every B moves; A's gradient is zero while B is zero (dL/dA = x^T dL/dy B^T).
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(new_adapters)]
    for path, c in zip(paths, changed):
        assert c == ("_b" in path), path


# --------------------------------------------------------------------------- QLoRA


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_base_matches_the_original_within_the_format_error(kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 96, 5)).astype(np.float32) * 0.02
    w[0, :64, 0] = 0.0  # an all-zero block
    codes, scales = quant.quantize(jnp.asarray(w), kind, 64)
    assert codes.dtype == (jnp.uint4 if kind == "nf4" else jnp.int8)
    b = quant.block_size(96, 64)
    assert b == 32 and scales.shape == (2, 3, 5)
    back = np.asarray(quant.dequantize(codes, scales, kind))
    # An independent reference: nearest code in numpy, block by block.
    blocks = w.reshape(2, 3, b, 5)
    absmax = np.abs(blocks).max(axis=2, keepdims=True)
    normed = blocks / np.where(absmax > 0, absmax, 1.0)
    if kind == "nf4":
        ref = quant.NF4_VALUES[np.abs(normed[..., None] - quant.NF4_VALUES).argmin(-1)]
    else:
        ref = np.round(normed * 127) / 127
    ref = (ref * absmax).reshape(w.shape)
    np.testing.assert_allclose(back, ref, rtol=1e-6, atol=1e-9)
    err = np.abs(back - w).reshape(2, 3, b, 5) / np.where(absmax > 0, absmax, 1.0)
    assert err.max() <= quant.max_error(kind) + 1e-6
    np.testing.assert_array_equal(back[0, :64, 0], 0.0)
    # One layer's slice dequantizes the same as the stacked array.
    np.testing.assert_array_equal(np.asarray(quant.dequantize(codes[1], scales[1], kind, axis=0)), back[1])


@pytest.mark.slow
def test_qlora_nf4_model_runs_a_step_with_a_frozen_quantized_base(mesh):
    from grpo.models.lora import base_weight

    plain = _model(mesh)
    model = _model(mesh, LoraConfig(rank=4, base_quantization="nf4", targets=["q_proj", "down_proj"]))
    assert model.layers.q_proj[...].dtype == jnp.uint4 and model.layers.k_proj[...].dtype == jnp.uint4
    assert model.embed[...].dtype == jnp.float32  # embeddings/head/norms stay
    for name in ALL:
        w = np.asarray(getattr(plain.layers, name)[...])
        deq = np.asarray(base_weight(model, name))
        scale = np.repeat(np.asarray(getattr(model.layers, f"{name}_scale")[...]), w.shape[1] // getattr(
            model.layers, f"{name}_scale")[...].shape[1], axis=1)
        assert np.all(np.abs(deq - w) <= quant.max_error("nf4") * scale + 1e-7), name
    graphdef, state = nnx.split(model)
    adapters, frozen = split_params(state)
    assert set(adapters["lora"]) == {"q_proj_a", "q_proj_b", "down_proj_a", "down_proj_b"}
    opt = optax.adam(1e-2)
    batch = _batch(model.config.vocab_size, seed=5)
    new, _, metrics, lp = jax.jit(_step(graphdef, optimizer=opt).__call__)(adapters, opt.init(adapters), batch, frozen)
    assert bool(metrics["finite"]) and np.isfinite(np.asarray(lp)).all()
    assert not np.array_equal(np.asarray(new["lora"]["q_proj_b"][...]), np.asarray(adapters["lora"]["q_proj_b"][...]))


# --------------------------------------------------------------------------- the trainer


TINY = {
    "model": {"source": "random", "random": {"preset": "tiny"},
              "lora": {"rank": 4, "alpha": 16, "dropout": 0.1}},
    "rollout": {"num_generations": 2, "max_prompt_length": 32, "max_new_tokens": 3, "early_stop_chunk": 0},
    "task": {"name": "arithmetic", "options": {"max_operand": 9, "num_examples": 64, "num_test_examples": 8,
                                               "reward_weights": {"close": 0.5, "length": 0.25, "format": 0.25}}},
    "train": {"steps": 3, "prompts_per_step": 8, "ppo_epochs": 2, "micro_batch_size": 8,
              "optimizer": {"learning_rate": 1e-2}},
    "loss": {"beta": 0.05, "aggregation": "sequence_mean",
             "mismatch": {"level": "token", "mode": "truncate", "cap": 2.0}},
    "checkpoint": {"every_n_steps": 0, "at_end": False},
    "logging": {"progress_bar": False, "plot": False},
}
# Bins of two longest sequences (2 x (32 + 3)): packed runs put several sequences in a bin.
PACKED_TWO = ["train.packing.bin_length=70"]


@pytest.mark.slow
def test_lora_run_resumes_bitwise_and_checkpoints_only_adapters(tmp_path):
    """A LoRA run with dropout, beta > 0, truncated IS, sequence_mean, two micro-batches and
    two PPO epochs (packed: ``train.packing`` is on by default), preempted by SIGTERM after
    step 2 and resumed, ends with exactly the adapters of an uninterrupted run; the
    checkpoint holds the adapters and their optimizer state, not the base. The same run
    padded (``train.packing.enabled=false``) gives the same metrics and adapters within 1e-5
    (f32): every pass (reference, dropout-free behaviour, both epochs) sees the same
    dropout masks and per-sequence means packed or padded."""
    from _runs import assert_same_run, preempted_and_resumed

    from grpo.engine.runs.metrics import read_metrics
    from grpo.engine.trainer import Trainer

    straight = Trainer(load_config(TINY, PACKED_TWO), tmp_path / "straight")
    assert straight.frozen is not None
    base_before = [np.asarray(x).copy() for x in jax.tree.leaves(straight.frozen)]
    straight.run()
    for a, b in zip(base_before, jax.tree.leaves(straight.frozen)):
        np.testing.assert_array_equal(a, np.asarray(b))
    # The reference (beta > 0) read adapters of its own every step: zeros, never donated
    # (the trained adapters of each step are donated to the next update).
    assert jax.tree.structure(straight.ref_params) == jax.tree.structure(straight.params)
    for x in jax.tree.leaves(straight.ref_params):
        assert not x.is_deleted() and not np.any(np.asarray(x))
    rows = read_metrics(tmp_path / "straight")
    assert all(np.isfinite(r["loss"]) for r in rows)
    # A step whose rewards are all equal (and, at step 1, with no KL yet) has no gradient;
    # the run as a whole trains.
    assert any(r["grad_norm"] > 0 for r in rows)

    def only_adapters(first):
        saved = tmp_path / "resumed" / "checkpoints" / "2"
        names = json.dumps(json.loads((saved / "params" / "_METADATA").read_text()))
        assert "q_proj_a" in names and "embed" not in names and "attn_norm" not in names

    second = preempted_and_resumed(load_config(TINY, PACKED_TWO), tmp_path / "resumed", after=2,
                                   after_preempt=only_adapters)
    assert second.step == 3
    assert_same_run(straight, second)

    padded = Trainer(load_config(TINY, ["train.packing.enabled=false"]), tmp_path / "padded")
    padded.run()
    assert all(r["packing/bins_used"] < 16 for r in rows)  # 16 sequences, several to a bin
    for got, want in zip(rows, read_metrics(tmp_path / "padded"), strict=True):
        for key in ("reward/mean", "loss", "kl", "grad_norm", "ratio/mean", "clip_frac/low", "clip_frac/high",
                    "approx_kl", "mismatch/weight_mean", "logprob_gap/sampler_trainer"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=f"step {got['step']} {key}")
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(padded.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_merged_sampling_equals_sampling_through_the_adapters(lora_tiny):
    """``model.lora.sampler: merged`` decodes the merged projections with the adapter
    matmuls off; it samples what base + adapters sample."""
    from grpo.engine.rollout.sampler import Sampler, SamplingParams
    from grpo.models.lora import merge_into_state

    mesh, base, _, graphdef, adapters, frozen = lora_tiny
    adapters = _randomise(adapters, scale=0.2)
    sampling = SamplingParams(max_new_tokens=5, num_generations=2, temperature=1.0, eos_ids=(308,), pad_id=306,
                              early_stop_chunk=0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 300, (4, 6)).astype(np.int32)
    mask = np.ones((4, 6), np.int32)
    mask[1, :3] = 0
    unmerged = merge_params(adapters, frozen)
    merged = jax.jit(lambda a, f: merge_into_state(graphdef, a, f))(adapters, frozen)
    through = Sampler(graphdef, mesh=mesh, batch_axes=("fsdp",), sampling=sampling)
    off = Sampler(graphdef, mesh=mesh, batch_axes=("fsdp",), sampling=sampling, lora_adapters=False)
    a = through.generate(unmerged, prompts, mask, jax.random.key(1))
    m = off.generate(merged, prompts, mask, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(m.tokens), np.asarray(a.tokens))
    np.testing.assert_allclose(np.asarray(m.logprobs), np.asarray(a.logprobs), atol=2e-5)
    # The adapters matter: with them off, the unmerged state is the base model.
    b = off.generate(unmerged, prompts, mask, jax.random.key(1))
    assert not np.allclose(np.asarray(b.logprobs), np.asarray(a.logprobs), atol=1e-3)


@pytest.mark.slow
def test_lora_dropout_masks_are_shared_by_the_epochs_and_tis_sees_numerics_only(tmp_path):
    """LoRA with dropout 0.1, two PPO epochs and a vanishing learning rate, so every epoch
    runs at the parameters its old log-probs were taken at (the reference, beta > 0, is
    checked by the resume test above):

    - the ratio is exactly 1, nothing clips and approx_kl is exactly 0 (one dropout mask per
      row per step, shared by the epochs and the old log-probs; a mask per epoch made the
      ratio dropout noise);
    - the truncated-IS weight is the sampler/trainer mismatch of the dropout-free policy
      (the logged ``is_ratio``), not dropout noise;
    - a step whose epochs are all non-finite counts once, and the schedule's count (what
      the logged learning rate is read from) moves through it."""
    from grpo.engine.runs.metrics import read_metrics
    from grpo.engine.trainer import Trainer
    from grpo.engine.training.optim import learning_rate_schedule, schedule_count

    cfg = load_config(TINY, ["train.optimizer={learning_rate: 1.0e-30, warmup_steps: 1, schedule: linear}",
                             "loss.beta=0", "train.steps=2"])
    trainer = Trainer(cfg, tmp_path)
    # Non-zero B: at its zero init the adapters, and so their dropout, change nothing.
    noise = _randomise(jax.tree.map(jnp.zeros_like, trainer.params), scale=0.3, seed=5)
    trainer.params = jax.tree.map(lambda x, n: jax.device_put(x + n, x.sharding), trainer.params, noise)
    start = [np.asarray(x).copy() for x in jax.tree.leaves(trainer.params)]
    update, batches = trainer.update, []

    def nan_in_the_second_step(params, opt_state, ub, frozen):
        batches.append(ub)
        if trainer.step == 1:
            ub = ub._replace(advantages=ub.advantages * jnp.nan)
        return update(params, opt_state, ub, frozen)

    trainer.update = nan_in_the_second_step
    trainer.run()
    rows = read_metrics(tmp_path)
    for a, b in zip(start, jax.tree.leaves(trainer.params)):
        np.testing.assert_array_equal(a, np.asarray(b))  # the learning rate vanishes indeed
    for r in rows[:1]:
        assert r["ratio/mean"] == 1.0 and r["approx_kl"] == 0.0, r
        assert r["clip_frac/low"] == 0.0 and r["clip_frac/high"] == 0.0, r
        # The mismatch weight is the logged sampler/trainer ratio (dropout-free), ~1 on CPU.
        assert r["mismatch/weight_mean"] == pytest.approx(r["is_ratio/sampler_trainer/mean"], abs=1e-6), r
        assert abs(r["mismatch/weight_mean"] - 1.0) < 1e-4 and r["logprob_gap/sampler_trainer"] < 1e-4, r
    # Dropout matters at these adapters: a step's masks move the log-probs far more than
    # the numerics above (so a mask per epoch, or TIS under the masks, would show).
    ub = batches[0]
    assert ub.dropout_keys is not None and batches[1].dropout_keys is ub.dropout_keys
    masked = trainer.policy_logprobs(trainer.params, ub, trainer.frozen)
    free = trainer.policy_logprobs(trainer.params, ub._replace(dropout_keys=None), trainer.frozen)
    assert float(jnp.max(jnp.abs(masked - free) * ub.mask)) > 1e-2
    assert [r["skipped_nonfinite_steps"] for r in rows] == [0, 1]
    assert int(schedule_count(trainer.opt_state)) == 2 * 2
    schedule = learning_rate_schedule(cfg.train.optimizer, cfg.train.steps)
    assert [r["learning_rate"] for r in rows] == pytest.approx([float(schedule(s)) for s in range(2)], rel=1e-6)
