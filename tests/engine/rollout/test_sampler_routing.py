"""The static sampler records each completion token's routed experts (issue 54, item 3),
and the trainer's forward replays them: with equal numerics the recorded experts are the
trainer's own and its log-probs equal the sampler's; a bfloat16 sampler routes some tokens
differently from a float32 trainer, which replay then overrides."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _model_fixtures import checkpoint, engine_parts
from grpo.core.config import MoeConfig
from grpo.engine.rollout.sampler import Sampler, SamplingParams
from grpo.engine.training.routing import moe_call, routing_metrics
from grpo.engine.training.update import UpdateBatch, completion_hidden
from grpo.models.loading import load_hf

N = 6
pytestmark = pytest.mark.slow  # a rollout and trainer passes of a model: ~25 s alone, more on a shared machine


def static_sampling() -> SamplingParams:
    return SamplingParams(max_new_tokens=N, num_generations=4, eos_ids=(308,), pad_id=306)


@functools.cache
def _rollout(compute_dtype: str):
    """A 16-row rollout (4 prompts x 4) of the tiny Qwen3-MoE, recording routing, with the
    sampler computing in ``compute_dtype`` (the weights are float32 either way)."""
    graphdef, params, kwargs = engine_parts(checkpoint("qwen3moe_untied"), static_sampling())
    if compute_dtype != "float32":
        graphdef, _ = nnx.split(load_hf(checkpoint("qwen3moe_untied"), kwargs["mesh"], compute_dtype=compute_dtype))
    sampler = Sampler(graphdef, **kwargs)
    sampler.record_routing = True
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 300, (4, 5)).astype(np.int32)
    pmask = np.ones((4, 5), np.int32)
    pmask[1, :2] = 0
    out = sampler.generate(params, prompt, pmask, jax.random.key(1))
    return out, params, kwargs["mesh"]


@functools.partial(jax.jit, static_argnums=(0, 2))
def _trainer(graphdef, params, mode, ub):
    """The trainer's f32 forward over the rows: its log-probs [B, N] and routing metrics."""
    model = nnx.merge(graphdef, params)
    hidden, routing = completion_hidden(model, ub.prompt_tokens, ub.prompt_mask, ub.tokens, ub.mask,
                                        moe=moe_call(ub, packed=False, options=MoeConfig(router_replay=mode)))
    logp = jax.nn.log_softmax(model.logits(hidden), axis=-1)
    logp = jnp.take_along_axis(logp, ub.tokens[..., None], axis=-1)[..., 0]
    return logp, routing_metrics(routing, top_k=model.config.num_experts_per_tok, compared=True), routing.experts


def _trainer_pass(compute_dtype: str, mode: str):
    out, params, mesh = _rollout(compute_dtype)
    graphdef, _ = nnx.split(load_hf(checkpoint("qwen3moe_untied"), mesh))  # float32
    ub = UpdateBatch(prompt_tokens=out.prompt_tokens, prompt_mask=out.prompt_mask, tokens=out.tokens, mask=out.mask,
                     advantages=None, old_logprobs=None, ref_logprobs=None, routed_experts=out.routed_experts)
    return out, _trainer(graphdef, params, mode, ub)


def test_the_rollout_carries_compact_expert_ids_of_every_fed_token():
    out, _, _ = _rollout("float32")
    routed, lengths = np.asarray(out.routed_experts), np.asarray(out.lengths)
    assert routed.shape == (16, N, 2, 2) and routed.dtype == np.int16
    fed = np.arange(N)[None] < (lengths - 1)[:, None]  # the last token of a row is never fed
    assert (routed[fed] >= 0).all() and (routed[fed] < 8).all() and (routed[~fed] == -1).all()
    assert fed.sum() > 40
    assert (np.sort(routed[fed], axis=-1)[..., 0] != np.sort(routed[fed], axis=-1)[..., 1]).all()  # k distinct


def test_equal_numerics_the_trainer_routes_as_the_sampler_and_log_probs_match():
    """Issue 54 goal: with equal numerics the trainer's log-probs equal the sampler's
    within 1e-5 (with replay), and its own routing agrees everywhere."""
    out, (logp, metrics, _) = _trainer_pass("float32", "rollout")
    mask = np.asarray(out.mask) > 0
    assert np.abs(np.asarray(logp) - np.asarray(out.logprobs))[mask].max() <= 1e-5
    assert float(metrics["moe/routing_agreement"]) == 1.0


def test_a_bf16_sampler_routes_differently_and_replay_uses_its_experts():
    """Issue 54 goal: bf16 sampler, f32 trainer: moe/routing_agreement < 1 without replay;
    with replay the trainer's experts are the sampler's on every fed completion token."""
    out, (_, compare, own) = _trainer_pass("bfloat16", "compare")
    agreement = float(compare["moe/routing_agreement"])
    assert 0.5 < agreement < 1.0, agreement
    _, (_, _, used) = _trainer_pass("bfloat16", "rollout")
    lp = out.prompt_tokens.shape[1]
    routed = np.asarray(out.routed_experts)  # B N Ly k
    fed = routed[..., 0, 0] >= 0
    used = np.moveaxis(np.asarray(used), 0, 2)[:, lp:]  # Ly B S k -> B N Ly k
    own = np.moveaxis(np.asarray(own), 0, 2)[:, lp:]
    np.testing.assert_array_equal(used[fed], routed[fed])
    assert (own[fed] != routed[fed]).any()


def test_the_continuous_engine_records_the_static_engines_experts():
    """Issue 54: the continuous engine records each completion token's experts as the
    static one does (rows through a session, 4 slots for 16 rows, pages short enough to
    evict rows, which then feed their tokens again): the same tokens and expert ids,
    read row by row (``read``: what partial rollouts keep) and as the rollout
    (``outputs``); the trainer's replayed forward over them is the one over the static
    rows. ~15 s beside the module's static rollout."""
    from grpo.core.contracts.engine import Rows
    from grpo.engine.rollout.continuous import ContinuousSampler

    static, params, mesh = _rollout("float32")
    graphdef, _, kwargs = engine_parts(checkpoint("qwen3moe_untied"), static_sampling())
    engine = ContinuousSampler(graphdef, slots=4, page_size=4, pool_pages=4, chunk=2, backend="reference", **kwargs)
    engine.record_routing = True
    engine.update_weights(params)
    prompts, pmask = np.asarray(static.prompt_tokens), np.asarray(static.prompt_mask)  # P*K rows, left-aligned
    engine.begin(rows=16, prompt_length=prompts.shape[1], key=jax.random.key(1))
    engine.submit(Rows(ids=np.arange(16), prompt_tokens=prompts, prompt_mask=pmask, keys=None))
    read = {}
    while not (progress := engine.step()).idle:
        got = engine.read(sorted(progress.finished))
        read.update({int(r): got.routed_experts[i] for i, r in enumerate(got.ids)})
    assert engine.stats()["evictions"] > 0, engine.stats()
    out = engine.outputs()
    engine.end()
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(static.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(static.logprobs), rtol=0, atol=1e-5)
    want = np.asarray(static.routed_experts)
    np.testing.assert_array_equal(np.asarray(out.routed_experts), want)
    np.testing.assert_array_equal(np.stack([read[r] for r in range(16)]), want)
    assert out.routed_experts.dtype == jnp.int16 and (want >= 0).sum() > 100
    ub = lambda o: UpdateBatch(prompt_tokens=o.prompt_tokens, prompt_mask=o.prompt_mask, tokens=o.tokens,  # noqa: E731
                               mask=o.mask, advantages=None, old_logprobs=None, ref_logprobs=None,
                               routed_experts=o.routed_experts)
    f32, _ = nnx.split(load_hf(checkpoint("qwen3moe_untied"), mesh))
    (a, ma, _), (b, mb, _) = (_trainer(f32, params, "rollout", ub(o)) for o in (out, static))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(ma["moe/routing_agreement"]) == float(mb["moe/routing_agreement"]) == 1.0
