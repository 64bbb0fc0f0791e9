"""A tiny mixture-of-experts run with router replay (issue 54, item 3): the rollout's
routing travels into the update (dynamic sampling's rounds gathered, packed, two
micro-batches), the routing metrics are logged, and a run preempted after step 1 resumes
bit-exactly."""

from __future__ import annotations

import pytest

from _glossary import assert_glossary
from _runs import _config, assert_same_run, preempted_and_resumed
from grpo.engine.runs.metrics import read_metrics
from grpo.engine.trainer import Trainer

pytestmark = pytest.mark.slow

MOE = {"model.random.preset": "tiny-moe", "model.moe.router_replay": "rollout", "model.moe.load_balancing_loss": 0.01,
       "model.moe.router_z_loss": 0.001, "train.micro_batch_size": 8, "train.steps": 2,
       "train.dynamic_sampling.enabled": True, "train.dynamic_sampling.max_rounds": 2}


def test_a_tiny_moe_run_replays_routing_and_logs_it(tmp_path):
    """Equal numerics (f32 sampler and trainer, replayed routing): the trainer's log-probs
    are the sampler's; every routed token agrees; the router losses are logged. With the
    experts split over an expert axis of 4 (issue 54) in both the update's mesh (fsdp 2 x
    ep 4) and the serving rollout's (dp 2 x ep 4): all-to-all in the sampler and the update."""
    trainer = Trainer(_config(**MOE, **{"mesh.expert_parallel": 4, "rollout.style": "serving"}), tmp_path)
    assert dict(trainer.programs.mesh.shape) == {"dp": 1, "fsdp": 2, "ep": 4, "tp": 1}
    assert trainer.programs.rollout.mesh.shape["ep"] == 4
    trainer.run()
    rows = read_metrics(tmp_path)
    assert_glossary(rows, "Mixture of experts")
    for row in rows:
        assert row["moe/routing_agreement"] == 1.0
        assert row["logprob_gap/sampler_trainer"] < 1e-5
        assert row["moe/expert_load/max"] >= row["moe/expert_load/mean"] >= 1.0
        assert row["moe/router_z_loss"] > 0 and row["moe/load_balancing_loss"] >= 1.0 - 1e-6
    assert rows[0]["packing/micro_batches"] >= 1


def test_a_run_with_replay_resumes_bit_exactly(tmp_path):
    straight = Trainer(_config(**MOE), tmp_path / "straight")
    straight.run()
    assert_same_run(straight, preempted_and_resumed(_config(**MOE), tmp_path / "resumed", after=1))
