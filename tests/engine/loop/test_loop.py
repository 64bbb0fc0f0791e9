"""The one loop (grpo/engine/loop/loop.py), asynchronous end to end on 8 CPU devices:
max_staleness 0 equals the synchronous quickstart, the weight transfer is bit-exact, and
a preempted max_staleness 2 run resumes from its checkpointed buffer exactly as the
uninterrupted run goes on."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from _glossary import assert_glossary
from _runs import _config, preempted_and_resumed
from conftest import ROOT

from grpo.core.config import load_config
from grpo.engine.rollout.prompts import position_indices
from grpo.engine.runs.metrics import read_metrics
from grpo.engine.trainer import Trainer

# ------------------------------------------------------------------ end to end


QUICK = ["train.steps=20", "eval.every_n_steps=0", "checkpoint.at_end=false", "logging.progress_bar=false",
         "logging.plot=false"]


@pytest.fixture(scope="module")
def quickstart_pair(tmp_path_factory):
    """The quickstart for 20 steps, synchronous and asynchronous with max_staleness 0."""
    out = {}
    for name, extra in (("sync", []), ("async", ["train.async.enabled=true", "train.async.max_staleness=0"])):
        trainer = Trainer(load_config(ROOT / "configs" / "quickstart.yaml", QUICK + extra),
                          tmp_path_factory.mktemp(name))
        trainer.run()
        out[name] = trainer
    return out


@pytest.mark.slow
def test_staleness_zero_equals_the_synchronous_run(quickstart_pair):
    sync, asy = (read_metrics(quickstart_pair[n].run_dir) for n in ("sync", "async"))
    assert len(sync) == len(asy) == 20
    assert_glossary(asy, "Every step", "Asynchronous GRPO")  # issue 52: the metrics glossary, both ways
    assert [r["reward/mean"] for r in asy] == [r["reward/mean"] for r in sync]
    assert any(r["reward/mean"] > 0 for r in sync)  # something was learned from
    np.testing.assert_allclose([r["loss"] for r in asy], [r["loss"] for r in sync], rtol=0, atol=1e-5)
    assert {r["async/staleness_max"] for r in asy} == {0} and {r["async/refused_groups"] for r in asy} == {0}
    assert all(r["time/train/weight_sync_s"] > 0 for r in asy)
    params = quickstart_pair["async"].params  # issue 51: the bytes each sync moved, the whole tree
    assert {r["weight_sync/bytes"] for r in asy} == {float(sum(x.nbytes for x in jax.tree.leaves(params)))}


@pytest.mark.slow
def test_the_weight_transfer_is_bit_exact(quickstart_pair):
    trainer = quickstart_pair["async"]
    sync = trainer.loop.sync
    sync.sync(trainer.params, trainer.step)
    rollout_devices = set(sync.programs.mesh.devices.flat)
    assert not rollout_devices & set(trainer.mesh.devices.flat)
    for a, b in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(sync.params), strict=True):
        assert set(b.sharding.device_set) <= rollout_devices
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.dtype == b.dtype


def _buffer_arrays(trainer):
    """Each buffered step's (step, position, versions, every array of its rollout, host)."""
    from grpo.engine.loop.buffer import encode

    out = []
    for entry in trainer.loop.buffer:
        arrays = {}
        spec = encode(entry, arrays, {})
        out.append((entry.step, entry.position, spec, {k: np.asarray(v) for k, v in arrays.items()}))
    return out


@pytest.mark.slow
def test_a_preempted_async_run_resumes_exactly(tmp_path_factory):
    """SIGTERM after step 2 of 5 (max_staleness 2: steps 3 and 4 are buffered, drawn at
    versions 1 and 2): the checkpoint holds them, the rerun trains them as drawn, and the
    run equals the uninterrupted one bit for bit (metrics, samples, parameters)."""
    from _runs import assert_same_run

    steps, prompts = 5, 8
    config = _config(**{"train.steps": steps, "train.async": {"enabled": True, "max_staleness": 2},
                        "checkpoint.at_end": True})
    straight = Trainer(config, tmp_path_factory.mktemp("straight"))
    straight.run()
    saved = {}
    run_dir = tmp_path_factory.mktemp("resumed")
    resumed = preempted_and_resumed(config, run_dir, after=2,
                                    after_preempt=lambda t: saved.setdefault("preempted", _buffer_arrays(t)),
                                    after_resume=lambda t: saved.setdefault("resumed", _buffer_arrays(t)))
    # The buffer came back as it was saved: steps 3, 4 at positions 16, 24, versions 1, 2,
    # every array (tokens, masks, log-probs, rewards, lengths...) bit for bit, on the
    # update mesh's devices.
    before, after = saved["preempted"], saved["resumed"]
    assert [(s, p) for s, p, _, _ in before] == [(2, 16), (3, 24)] == [(s, p) for s, p, _, _ in after]
    for (_, _, spec_a, a), (_, _, spec_b, b) in zip(before, after, strict=True):
        assert spec_a == spec_b and a.keys() == b.keys() and len(a) > 10
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
            assert a[name].dtype == b[name].dtype
    # What both runs drew past their end (steps 6, 7 at versions 3, 4) is bit-equal too.
    ends = [_buffer_arrays(t) for t in (straight, resumed)]
    assert [(s, p) for s, p, _, _ in ends[0]] == [(5, 40), (6, 48)] == [(s, p) for s, p, _, _ in ends[1]]
    for (_, _, _, a), (_, _, _, b) in zip(*ends, strict=True):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
    assert [e.versions.tolist() for e in resumed.loop.buffer] == [[3] * 16, [4] * 16]
    # Every step once, at the uninterrupted run's data position, with its staleness:
    # nothing lost, repeated or re-drawn.
    rows = read_metrics(run_dir)
    assert [(r["step"], r["async/data_position"]) for r in rows] == [(s + 1, s * prompts) for s in range(steps)]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    assert all(0 < r["mismatch/weight_mean"] <= 2.0 for r in rows)
    assert resumed.data_position == steps * prompts and resumed.step == steps
    assert_same_run(straight, resumed)  # rewards, losses, staleness... equal; parameters bit-equal
    assert (run_dir / "samples.jsonl").read_text() == (straight.run_dir / "samples.jsonl").read_text()
    # The first prompt of each step is the data order's at that position.
    order = [position_indices(len(resumed.collector.prompts), start=s * prompts, count=1,
                              seed=config.train.seed)[0] for s in range(steps)]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [
        (s + 1, resumed.render(resumed.collector.prompts.examples[i])) for s, i in enumerate(order)]


@pytest.mark.slow
def test_a_rollout_failure_stops_with_a_clear_message(quickstart_pair, monkeypatch):
    from grpo.engine.loop.buffer import RolloutFailed

    loop = quickstart_pair["async"].loop

    def broken(**kwargs):
        raise ValueError("reward server unreachable")

    monkeypatch.setattr(loop.trainer.collector, "collect", broken)
    with pytest.raises(RolloutFailed, match=r"rollout of step \d+ .* failed on the rollout mesh: ValueError: reward"):
        loop.source.draw(**loop.cursor())
