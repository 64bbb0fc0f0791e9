"""Sampling semantics on crafted logits: temperature, top-k, top-p, greedy, per-row keys."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo.engine.rollout._sampling import (
    filter_threshold,
    sample_tokens,
    step_keys,
    truncated_logprobs,
)
from grpo.engine.rollout.decoding import effective_chunk, row_keys, segment_plan
from grpo.engine.rollout.sampler import SamplingParams

ROWS = 20000  # same logits in every row: empirical frequencies vs the intended distribution


@functools.partial(jax.jit, static_argnames=("kw",))
def _sample_rows(logits, rng, step, *, kw):
    """Every row of ``logits`` [B, V] draws with its own key for ``step``."""
    return sample_tokens(logits, step_keys(row_keys(rng, logits.shape[0]), step), **dict(kw))


def _draw(logits_1d, **kw):
    logits = jnp.broadcast_to(jnp.asarray(logits_1d, jnp.float32), (ROWS, len(logits_1d)))
    toks, lps, _ = _sample_rows(logits, jax.random.key(0), 3, kw=tuple(sorted(kw.items())))
    return np.asarray(toks), np.asarray(lps)


def _freqs(toks, V):
    return np.bincount(toks, minlength=V) / len(toks)


def _softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - (np.max(x) + np.log(np.exp(x - np.max(x)).sum()))


LOGITS = np.array([2.0, 1.0, 0.0, -1.0])
PROBS = np.log(np.array([0.5, 0.3, 0.15, 0.05]))  # logits whose softmax is exactly these


def test_temperature_divides_logits():
    toks, lps = _draw(LOGITS, temperature=2.0)
    target = _softmax(LOGITS / 2.0)
    assert not np.allclose(target, _softmax(LOGITS), atol=0.05)  # the test can tell T from no T
    np.testing.assert_allclose(_freqs(toks, 4), target, atol=0.015)
    np.testing.assert_allclose(lps, _log_softmax(LOGITS / 2.0)[toks], atol=1e-5)


def test_top_k_restricts_draws_but_not_logprobs():
    toks, lps = _draw(LOGITS, temperature=0.5, top_k=2)
    f = _freqs(toks, 4)
    assert f[2] == 0 and f[3] == 0
    kept = _softmax(LOGITS[:2] / 0.5)
    np.testing.assert_allclose(f[:2], kept, atol=0.015)
    # Reported log-probs are under the full temperature-scaled distribution.
    np.testing.assert_allclose(lps, _log_softmax(LOGITS / 0.5)[toks], atol=1e-5)
    assert not np.allclose(lps, np.log(kept)[toks], atol=1e-3)


@pytest.mark.parametrize("top_p, kept", [(0.75, 2), (0.4, 1)])  # 0.82 keeps 3: below
def test_top_p_keeps_smallest_nucleus(top_p, kept):
    toks, lps = _draw(PROBS, top_p=top_p)
    f = _freqs(toks, 4)
    assert np.all(f[kept:] == 0), f
    p = np.array([0.5, 0.3, 0.15, 0.05])[:kept]
    np.testing.assert_allclose(f[:kept], p / p.sum(), atol=0.015)
    np.testing.assert_allclose(lps, np.log([0.5, 0.3, 0.15, 0.05])[toks], atol=1e-5)


def test_top_p_applies_after_top_k():
    # top-p alone at 0.82 keeps 3 tokens (mass before the third: 0.80); after top-k=3 the
    # survivors renormalise to [.526, .316, .158] and the mass before the third is 0.84.
    alone, _ = _draw(PROBS, top_p=0.82)
    assert set(np.unique(alone)) == {0, 1, 2}
    both, _ = _draw(PROBS, top_k=3, top_p=0.82)
    assert set(np.unique(both)) == {0, 1}


def test_behaviour_logprobs_are_under_the_truncated_distribution():
    """The behaviour log-prob of a drawn token is its log-prob under the distribution that
    drew it (top-k then top-p at the temperature, renormalised over the kept tokens), by a
    numpy reference; without a filter it is the full-vocabulary array itself."""
    logits = np.random.default_rng(0).normal(size=(64, 11)).astype(np.float32)
    keys = row_keys(jax.random.key(5), 64)
    for kw in ({"top_p": 0.5}, {"top_k": 4}, {"top_k": 6, "top_p": 0.7}):
        toks, full, behaviour = jax.jit(lambda x: sample_tokens(x, keys, temperature=1.3, **kw))(logits)
        toks = np.asarray(toks)
        for row, tok, f, b in zip(logits, toks, np.asarray(full), np.asarray(behaviour)):
            scaled = row.astype(np.float64) / 1.3
            order = np.argsort(-scaled)
            kept = order[: kw.get("top_k", len(row))]
            p = _softmax(scaled[kept])
            n = int(np.sum(np.cumsum(p) - p < kw.get("top_p", 1.0)))  # the smallest nucleus
            kept = kept[: max(n, 1)]
            assert tok in kept
            np.testing.assert_allclose(f, _log_softmax(scaled)[tok], atol=1e-5)
            np.testing.assert_allclose(b, _log_softmax(scaled[kept])[list(kept).index(tok)], atol=1e-5)
        assert np.all(np.asarray(behaviour) > np.asarray(full) + 1e-3)  # the kept mass was < 1 in every row
    # No filter (or greedy): the full-vocabulary log-probs are the behaviour ones, one array.
    for kw in ({}, {"greedy": True, "top_p": 0.5}):
        _, full, behaviour = sample_tokens(jnp.asarray(logits), keys, **kw)
        assert behaviour is full


def _np_kept(scaled, *, top_k=0, top_p=1.0):
    """The sampler's kept set by the numpy reference: top-k, then the smallest nucleus of
    the renormalised survivors reaching top_p (at least one token), ties at the boundary kept."""
    order = np.argsort(-scaled, kind="stable")  # 0 / 1.0: off
    kept = order[: top_k or len(scaled)]
    p = _softmax(scaled[kept])
    n = max(int(np.sum(np.cumsum(p) - p < top_p)), 1)
    return np.flatnonzero(scaled >= scaled[kept[n - 1]])


@pytest.mark.parametrize("kw", [{"top_k": 3}, {"top_p": 0.8}, {"top_k": 5, "top_p": 0.6}, {"top_p": 0.9}],
                         ids=["top_k", "top_p", "both", "top_p_0.9"])
def test_truncated_logprobs_are_the_behaviour_logprobs(kw):
    """Issue 49 item 5: the trainer's truncated log-prob (``loss.truncated_policy``) of a
    token, on [B, T, V] logits at a temperature, is by a numpy reference its log-prob
    renormalised over the sampler's kept set, and equals the behaviour log-prob
    ``sample_tokens`` reports for the tokens it draws from the same logits. A target
    outside the kept set is flagged and renormalised over the kept set plus itself."""
    kw = {"top_k": 0, "top_p": 1.0, **kw}
    temperature = 0.7
    logits = np.random.default_rng(1).normal(size=(4, 8, 13)).astype(np.float32) * 2
    scaled = logits / np.float32(temperature)
    # Every token of the vocabulary as a target, at every position: kept ones and not.
    targets = np.broadcast_to(np.arange(13), (4, 8, 13))
    for v in range(13):
        logp, outside = jax.jit(lambda x, t: truncated_logprobs(x, t, **kw))(scaled, targets[..., v])
        for b in range(4):
            for t in range(8):
                row = scaled[b, t].astype(np.float64)
                kept = _np_kept(row, **kw)
                support = kept if v in kept else np.append(kept, v)
                want = row[v] - np.log(np.exp(row[support] - row.max()).sum()) - row.max()
                np.testing.assert_allclose(float(logp[b, t]), want, atol=2e-5)
                assert bool(outside[b, t]) == (v not in kept)
    # The sampler's behaviour log-probs of what it draws from these logits are the same numbers.
    flat = jnp.asarray(logits.reshape(32, 13))
    toks, full, behaviour = sample_tokens(flat, row_keys(jax.random.key(3), 32), temperature=temperature, **kw)
    mine, outside = truncated_logprobs(flat / temperature, toks, **kw)
    np.testing.assert_allclose(np.asarray(mine), np.asarray(behaviour), atol=1e-6)
    assert not np.any(np.asarray(outside))
    assert np.all(np.asarray(behaviour) > np.asarray(full) + 1e-3)  # the test can tell the two apart
    # Differentiable, and finite even for the outside targets.
    grad = jax.grad(lambda x: truncated_logprobs(x, jnp.asarray(targets[..., 12]), **kw)[0].sum())(jnp.asarray(scaled))
    assert np.all(np.isfinite(np.asarray(grad)))


def test_truncated_logprobs_without_a_filter_are_the_full_ones():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 9)), jnp.float32)
    t = jnp.asarray([0, 4, 8])
    for kw in ({"top_k": 0, "top_p": 1.0}, {"top_k": 9, "top_p": 1.0}):  # top-k >= V is off
        logp, outside = truncated_logprobs(x, t, **kw)
        np.testing.assert_allclose(np.asarray(logp), np.asarray(jax.nn.log_softmax(x))[np.arange(3), t], atol=1e-6)
        assert not np.any(np.asarray(outside))


def test_filter_threshold_off_and_ties():
    x = jnp.asarray([[3.0, 1.0, 1.0, 0.0]])
    assert filter_threshold(x, top_k=0, top_p=1.0) is None
    assert filter_threshold(x, top_k=4, top_p=1.0) is None  # k >= V is off
    # Tokens tied with the k-th value stay drawable.
    assert float(filter_threshold(x, top_k=2, top_p=1.0)[0]) == 1.0


def test_greedy_is_argmax_and_ignores_keys():
    logits = np.random.default_rng(1).normal(size=(64, 50)).astype(np.float32)
    kw = (("greedy", True), ("temperature", 0.7), ("top_k", 5))
    toks, lps, _ = _sample_rows(logits, jax.random.key(2), 0, kw=kw)
    np.testing.assert_array_equal(np.asarray(toks), np.argmax(logits, axis=-1))
    ref = np.stack([_log_softmax(row / 0.7) for row in logits])[np.arange(64), np.asarray(toks)]
    np.testing.assert_allclose(np.asarray(lps), ref, atol=1e-5)
    toks2, *_ = _sample_rows(logits, jax.random.key(3), 0, kw=kw)
    np.testing.assert_array_equal(np.asarray(toks), np.asarray(toks2))


def test_plain_sampling_and_per_row_keys():
    rng = jax.random.key(7)
    few, many = row_keys(rng, 5), row_keys(rng, ROWS)
    np.testing.assert_array_equal(jax.random.key_data(few), jax.random.key_data(many[:5]))
    np.testing.assert_array_equal(jax.random.key_data(many[3]), jax.random.key_data(jax.random.fold_in(rng, 3)))
    logits = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (ROWS, 4))
    t_many, *_ = _sample_rows(logits, rng, 4, kw=())
    np.testing.assert_allclose(_freqs(np.asarray(t_many), 4), _softmax(LOGITS), atol=0.015)
    # A row's draw depends on its global index and the step only, not on the batch.
    t_few, *_ = _sample_rows(logits[:5], rng, 4, kw=())
    np.testing.assert_array_equal(np.asarray(t_many[:5]), np.asarray(t_few))
    t_next, *_ = _sample_rows(logits, rng, 5, kw=())
    assert np.mean(np.asarray(t_next) == np.asarray(t_many)) < 0.6  # steps draw afresh (~0.46 by chance)


def test_raw_keys_work_too():
    keys = row_keys(jax.random.PRNGKey(0), 4)
    assert keys.shape == (4, 2) and keys.dtype == jnp.uint32
    np.testing.assert_array_equal(keys[1], jax.random.fold_in(jax.random.PRNGKey(0), 1))


def test_sampling_params_validation():
    assert SamplingParams(max_new_tokens=4, eos_ids=[5, 3, 5]).eos_ids == (3, 5)
    assert SamplingParams(max_new_tokens=4, eos_ids=7).eos_ids == (7,)
    for bad in (dict(max_new_tokens=0), dict(max_new_tokens=4, temperature=0.0), dict(max_new_tokens=4, top_p=0.0),
                dict(max_new_tokens=4, top_p=1.5), dict(max_new_tokens=4, top_k=-1),
                dict(max_new_tokens=4, num_generations=0), dict(max_new_tokens=4, early_stop_chunk=-1)):
        with pytest.raises(ValueError, match="Invalid SamplingParams"):
            SamplingParams(**bad)


def test_segment_plan():
    assert segment_plan(1, early_stop_chunk=4, kv_segment=4) == ()
    assert segment_plan(8, early_stop_chunk=0, kv_segment=0) == ((0, 7),)
    # Steps rounded up to whole chunks; segments to whole chunks too.
    assert segment_plan(12, early_stop_chunk=4, kv_segment=4) == ((0, 4), (4, 8), (8, 12))
    assert segment_plan(8, early_stop_chunk=3, kv_segment=4) == ((0, 6), (6, 9))
    assert segment_plan(1024, early_stop_chunk=32, kv_segment=256) == ((0, 256), (256, 512), (512, 768), (768, 1024))
    assert segment_plan(1024, early_stop_chunk=0, kv_segment=256)[-1] == (768, 1023)
    # A chunk longer than the decode is capped at it (no wasted steps).
    assert effective_chunk(8, 32) == 7 and segment_plan(8, early_stop_chunk=32, kv_segment=256) == ((0, 7),)
