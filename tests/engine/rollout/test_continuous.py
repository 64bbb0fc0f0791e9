"""The continuous-batching sampler against the static one on a tiny Qwen2 over 8 CPU
devices: for the same key, the same tokens (and log-probs within 1e-5, f32) whatever
slot a row ran in, with rows refilled at chunk boundaries and evicted when the page pool
runs short."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from grpo.core.contracts import MeshLayout, NoOptions
from grpo.engine.parallel.mesh import build_mesh
from grpo.engine.rollout.continuous import ContinuousSampler, shared_prompts
from grpo.engine.rollout.sampler import Sampler, SamplingParams
from grpo.models.loading import load_hf
from grpo.models.tiny import write_tiny_checkpoint
from grpo.plugins.rollout import LegacyStyle

P, LP, K, N = 12, 8, 2, 8
LENGTHS = np.array([8, 5, 3, 1, 2, 7, 8, 4, 6, 1, 3, 8])
SAMPLING = SamplingParams(max_new_tokens=N, num_generations=K, temperature=0.7, top_k=50, top_p=0.9,
                          eos_ids=tuple(range(0, 320, 9)), pad_id=306, early_stop_chunk=4)  # ~1 in 9 tokens stops


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), seed=0, tokenizer=False)
    layout = MeshLayout(dp=1, fsdp=8, tp=1)
    mesh = build_mesh(layout)
    graphdef, params = nnx.split(load_hf(directory, mesh))
    kwargs = dict(mesh=mesh, batch_axes=LegacyStyle().batch_axes(layout, NoOptions()), sampling=SAMPLING)
    rs = np.random.default_rng(0)
    mask = (np.arange(LP)[None, :] >= LP - LENGTHS[:, None]).astype(np.int32)
    tokens = np.where(mask == 1, rs.integers(0, 256, size=(P, LP)), 306).astype(np.int32)
    return graphdef, params, kwargs, tokens, mask


def _np(out):
    return type(out)(*(None if x is None else np.asarray(x) for x in out))


@pytest.fixture(scope="module")
def static(setup):
    graphdef, params, kwargs, tokens, mask = setup
    return _np(Sampler(graphdef, **kwargs).generate(params, tokens, mask, jax.random.key(42)))


def _assert_same(out, static):
    for name in ("prompt_tokens", "prompt_mask", "tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(out, name), getattr(static, name), err_msg=name)
    np.testing.assert_allclose(out.logprobs, static.logprobs, rtol=0, atol=1e-5)
    # top-k/top-p: the behaviour policy's (truncated, renormalised) log-probs too, above the full ones
    assert static.behaviour_logprobs is not None
    np.testing.assert_allclose(out.behaviour_logprobs, static.behaviour_logprobs, rtol=0, atol=1e-5)
    assert np.all(out.behaviour_logprobs >= out.logprobs - 1e-6)


def test_continuous_equals_static(setup, static):
    graphdef, params, kwargs, tokens, mask = setup
    key = jax.random.key(42)
    # 16 slots for 24 rows, 2 per device (the pool in 8 parts of 5 pages), chunks of 2
    # steps, pages of 4 tokens: a row at the cap takes 4 pages, so a device's part holds
    # one such row; rows are refilled and evicted.
    cont = ContinuousSampler(graphdef, slots=16, page_size=4, pool_pages=5, chunk=2, backend="reference", **kwargs)
    assert cont.shards(16) == 8
    out = _np(cont.generate(params, tokens, mask, key))
    stats = cont.last_stats
    assert stats["pool_pages"] == 40 and stats["prefills"] >= 3 and stats["evictions"] > 0, stats
    _assert_same(out, static)
    # The host scheduler alone, fed the rows' lengths, replays the rollout's schedule.
    assert cont.simulate(prompt_lengths=np.repeat(LENGTHS, K), completions=out.lengths, prompt_length=LP) == stats
    # Each device reads and writes its own 5 pages: the whole 40-page pool never appears in
    # the compiled decode (no gather of the pool onto a device).
    hlo = cont.lowerings(params, prompts=P, prompt_length=LP, key=key)["decode"]().compile().as_text()
    assert "f32[2,2,5,4,16]" in hlo and "[2,2,40,4,16]" not in hlo
    # Rows stop at different steps.
    assert 0 < static.lengths.min() and static.truncated.any() and not static.truncated.all()


@pytest.mark.slow
def test_default_options_equal_static(setup, static):
    """Issue 49 item 7: the engine as a config builds it by default (``slots: auto``, pages
    of 16, chunks of 16, the pool for every slot) draws the static engine's tokens in f32;
    ``auto`` seats all 24 rows at once and their 12 prompts are prefilled once each."""
    graphdef, params, kwargs, tokens, mask = setup
    cont = ContinuousSampler(graphdef, slots="auto", backend="reference", **kwargs)
    out = _np(cont.generate(params, tokens, mask, jax.random.key(42)))
    assert cont.last_stats["slots"] == P * K and cont.last_stats["prefills"] == 1, cont.last_stats
    _assert_same(out, static)


def test_shared_prompts():
    """Rows with equal prompt tokens and mask share one prefill (a group's K samples);
    a different mask is a different prompt (issue 49 item 7)."""
    tokens = np.array([[0, 5, 6], [0, 5, 6], [0, 7, 6], [0, 5, 6], [9, 5, 6]], np.int32)
    mask = np.array([[0, 1, 1], [0, 1, 1], [0, 1, 1], [0, 1, 1], [1, 1, 1]], np.int32)
    firsts, src = shared_prompts(tokens, mask, np.array([3, 2, 1, 4, 0]))
    np.testing.assert_array_equal(firsts, [3, 2, 4])
    np.testing.assert_array_equal(src, [0, 1, 0, 2, 0])
    np.testing.assert_array_equal(tokens[firsts][src], tokens[[3, 2, 1, 4, 0]])


@pytest.mark.slow
def test_serving_layout_samples_what_static_legacy_samples(setup, static):
    """The continuous sampler in the serving layout (tp=2: KV heads and the pool split over
    tp, weights resharded) gives the static legacy rollout's samples."""
    from grpo.engine.rollout.layout import RolloutPlacement
    from grpo.plugins.rollout import serving_layout

    graphdef, params, kwargs, tokens, mask = setup
    placement = RolloutPlacement.of_layout(kwargs["mesh"], serving_layout(8, 2, kv_heads=2))
    served = placement.reshard_jit(params)(params)
    cont = ContinuousSampler(graphdef, mesh=placement.mesh, batch_axes=placement.batch_axes, sampling=SAMPLING,
                             activation_rules=placement.activation_rules, cache_rules=placement.cache_rules,
                             slots=8, page_size=4, chunk=4, backend="reference")
    out = cont.generate(served, tokens, mask, jax.random.key(42))
    # The pool's KV heads over tp, its pages over the 4 devices along the rows' axes.
    assert cont._abstract_pool(served, 8, 8).sharding.spec[1] == "tp" and cont.shards(8) == 4
    _assert_same(_np(out), static)
