"""The static engine through the engine contract (begin/submit/step/read/outputs): rows
submitted in any order and batching draw what ``Sampler.generate`` draws for the same
key, each token carries the version of the weights that drew it, and one feeder written
against the contract gives the same rows on the static and the continuous engines."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from _model_fixtures import engine_parts, left_padded
from grpo.core.contracts import RolloutEngine, Rows
from grpo.engine.rollout.continuous import ContinuousSampler
from grpo.engine.rollout.sampler import Sampler, SamplingParams
from grpo.models.tiny import write_tiny_checkpoint

P, LP, K, N = 6, 8, 2, 8
LENGTHS = np.array([8, 5, 3, 1, 7, 4])
SAMPLING = SamplingParams(max_new_tokens=N, num_generations=K, temperature=0.7, top_k=50, top_p=0.9,
                          eos_ids=tuple(range(0, 320, 9)), pad_id=306, early_stop_chunk=4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), seed=0, tokenizer=False)
    graphdef, params, kwargs = engine_parts(directory, SAMPLING)
    tokens, mask = left_padded(LENGTHS, LP, seed=0)
    static = Sampler(graphdef, **kwargs)
    reference = jax.device_get(static.generate(params, tokens, mask, jax.random.key(42)))
    return graphdef, params, kwargs, tokens, mask, static, reference


def _rows(tokens, mask, ids):
    """Rows ``ids`` of the P*K rollout (row b*K + j: sample j of prompt b)."""
    ids = np.asarray(ids)
    return Rows(ids=ids, prompt_tokens=tokens[ids // K], prompt_mask=mask[ids // K], keys=None)


def roll(engine: RolloutEngine, params, tokens, mask, key, *, batches, versions):
    """A feeder over the contract alone: ``batches`` of row ids submitted in turn, the
    weights handed over at ``versions[i]`` before batch i, stepped until idle."""
    engine.update_weights(params, versions[0])
    engine.begin(rows=P * K, prompt_length=LP, key=key, versions=True)
    finished = []
    for ids, version in zip(batches, versions):
        engine.update_weights(params, version)
        engine.submit(_rows(tokens, mask, ids))
        while True:
            progress = engine.step()
            if progress.idle:
                break
            finished.extend(progress.finished)
    assert engine.in_flight() == 0
    got = engine.read(sorted(finished))
    out = jax.device_get(engine.outputs())
    engine.end()
    return sorted(finished), got, out


BATCHES = [np.array([11, 3, 4, 0, 7]), np.array([1, 2, 5, 6, 8, 9, 10])]


def _same_rows(out, reference):
    for name in ("prompt_tokens", "prompt_mask", "tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(out, name), getattr(reference, name), err_msg=name)
    np.testing.assert_allclose(out.logprobs, reference.logprobs, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out.behaviour_logprobs, reference.behaviour_logprobs, rtol=0, atol=1e-5)


def test_static_rows_in_any_order_draw_what_generate_draws(setup):
    graphdef, params, kwargs, tokens, mask, static, reference = setup
    finished, got, out = roll(static, params, tokens, mask, jax.random.key(42), batches=BATCHES, versions=[3, 5])
    assert finished == list(range(P * K))
    _same_rows(out, reference)
    # read() is the same rows on the host; each token carries the version that drew it.
    np.testing.assert_array_equal(got.tokens, out.tokens)
    np.testing.assert_array_equal(got.lengths, out.lengths)
    first = np.isin(np.arange(P * K), BATCHES[0])
    expect = np.where(out.mask == 1, np.where(first, 3, 5)[:, None], -1)
    np.testing.assert_array_equal(got.versions, expect)
    assert (got.versions >= 0).sum() == out.mask.sum() > 0


def test_one_feeder_gives_the_same_rows_on_both_engines(setup):
    graphdef, params, kwargs, tokens, mask, static, reference = setup
    continuous = ContinuousSampler(graphdef, slots=8, page_size=4, chunk=2, backend="reference", **kwargs)
    _, got, out = roll(continuous, params, tokens, mask, jax.random.key(42), batches=BATCHES, versions=[3, 3])
    _same_rows(out, reference)
    assert set(np.unique(got.versions)) == {-1, 3}


def test_static_rows_own_keys_abort_and_idle(setup):
    graphdef, params, kwargs, tokens, mask, static, reference = setup
    key = jax.random.key(42)
    own = jax.vmap(lambda r: jax.random.fold_in(key, r))(np.arange(P * K, dtype=np.uint32))
    static.update_weights(params, 0)
    static.begin(rows=P * K, prompt_length=LP)  # no session key: rows bring their own
    assert static.step().idle
    rows = _rows(tokens, mask, np.arange(P * K))
    static.submit(Rows(ids=rows.ids, prompt_tokens=rows.prompt_tokens, prompt_mask=rows.prompt_mask,
                       keys=own))
    static.abort([0, 5])
    assert static.in_flight() == P * K - 2
    progress = static.step()
    assert sorted(progress.finished) == [r for r in range(P * K) if r not in (0, 5)]
    out = jax.device_get(static.outputs())
    kept = np.setdiff1d(np.arange(P * K), [0, 5])
    np.testing.assert_array_equal(out.tokens[kept], reference.tokens[kept])
    assert out.mask[[0, 5]].sum() == 0  # aborted: never rolled out
    with pytest.raises(ValueError, match="row ids"):
        static.submit(Rows(ids=np.array([P * K]), prompt_tokens=tokens[:1], prompt_mask=mask[:1], keys=None))
    static.end()
    with pytest.raises(RuntimeError, match="begin"):
        static.step()
