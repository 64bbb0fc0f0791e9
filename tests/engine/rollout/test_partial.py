"""Partial rollouts (grpo/engine/rollout/partial.py): the version bookkeeping and the
ledger by hand; end to end on 8 CPU devices: max_staleness 0 equals the synchronous
continuous run, rows cross weight changes with two versions, and a preempted run resumes
with no group lost or trained twice."""

from __future__ import annotations

import numpy as np
import pytest

from _glossary import assert_glossary
from _runs import _config, preempted_and_resumed

from grpo.engine.rollout.paged.core import mark_versions
from grpo.engine.rollout.partial import Ledger, oldest_versions, token_staleness
from grpo.engine.runs.metrics import read_metrics
from grpo.engine.trainer import Trainer

# ------------------------------------------------------------------ by hand


def test_token_versions_on_a_tiny_schedule():
    """Two rows, N = 5. Call 1 at version 3: row 0 admitted, draws 2 tokens by the
    boundary where the call stops; row 1 draws 5 (done). Call 2 at version 4: row 0 goes
    on to 4 tokens and stops. Row 0 crossed the weight change: versions 3,3,4,4."""
    versions, marks = np.full((2, 5), -1, np.int64), np.zeros(2, np.int64)
    mark_versions(versions, marks, rows=np.array([0, 1]), drawn=np.array([1, 3]), version=3)  # a boundary
    mark_versions(versions, marks, rows=np.array([0, 1]), drawn=np.array([2, 5]), version=3)  # the call stops
    mark_versions(versions, marks, rows=np.array([0]), drawn=np.array([4]), version=4)
    np.testing.assert_array_equal(versions, [[3, 3, 4, 4, -1], [3, 3, 3, 3, 3]])
    np.testing.assert_array_equal(oldest_versions(versions), [3, 3])
    # Trained at step 5: staleness 2,2,1,1 | 2 x5 over 9 tokens.
    got = token_staleness(step=5, versions=versions)
    assert got["async/token_staleness_max"] == 2
    assert got["async/token_staleness_mean"] == pytest.approx((2 + 2 + 1 + 1 + 2 * 5) / 9)
    assert got["async/token_staleness_hist/1"] == pytest.approx(2 / 9)
    assert got["async/token_staleness_hist/2"] == pytest.approx(7 / 9)
    assert got["async/older_version_token_frac"] == pytest.approx(2 / 9)  # row 0's first two
    assert got["async/crossed_rows"] == 1


def test_the_ledger_keeps_out_of_order_groups():
    ledger = Ledger()
    assert ledger.record([0, 2, 3]) == 1 and ledger.ahead == {2, 3}
    resumed = Ledger(ledger.frontier, sorted(ledger.ahead))
    feed = resumed.untrained()
    assert [next(feed) for _ in range(3)] == [1, 4, 5]  # 2 and 3 are not fed again
    assert resumed.record([1]) == 4 and resumed.ahead == set()
    with pytest.raises(RuntimeError, match="trained twice"):
        resumed.record([2])


def test_partial_rollouts_config_errors():
    from grpo.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.async.partial_rollouts=true needs rollout.engine: continuous"):
        _config(**{"train.async": {"enabled": True, "partial_rollouts": True}})
    with pytest.raises(ConfigError, match=r"partial_rollouts=true needs train.async.enabled"):
        _config(**{"train.async": {"partial_rollouts": True}, "rollout.engine": "continuous"})


# ------------------------------------------------------------------ end to end


CONTINUOUS = {"rollout.engine": "continuous", "rollout.continuous": {"chunk": 2, "page_size": 8},
              "rollout.max_new_tokens": 6}


@pytest.mark.slow
def test_staleness_zero_equals_the_synchronous_continuous_run(tmp_path):
    """Each batch of a max_staleness 0 run equals the synchronous continuous step's rollout
    (StepCollector.collect: the same sampler, weights, step and data position): the same
    tokens, log-probs and rewards, so the update, the same code, sees the same batch."""
    trainer = Trainer(_config(**{**CONTINUOUS, "train.steps": 2, "train.async": {
        "enabled": True, "max_staleness": 0, "partial_rollouts": True}}), tmp_path)
    partial, compared = trainer.loop.source.partial, []
    draw = partial.draw

    def draw_and_compare(*, step, version, sample_group):
        rollout, versions, positions = draw(step=step, version=version, sample_group=sample_group)
        # The same engine, holding the same synced weights (update_weights).
        sync = trainer.collector.collect(step=step, position=step * 8, sample_group=False)
        for name in ("tokens", "mask", "lengths", "truncated", "prompt_tokens", "prompt_mask"):
            np.testing.assert_array_equal(np.asarray(getattr(rollout.output, name)), np.asarray(getattr(sync.output, name)))
        np.testing.assert_allclose(np.asarray(rollout.output.logprobs), np.asarray(sync.output.logprobs), atol=1e-6)
        np.testing.assert_array_equal(np.asarray(rollout.rewards), np.asarray(sync.rewards))
        np.testing.assert_array_equal(versions[np.asarray(sync.output.mask) > 0], version)  # one version a batch
        compared.append(positions)
        return rollout, versions, positions

    partial.draw = draw_and_compare
    trainer.run()
    assert compared == [list(range(s * 8, s * 8 + 8)) for s in range(2)]
    rows = read_metrics(trainer.run_dir)
    assert {r["async/token_staleness_max"] for r in rows} == {0} and {r["async/crossed_rows"] for r in rows} == {0}
    assert {r["partial/in_flight_rows"] for r in rows} == {0} and {r["async/refused_groups"] for r in rows} == {0}
    assert [r["async/data_position"] for r in rows] == [0, 8] and trainer.data_position == 16


@pytest.mark.slow
def test_a_preempted_partial_run_crosses_updates_and_resumes_without_loss(tmp_path):
    """max_staleness 2 with a 2-step chunk and 6-token rows: rows go on across weight
    changes. SIGTERM after step 4 of 5: every group trained once, and the trained ones
    with those still in flight at the end are the data order's first positions."""
    steps = 5
    config = _config(**{**CONTINUOUS, "train.steps": steps, "checkpoint.at_end": True, "rollout.continuous": {
        "chunk": 2, "page_size": 8, "slots": 8}, "train.async": {"enabled": True, "max_staleness": 2,
                                                                 "partial_rollouts": True}})
    first: list = []
    resumed = preempted_and_resumed(config, tmp_path, after=4, after_preempt=first.append)
    a, b = first[0].loop.source.partial, resumed.loop.source.partial
    trained = [p for batch in a.trained_log + b.trained_log for p in batch]
    assert len(a.trained_log) == 4 and len(b.trained_log) == steps - 4
    assert len(trained) == len(set(trained)) == steps * 8  # none trained twice
    stream = b.stream
    pending = set(stream.groups) | {e.positions[i] for e in resumed.loop.buffer for i in range(len(e.positions))}
    assert not pending & set(trained)
    everything = set(trained) | pending
    assert everything == set(range(len(everything)))  # no group lost
    # The resumed stream fed from the checkpoint's frontier, skipping the groups trained ahead.
    frontier, ahead = _frontier(a.trained_log)
    assert stream.fed_log[0] == frontier and not set(stream.fed_log) & ahead
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert_glossary(rows, "Asynchronous GRPO", "Partial rollouts")  # issue 52: the metrics glossary, both ways
    assert max(r["async/crossed_rows"] for r in rows) > 0  # rows went on across a weight change
    assert max(r["async/token_staleness_max"] for r in rows) <= 3
    assert all(r["async/refused_groups"] == 0 or r["async/token_staleness_max"] > 2 for r in rows)
    # Each row's versions rise along it and change only at chunk boundaries (token 1 + 2k).
    for e in resumed.loop.buffer:
        for v in e.token_versions:
            v = v[v >= 0]
            assert (np.diff(v) >= 0).all()
            assert all((i - 1) % 2 == 0 for i in np.flatnonzero(np.diff(v)) + 1)


def _frontier(batches):
    ledger = Ledger()
    for b in batches:
        ledger.record(b)
    return ledger.frontier, ledger.ahead
