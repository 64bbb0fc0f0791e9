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


@functools.cache
def _rollout(compute_dtype: str):
    """A 16-row rollout (4 prompts x 4) of the tiny Qwen3-MoE, recording routing, with the
    sampler computing in ``compute_dtype`` (the weights are float32 either way)."""
    sampling = SamplingParams(max_new_tokens=N, num_generations=4, eos_ids=(308,), pad_id=306)
    graphdef, params, kwargs = engine_parts(checkpoint("qwen3moe_untied"), sampling)
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
