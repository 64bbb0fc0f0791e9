"""The step's collection (grpo/engine/rollout/step.py): dynamic sampling streamed through
the continuous engine, checked against an independent reading of what the engine
reported (which rows finished when, their rewards) and against the rounds' rollouts."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from _glossary import assert_glossary
from _runs import _config, assert_same_run, preempted_and_resumed
from conftest import _on_path

from grpo.engine.runs.metrics import read_metrics
from grpo.engine.trainer import Trainer

P, K, MAX_ROUNDS = 4, 2, 3


def _stream_config():
    # The `length` task: even prompts score 0.5 whatever the completion (never
    # informative), odd ones by length. Four slots (two groups) and one-step chunks: groups
    # finish at different boundaries and some are still queued or decoding when the step fills.
    return _config(**{"task": {"name": "length", "options": {"flat_every": 2}}, "train.steps": 2,
                      "train.prompts_per_step": P, "rollout.num_generations": K,
                      "train.dynamic_sampling": {"enabled": True, "max_rounds": MAX_ROUNDS},
                      "rollout.engine": "continuous", "rollout.continuous": {"slots": 4, "chunk": 1},
                      "checkpoint.at_end": True})


@pytest.fixture(scope="module")
def streamed(example_plugin_dir):
    """The example plugin (the `length` task) importable for this module."""
    yield from _on_path(example_plugin_dir, ("grpo_example_plugin",))


@pytest.fixture(scope="module")
def run(streamed, tmp_path_factory):
    """Two steps streamed, recording each step's feeds, finished-row reports, rewards,
    stream output and update batch; beside them the rounds' rollouts of step 0's prompts
    (same weights)."""
    cfg = _stream_config()
    trainer = Trainer(cfg, tmp_path_factory.mktemp("straight"))
    c = trainer.collector
    c.sampler.update_weights(trainer.params, trainer.step)  # what the loop's weight sync does
    rounds = [jax.device_get(c._round(0, r * P, r, False).output) for r in range(MAX_ROUNDS)]
    c.sampler.release()
    steps = []  # per step: {"fed", "boundaries": [(rows, tokens, mask)], "scores": [totals], "out", "ub"}
    import grpo.engine.rollout.step as step_module

    score, stream, row_batch = c._score, step_module.stream, trainer.row_batch

    def recording_stream(engine, feeder, rng, **kw):
        rec = {"fed": [], "boundaries": [], "scores": []}
        steps.append(rec)
        feed, finished = feeder.feed, feeder.finished

        def rec_feed():
            more = feed()
            rec["fed"].append(0 if more is None else len(more[0]))
            return more

        def rec_finished(rows, tokens, mask):
            rec["boundaries"].append((rows.copy(), tokens.copy(), mask.copy()))
            return finished(rows, tokens, mask)

        feeder.feed, feeder.finished = rec_feed, rec_finished
        out = stream(engine, feeder, rng, **kw)
        rec["out"] = jax.device_get(out)
        return out

    def recording_score(examples, texts, lengths):
        scored = score(examples, texts, lengths)  # totals, per_fn, flags, first failures
        steps[-1]["scores"].append(scored[0])
        return scored

    def recording_rows(rollout, advantages):
        ub = row_batch(rollout, advantages)
        steps[-1]["ub"] = jax.device_get(ub)
        return ub

    c._score, step_module.stream, trainer.row_batch = recording_score, recording_stream, recording_rows
    try:
        trainer.run()
    finally:
        step_module.stream = stream
    return trainer, cfg, rounds, steps


def _reference(rec):
    """From what the engine reported alone: the groups in finish order with their rewards
    and the boundary each finished at; the informative ones (a reward spread) the step must
    keep, the fill, and the boundary at which the step was full."""
    done, order, scores = set(), [], iter(np.concatenate(rec["scores"]).reshape(-1, K))
    for b, (rows, _, _) in enumerate(rec["boundaries"]):
        done.update(int(r) for r in rows)
        for g in sorted({int(r) // K for r in rows}):
            if all(g * K + j in done for j in range(K)):
                order.append((g, b, next(scores)))
    kept = [g for g, _, r in order if r.max() > r.min()][:P]
    spare = [g for g, _, r in order if r.max() == r.min()]
    full_at = next((b for g, b, _ in order if g == kept[-1]), None) if len(kept) == P else None
    return order, kept, spare, full_at


def test_streamed_batch_is_the_informative_groups_in_finish_order(run):
    trainer, _, _, steps = run
    rows = read_metrics(trainer.run_dir)
    assert_glossary(rows, "Dynamic sampling", "Dynamic sampling, streamed")  # issue 52: the glossary, both ways
    seen = []
    for row, rec in zip(rows, steps, strict=True):
        order, kept, spare, full_at = _reference(rec)
        fed = sum(rec["fed"])
        if full_at is not None:  # the stream stopped at the boundary that filled the step
            assert len(rec["boundaries"]) == full_at + 1
        else:  # short: every prompt of the limit was fed and finished
            assert fed == P * MAX_ROUNDS and len(order) == fed
        filled = P - len(kept)
        picks = kept + spare[:filled]
        out, ub = rec["out"], rec["ub"]
        take = np.asarray([g * K + j for g in picks for j in range(K)])
        np.testing.assert_array_equal(ub.tokens, out.tokens[take])
        np.testing.assert_array_equal(ub.mask, out.mask[take])
        # Dropped in flight: fed, never reported finished; every fed group's rows are in the output.
        assert row["dynamic_sampling/dropped_in_flight"] == fed - len(order)
        assert row["dynamic_sampling/filled_groups"] == filled and row["dynamic_sampling/short"] == float(filled > 0)
        assert row["advantage/informative_groups"] == len(kept)
        assert row["rollout/generated_tokens"] == out.lengths.sum() == out.mask.sum()
        np.testing.assert_allclose(row["rollout/rolled_out_per_trained_token"], out.mask.sum() / ub.mask.sum(),
                                   rtol=1e-6)
        seen.append((fed - len(order), filled))
    assert any(d > 0 for d, _ in seen), seen  # a short step's fill: test_dynamic_sampling's StreamFilter test
    meta = trainer.checkpointer.restore(trainer._state(), 2)[1]
    assert meta["data_position"] == sum(sum(rec["fed"]) for rec in steps)


def test_streamed_rows_are_the_rounds_tokens(run):
    """A streamed prompt draws what the same prompt draws in its round (same key, same weights)."""
    _, _, rounds, steps = run
    out = steps[0]["out"]
    finished = np.concatenate([rows for rows, _, _ in steps[0]["boundaries"]])
    assert finished.size >= P * K
    for r in finished:
        q, i = divmod(int(r), P * K)
        np.testing.assert_array_equal(out.tokens[r], rounds[q].tokens[i])
        np.testing.assert_array_equal(out.mask[r], rounds[q].mask[i])
        # bf16 compute: the prefill batches differ (rounds: a round; stream: what was admitted).
        np.testing.assert_allclose(out.logprobs[r], rounds[q].logprobs[i], atol=2e-2)
        np.testing.assert_array_equal(out.prompt_tokens[r][out.prompt_mask[r] > 0],
                                      rounds[q].prompt_tokens[i][rounds[q].prompt_mask[i] > 0])


def test_streamed_run_resumes_bit_for_bit(run, tmp_path_factory):
    trainer, cfg, _, _ = run
    resumed = preempted_and_resumed(cfg, tmp_path_factory.mktemp("resumed"), after=1)
    assert_same_run(trainer, resumed)


FAULTY_CALLS: list[int] = []


def _faulty_rewards(self, *, options):
    """The arithmetic task's rewards and faulty ones (issue 55), each fault picked by the
    completion's text (deterministic, so a resumed run meets the same ones): ``flaky``
    hangs past task.reward_timeout_s, raises or returns NaN; ``by_group`` (batched per
    group) returns one value too few for some groups; ``counted`` (batched per step)
    counts its calls."""
    import zlib

    from grpo import batched_reward

    def flaky(completion, example):
        h = zlib.crc32(completion.encode()) % 5
        if h == 0:
            __import__("time").sleep(3)
        if h == 1:
            raise ValueError("flaky")
        return float("nan") if h == 2 else 1.0

    @batched_reward(per="group")
    def by_group(completions, prompts, **columns):
        bad = any(zlib.crc32(c.encode()) % 3 == 0 for c in completions)
        return [0.5] * (len(completions) - bad)

    @batched_reward
    def counted(completions, prompts, answer, **columns):
        FAULTY_CALLS.append(len(completions))
        return [float(len(c) > 3) for c in completions]

    return {**ORIGINAL_REWARDS(self, options=options), "flaky": flaky, "by_group": by_group, "counted": counted}


from grpo.plugins.tasks import ArithmeticTask  # noqa: E402

ORIGINAL_REWARDS = ArithmeticTask.reward_functions


@pytest.mark.slow
def test_overlapped_scoring_with_faulty_rewards_equals_scoring_after_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Issue 55: rewards that hang (past task.reward_timeout_s), raise, return NaN or the
    wrong length score 0 on those rows, are counted, and the run goes on; with the
    continuous engine, groups scored as they finish (reward_scoring: overlap) give the run
    of scoring after the rollout bit for bit; a step-batched reward is called once per
    step; and that run, SIGTERM'd after step 1 and resumed, is the same run again."""
    monkeypatch.setattr(ArithmeticTask, "reward_functions", _faulty_rewards)
    common = {"rollout.engine": "continuous", "rollout.continuous": {"slots": 4, "chunk": 1}, "train.steps": 2,
              "task.reward_timeout_s": 0.3, "checkpoint.at_end": True}
    overlapped = Trainer(_config(**common, **{"task.reward_scoring": "overlap"}), tmp_path / "overlap")
    overlapped.run()
    FAULTY_CALLS.clear()
    after = preempted_and_resumed(_config(**common), tmp_path / "after", after=1)
    assert FAULTY_CALLS == [16, 16]  # once per step
    assert_same_run(overlapped, after)
    rows = read_metrics(after.run_dir)
    assert sum(r.get("reward/flaky/timeouts", 0) for r in rows) > 0
    assert sum(r.get("reward/flaky/errors", 0) for r in rows) > 0
    assert sum(r.get("reward/flaky/not_applicable", 0) for r in rows) > 0
    assert sum(r.get("reward/by_group/errors", 0) for r in rows) > 0
    assert_glossary(rows, "Every step")  # "Reward failures" in full: test_failures.py (parse_failures: a judge's)
