"""Partial rollouts (grpo/engine/rollout/partial.py): the version bookkeeping and the
ledger by hand; end to end on 8 CPU devices (the end-to-end runs on a tiny
mixture-of-experts model with router replay, issue 54): max_staleness 0 equals the
synchronous continuous run, rows cross weight changes with two versions, and a preempted
run resumes with no group lost or trained twice."""

from __future__ import annotations

import jax
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
# Issue 54: the tiny mixture-of-experts model with router replay: each token's routed
# experts travel with it through the stream (across versions, and the checkpoint).
MOE = {"model.random.preset": "tiny-moe", "model.moe.router_replay": "rollout"}


@pytest.mark.slow
def test_staleness_zero_equals_the_synchronous_continuous_run(tmp_path):
    """Each batch of a max_staleness 0 run equals the synchronous continuous step's rollout
    (StepCollector.collect: the same sampler, weights, step and data position): the same
    tokens, log-probs, rewards and (issue 54, a tiny MoE with router replay) routed
    experts, so the update, the same code, sees the same batch; the trainer replays the
    sampler's experts (every routed token agrees, log-probs within 1e-5)."""
    trainer = Trainer(_config(**{**CONTINUOUS, **MOE, "train.steps": 2, "train.async": {
        "enabled": True, "max_staleness": 0, "partial_rollouts": True}}), tmp_path)
    partial, compared = trainer.loop.source.partial, []
    draw = partial.draw

    def draw_and_compare(*, step, version, sample_group):
        rollout, versions, positions = draw(step=step, version=version, sample_group=sample_group)
        # The same engine, holding the same synced weights (update_weights).
        sync = trainer.collector.collect(step=step, position=step * 8, sample_group=False)
        assert rollout.output.routed_experts.shape == (16, 6, 2, 2)  # B N layers k
        for name in ("tokens", "mask", "lengths", "truncated", "prompt_tokens", "prompt_mask", "routed_experts"):
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
    assert {r["moe/routing_agreement"] for r in rows} == {1.0}
    assert all(r["logprob_gap/sampler_trainer"] < 1e-5 for r in rows)


@pytest.mark.slow
def test_a_preempted_partial_run_keeps_its_rows_in_flight(tmp_path, monkeypatch):
    """Issue 51 (in-flight rows kept across preemption). max_staleness 2 with a 2-step
    chunk, 6-token rows and ``on_weight_change: reprefill``: rows go on across weight
    changes. A real SIGTERM after step 2 of 4 while rows are in flight, then a new
    trainer on the same run directory: the checkpoint (one Orbax step: params, the
    buffered batch and the stream) puts every row back, the rows that were decoding
    rebuild their cache under the restored weights and decode on. The resumed run equals
    the uninterrupted one: the same steps, data positions, rewards and metrics, the same
    params bit for bit, and every trained batch the same tokens, log-probs and token
    versions; nothing is drawn twice (``async/regenerated_tokens`` 0) and no group is
    lost or trained twice. Issue 54 (a tiny MoE with router replay): each trained
    token's routed experts too, a row's ids across versions those each token was fed
    with, kept through the checkpoint for the rows in flight."""
    from grpo.engine.loop.loop import Loop

    steps, after = 4, 2
    config = _config(**{**CONTINUOUS, **MOE, "train.steps": steps, "checkpoint.at_end": True, "rollout.continuous": {
        "chunk": 2, "page_size": 8, "slots": 8}, "train.async": {"enabled": True, "max_staleness": 2,
                                                                 "partial_rollouts": True,
                                                                 "on_weight_change": "reprefill"}})
    batches: list = []
    due = Loop._due

    def recorded(loop):
        entry = due(loop)
        out = entry.rollout.output
        batches.append((entry.step, list(entry.positions), np.asarray(out.tokens), np.asarray(out.logprobs),
                        entry.token_versions.copy(), np.asarray(entry.rollout.rewards),
                        np.asarray(out.routed_experts)))
        return entry

    monkeypatch.setattr(Loop, "_due", recorded)
    whole = Trainer(config, tmp_path / "whole")
    whole.run()
    reference, batches[:] = list(batches), []

    in_flight: list = []

    def at_preempt(first):
        stream = first.loop.source.partial.stream
        in_flight.append((stream.engine.in_flight(), stream.last_fed))

    resumed = preempted_and_resumed(config, tmp_path / "preempted", after=after, after_preempt=at_preempt)
    assert in_flight[0][0] > 0, "the test needs rows in flight at the preemption"
    assert [b[:2] for b in batches] == [b[:2] for b in reference]  # steps and data positions
    for got, want in zip(batches, reference):
        for x, y in zip(got[2:], want[2:]):
            np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(whole.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    rows, ref = read_metrics(tmp_path / "preempted"), read_metrics(tmp_path / "whole")
    # The resumed stream's first batch (drawn during step after + 1) reports the rows put back.
    kept = [r["async/resumed_inflight_rows"] for r in rows]
    assert kept[after + 1] > 0 and sum(kept) == kept[after + 1]
    assert {r["async/regenerated_tokens"] for r in rows} == {0}
    own = ("time/", "compile/", "throughput/", "async/resumed_inflight_rows")
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(own)} for r in rs]  # noqa: E731
    assert strip(rows) == strip(ref)
    assert max(r["async/crossed_rows"] for r in rows) > 0  # rows went on across a weight change
    # Every fed token of every trained row has its experts (its last token, never fed, none),
    # rows that crossed a weight change included.
    for b in batches:
        versions, routed = b[4], b[6]
        lengths = (versions >= 0).sum(axis=1)  # a token's version is -1 off the mask
        fed = np.arange(versions.shape[1])[None] < (lengths - 1)[:, None]
        assert (routed[fed] >= 0).all() and (routed[~fed] == -1).all()
    trained = [p for b in batches for p in b[1]]
    assert len(trained) == len(set(trained)) == steps * 8  # none trained twice, none lost
    # The resumed stream went on feeding after the checkpoint's last position fed.
    assert resumed.loop.source.partial.stream.fed_log[0] == in_flight[0][1] + 1
    assert_glossary(rows, "Asynchronous GRPO", "Partial rollouts")  # issue 52: the metrics glossary, both ways
