"""A tiny mixture-of-experts run with router replay (issue 54, item 3): the rollout's
routing travels into the update (dynamic sampling's rounds gathered, packed, two
micro-batches), the routing metrics are logged, a run preempted after step 1 resumes
bit-exactly, and an asynchronous run at max_staleness 0 (the ids in the loop's buffer,
moved from the rollout mesh to the update mesh) and a run over 2 processes (the ids
gathered with the rows across processes) are the synchronous one-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from _glossary import assert_glossary
from _runs import TINY, _config, assert_same_run, free_port, preempted_and_resumed, wait_all
from _xla import CPU_FAST_COMPILE
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


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The synchronous run with replay, 2 steps."""
    trainer = Trainer(_config(**MOE), tmp_path_factory.mktemp("straight"))
    trainer.run()
    return trainer


def test_a_run_with_replay_resumes_bit_exactly(straight, tmp_path):
    assert_same_run(straight, preempted_and_resumed(_config(**MOE), tmp_path / "resumed", after=1))


def test_an_async_run_with_replay_equals_the_synchronous_one(straight, tmp_path):
    """Issue 54, "replay ids through async": one process, the devices split (rollout 4,
    update 4), max_staleness 0: the routed ids ride in the buffer with their rows and
    the run is the synchronous one (rewards equal, losses within 1e-5, every routed token
    agreeing with the trainer's recomputed top-k in both). ~25 s."""
    trainer = Trainer(_config(**MOE, **{"train.async": {"enabled": True, "max_staleness": 0}}), tmp_path)
    trainer.run()
    sync, asy = read_metrics(straight.run_dir), read_metrics(tmp_path)
    assert len(asy) == len(sync) == 2 and {r["async/staleness_max"] for r in asy} == {0}
    assert [r["reward/mean"] for r in asy] == [r["reward/mean"] for r in sync]
    np.testing.assert_allclose([r["loss"] for r in asy], [r["loss"] for r in sync], rtol=0, atol=1e-5)
    assert [r["moe/routing_agreement"] for r in asy] == [r["moe/routing_agreement"] for r in sync] == [1.0, 1.0]
    assert all(r["logprob_gap/sampler_trainer"] < 1e-5 for r in asy)


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_a_two_process_run_with_replay_equals_the_one_process_run(straight, tmp_path):
    """Issue 54, several processes: 2 real `grpo run` processes x 4 CPU devices (gloo),
    synchronous, dynamic sampling gathering rows across processes: the routed ids are
    global arrays like the rows' tokens, and the run equals the one-process run (rewards
    equal, losses within 1e-5, every routed token agreeing). ~2 min on a loaded 2-core
    machine (two processes compiling)."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(TINY))
    sets = [a for k, v in MOE.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    port = free_port()
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {CPU_FAST_COMPILE}",
               JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "grpo.core.cli", "run", str(config), "--run-dir", str(tmp_path / "run"), *sets,
         "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for code, _, err in wait_all(procs, timeout=1100):
        assert code == 0, err[-3000:]
    rows, want = read_metrics(tmp_path / "run"), read_metrics(straight.run_dir)
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in want]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in want], rtol=0, atol=1e-5)
    assert [r["moe/routing_agreement"] for r in rows] == [1.0, 1.0]
    assert all(r["logprob_gap/sampler_trainer"] < 1e-5 for r in rows)
