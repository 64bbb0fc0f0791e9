"""The engine core across a weight change (``train.async.on_weight_change``, issue 49
item 4): rows in flight when new weights arrive either go on over the KV cache the old
weights wrote (``continue``) or rebuild it under the new ones first (``reprefill``).

The independent reference is the plain model, no cache: a teacher-forced forward of
each finished row (prompt + completion) under the new weights. Under ``reprefill`` every
token drawn after the change carries exactly that log-prob (the row's cache is what the
new weights compute); under ``continue`` it does not (its cache mixes both policies)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _model_fixtures import engine_parts, left_padded
from grpo.core.contracts import Rows
from grpo.engine.rollout.continuous import ContinuousSampler
from grpo.engine.rollout.sampler import SamplingParams
from grpo.models.decoder import positions_from_mask
from grpo.models.tiny import write_tiny_checkpoint

ROWS, LP, N, T = 8, 6, 12, 0.8
SAMPLING = SamplingParams(max_new_tokens=N, num_generations=1, temperature=T, pad_id=306, early_stop_chunk=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), seed=0, tokenizer=False)
    graphdef, old, kwargs = engine_parts(directory, SAMPLING)
    new = jax.tree.map(lambda x: x * 1.5 if jnp.issubdtype(x.dtype, jnp.floating) else x, old)  # other weights
    engine = ContinuousSampler(graphdef, slots=8, page_size=4, chunk=2, backend="reference", **kwargs)
    tokens, mask = left_padded(np.random.default_rng(1).integers(2, LP + 1, size=ROWS), LP, seed=2)
    return graphdef, old, new, engine, tokens, mask, kwargs


def _run(engine, old, new, tokens, mask, on_weight_change):
    """Two chunks under ``old`` (version 0), the rest under ``new`` (version 1)."""
    engine.update_weights(old, 0)
    engine.begin(rows=ROWS, prompt_length=LP, key=jax.random.key(3), versions=True,
                 on_weight_change=on_weight_change)
    engine.submit(Rows(ids=np.arange(ROWS), prompt_tokens=tokens, prompt_mask=mask, keys=None))
    for _ in range(2):
        engine.step()
    engine.update_weights(new, 1)
    while not engine.step().idle:
        pass
    got = engine.read(range(ROWS))
    stats = engine.stats()
    engine.end()
    return got, stats


def _teacher_forced(graphdef, params, tokens, mask, got):
    """Each completion token's log-prob under ``params`` from one cache-free forward of
    prompt + completion (log_softmax(logits / T) at the token)."""
    model = nnx.merge(graphdef, params)
    seq = np.concatenate([tokens, got.tokens], axis=1)
    m = np.concatenate([mask, got.mask], axis=1)
    hidden, _ = model(jnp.asarray(seq), positions_from_mask(jnp.asarray(m)), jnp.asarray(m != 0))
    logp = jax.nn.log_softmax(model.logits(hidden) / T, axis=-1)  # B L V
    # Completion token i sits at LP + i and is predicted at LP + i - 1.
    pred = np.asarray(logp[:, LP - 1:LP + N - 1])
    return np.take_along_axis(pred, got.tokens[:, :, None], axis=2)[:, :, 0]


def test_reprefill_rebuilds_the_cache_under_the_new_weights(setup):
    graphdef, old, new, engine, tokens, mask, _ = setup
    re, stats = _run(engine, old, new, tokens, mask, "reprefill")
    after = (re.versions == 1) & (re.mask == 1)
    crossed = after.any(axis=1) & ((re.versions == 0) & (re.mask == 1)).any(axis=1)
    assert crossed.sum() >= 2, "the test needs rows in flight at the change"
    assert stats["refreshed_rows"] == crossed.sum() and stats["refreshed_tokens"] > 0
    ref_new = _teacher_forced(graphdef, new, tokens, mask, re)
    np.testing.assert_allclose(re.logprobs[after], ref_new[after], rtol=0, atol=2e-5)
    before = (re.versions == 0) & (re.mask == 1)
    np.testing.assert_allclose(re.logprobs[before], _teacher_forced(graphdef, old, tokens, mask, re)[before],
                               rtol=0, atol=2e-5)

    # continue: the same rows' later tokens read the old weights' cache, so they are not
    # the new policy's (the first token after the change differs by more than numerics).
    co, stats = _run(engine, old, new, tokens, mask, "continue")
    assert stats["refreshed_rows"] == 0
    np.testing.assert_array_equal(co.versions[:, :3], re.versions[:, :3])
    first = np.argmax(co.versions == 1, axis=1)  # each crossing row's first token under the new weights
    rows = np.flatnonzero(crossed & (co.versions == 1).any(axis=1))
    gap = np.abs(co.logprobs[rows, first[rows]] - _teacher_forced(graphdef, new, tokens, mask, co)[rows, first[rows]])
    assert gap.max() > 1e-3


def test_on_weight_change_is_checked():
    from grpo.core.config import load_config
    from grpo.core.errors import UserError

    with pytest.raises(UserError, match="on_weight_change=reprefill needs train.async.partial_rollouts"):
        load_config("configs/quickstart.yaml", overrides=["train.async.on_weight_change=reprefill"])


def test_a_session_snapshot_goes_on_in_a_new_engine_with_the_same_tokens(setup):
    """Issue 51 (in-flight rows kept across preemption), at the engine: two chunks under
    ``old``, then new weights arrive; the session is snapshot (host JSON and arrays, no
    KV cache) and restored into a new engine's fresh session, whose seated rows rebuild
    their cache under ``new`` and decode on. Under ``reprefill`` that is exactly what the
    uninterrupted session does at the change: the same tokens, log-probs and versions,
    and no token drawn twice."""
    graphdef, old, new, engine, tokens, mask, kwargs = setup
    ref, _ = _run(engine, old, new, tokens, mask, "reprefill")

    def begin(e):
        e.begin(rows=ROWS, prompt_length=LP, key=jax.random.key(3), versions=True, on_weight_change="reprefill")

    engine.update_weights(old, 0)
    begin(engine)
    engine.submit(Rows(ids=np.arange(ROWS), prompt_tokens=tokens, prompt_mask=mask, keys=None))
    for _ in range(2):
        engine.step()
    engine.update_weights(new, 1)
    meta, arrays = engine.snapshot()
    engine.end()
    assert len(meta["order"]) >= 2, "the test needs rows in flight at the snapshot"
    fresh = ContinuousSampler(graphdef, slots=8, page_size=4, chunk=2, backend="reference", **kwargs)
    fresh.update_weights(new, 1)
    begin(fresh)
    assert fresh.restore(meta, {k: np.array(v) for k, v in arrays.items()}) == len(meta["order"])
    while not fresh.step().idle:
        pass
    got, stats = fresh.read(range(ROWS)), fresh.stats()
    assert stats["refreshed_rows"] == len(meta["order"]) and fresh.regenerated_tokens() == 0
    fresh.end()
    for name in ("tokens", "mask", "logprobs", "lengths", "truncated", "versions"):
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=name)
    # A session of another shape refuses the snapshot (the partial stream names the fields).
    other = ContinuousSampler(graphdef, slots=4, page_size=4, chunk=2, backend="reference", **kwargs)
    begin(other)
    with pytest.raises(ValueError, match="saved session has 8 slots"):
        other.restore(meta, arrays)
