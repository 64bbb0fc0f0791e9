"""Asynchronous GRPO split by processes (grpo/engine/loop/processes.py), against the
one-process async run with the same split (8 devices, 4 + 4) in this process: 4 real
`grpo run` processes x 2 CPU devices (gloo), 2 + 2, with the continuous engine and
partial rollouts, preempted by SIGTERM on one process while rows are in flight and
rerun; and 2 processes x 4 devices, 1 + 1, stopped by a rollout failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from _runs import free_port, wait_all
from _xla import CPU_FAST_COMPILE

from grpo.core.config import load_config
from grpo.engine.runs.checkpoint import Checkpointer
from grpo.engine.runs.metrics import read_metrics
from grpo.engine.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(1800)]

STEPS, PROMPTS = 5, 8
CONFIG = {
    "model": {"source": "random", "random": {"preset": "tiny"}},
    "rollout": {"num_generations": 2, "max_prompt_length": 32, "max_new_tokens": 3, "early_stop_chunk": 0},
    # Shaping rewards give the random policy non-zero advantages, so the weights move.
    "task": {"name": "arithmetic", "options": {"max_operand": 4, "num_examples": 64,
                                               "reward_weights": {"close": 0.5, "length": 0.25, "format": 0.25}}},
    # max_staleness 2: the buffer holds two steps, drawn at two versions, at any checkpoint.
    "train": {"steps": STEPS, "prompts_per_step": PROMPTS, "optimizer": {"learning_rate": 1e-2},
              "async": {"enabled": True, "max_staleness": 2, "rollout_devices": 4}},
    "checkpoint": {"every_n_steps": 0, "at_end": True},
    "logging": {"progress_bar": False, "plot": False},
    "distributed": {"heartbeat_timeout_s": 10, "initialization_timeout_s": 120},
}


def _launch(config: Path, run_dir: Path, *, env: dict | None = None, cwd: Path | None = None,
            processes: int = 2) -> list[subprocess.Popen]:
    """``processes`` x ``8 // processes`` devices: 1 + 1 processes, or 2 + 2 of 4."""
    port = free_port()
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes} {CPU_FAST_COMPILE}",
               JAX_PLATFORMS="cpu", **(env or {}))
    return [subprocess.Popen(
        [sys.executable, "-m", "grpo.core.cli", "run", str(config), "--run-dir", str(run_dir),
         "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(i)],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(processes)]


# The preempted run: 4 processes x 2 devices, 2 + 2 (issue 51, item 2: preemption over N
# processes); SIGTERM goes to process 1, a rollout process that is not process 0. Partial
# rollouts on the continuous engine (issue 51: refused over processes before): 6-token
# rows decoded 2 tokens a chunk in 8 slots, so rows are in flight at every step's end and
# cross weight changes. At max_staleness 2 the stream feeds a step's groups beyond the
# batches it draws (at 1 it feeds exactly the groups of the batch drawn one step ahead,
# so nothing is in flight between steps); ``reprefill``: a resumed row's cache is rebuilt
# under the weights it was drawn with, so its next tokens are the uninterrupted run's.
PROCESSES, SIGNALLED = 4, 1
PARTIAL = dict(CONFIG, rollout={**CONFIG["rollout"], "max_new_tokens": 6, "engine": "continuous",
                                "continuous": {"chunk": 2, "page_size": 8, "slots": 8}},
               train={**CONFIG["train"], "async": {**CONFIG["train"]["async"], "partial_rollouts": True,
                                                   "on_weight_change": "reprefill"}})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2 + 2 process run, SIGTERM'd (process 1, on the rollout side) once step 2 is
    logged (the checkpoint after step 1 holds no rows in flight: a signal landing there
    resumed nothing, which a run under load once did), then rerun to the end; and the
    one-process run of the same config."""
    tmp = tmp_path_factory.mktemp("four_processes")
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(PARTIAL))
    run_dir = tmp / "run"
    procs = _launch(config, run_dir, processes=PROCESSES)
    deadline = time.time() + 900  # 4 processes compiling on shared cores
    metrics = run_dir / "metrics.jsonl"
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < 2:
        assert time.time() < deadline and all(p.poll() is None for p in procs), "the run ended before step 2"
        time.sleep(0.05)
    procs[SIGNALLED].send_signal(signal.SIGTERM)
    first = wait_all(procs)
    second = wait_all(_launch(config, run_dir, processes=PROCESSES), timeout=900)
    single = Trainer(load_config(str(config)), tmp / "single")
    single.run()
    return first, second, run_dir, single


def test_a_preempted_four_process_run_resumes_and_equals_the_one_process_run(runs):
    """Every process stops on one rollout process's SIGTERM (exit 143) with a checkpoint
    after some step k < 5 that holds the partial-rollouts stream's rows in flight, and
    the rerun resumes there, putting them back. The 2 + 2 process run then equals the
    one-process async run with the same split: every step once, at the same data
    position and staleness (nothing lost or trained twice), the same rewards and
    samples (the same completions, prompts and rewards in samples.jsonl, each step's
    group written once), the same token versions and crossed rows, no token drawn twice
    (``async/regenerated_tokens`` 0), losses within 1e-5, and the final parameters the
    update processes checkpointed are the one-process run's (up to the order of a
    cross-process gradient sum, below). Issue 51: the preemption over N processes, and
    partial rollouts over processes (refused before), their rows in flight kept."""
    first, second, run_dir, single = runs
    for code, _, err in first:
        assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "Interrupted after step" in first[0][1] + first[0][2]
    for code, _, err in second:
        assert code == 0, err[-3000:]
    resumed = [line for line in second[0][1].splitlines() if line.startswith("Resuming from the checkpoint at step")]
    at = int(resumed[0].split("at step ")[1].split()[0]) if resumed else -1
    assert 1 <= at < STEPS, second[0][1]
    assert f"Done: {STEPS} steps" in second[0][1] and not any("Done" in out for _, out, _ in second[1:])
    # The checkpoint the rerun resumed from held rows in flight: seated (with tokens) or queued.
    ckpt = Checkpointer(run_dir / "checkpoints", keep=10)
    engine = ckpt.restore({}, at)[1]["async"]["inflight"]["meta"]["engine"]
    assert engine["order"], engine

    rows, want = read_metrics(run_dir), read_metrics(single.run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert any(r["grad_norm"] > 0 for r in want)  # the weights move: the versions matter
    assert max(r["async/crossed_rows"] for r in want) > 0  # rows went on across a weight change
    # The resumed stream's first batch (drawn during step at + 1) reports the rows put back.
    kept = [r["async/resumed_inflight_rows"] for r in rows]
    assert kept[at + 1] > 0 and sum(kept) == kept[at + 1], kept
    assert {r["async/regenerated_tokens"] for r in rows} == {0}
    for got, ref in zip(rows, want, strict=True):
        assert got["reward/mean"] == ref["reward/mean"]
        # Data positions, staleness, token versions, refused groups, rows in flight, steps
        # buffered (issue 51, item 2: counted by the rollout side, which holds the step drawn
        # ahead when the row is built); not the rows put back (this run's own).
        for key in ref:
            if key.startswith(("async/", "partial/")) and key != "async/resumed_inflight_rows":
                assert got[key] == ref[key], (got["step"], key, got[key], ref[key])
        for key in ("loss", "grad_norm", "kl", "completion/length_mean"):
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-5, err_msg=key)
    assert (run_dir / "samples.jsonl").read_text() == (single.run_dir / "samples.jsonl").read_text()

    # The final checkpoint holds the update side's parameters as host arrays.
    like = {"params": jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), single.params)}
    (state, meta) = ckpt.restore(like, STEPS)
    ckpt.close()
    assert meta["step"] == STEPS and meta["data_position"] == STEPS * PROMPTS
    # The update side's gradients are summed across its 2 processes (gloo) in another order
    # than on one process's 4 devices; Adam (lr 1e-2) turns that rounding into up to ~1e-4 on
    # the few weights whose gradients are near zero (measured: 23 of 20,480 elements of one
    # leaf over 1e-6, at most 9.5e-5), while every other element agrees within 1e-6.
    off = 0
    for got, ref in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(single.params), strict=True):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-4)
        off += int((np.abs(got - ref) > 1e-6 + 1e-5 * np.abs(ref)).sum())
    assert off <= 1e-3 * sum(x.size for x in jax.tree.leaves(single.params)), off


BOOM = '''
import os

calls = 0


def close(completions, prompts=None, **columns):
    """Scores like a task, then, past BOOM_AFTER completions (of this process's rows; on
    process BOOM_PROCESS alone when set), exits as a library that gives up does
    (SystemExit: not an Exception, so scoring does not count it as a reward error and
    score 0, as it does an exception)."""
    global calls
    calls += len(completions)
    only = os.environ.get("BOOM_PROCESS")
    if only is not None:
        import jax

        if jax.process_index() != int(only):
            return [float(len(c) % 3) for c in completions]
    if calls > int(os.environ["BOOM_AFTER"]):
        raise SystemExit("the reward server went away")
    return [float(len(c) % 3) for c in completions]
'''


def test_a_rollout_failure_stops_both_processes_with_its_message(tmp_path):
    """A reward function that exits in step 3's rollout (process 0, the rollout side)
    ends the two-process run on both processes, with a non-zero exit and its message on
    the update side too (sent in place of the next exchange), instead of a hang."""
    (tmp_path / "boom.py").write_text(BOOM)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {a} ="}) + "\n" for a in range(32)))
    config = dict(CONFIG, task={"name": "custom", "options": {"rewards": ["boom:close"],
                                                              "data_files": {"train": str(tmp_path / "d.jsonl")}}},
                  train={**CONFIG["train"], "async": {**CONFIG["train"]["async"], "max_staleness": 1}})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    # Each step's rollout scores PROMPTS x 2 completions; the third one's fails.
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "BOOM_AFTER": str(2 * PROMPTS * 2)}
    results = wait_all(_launch(path, tmp_path / "run", env=env, cwd=tmp_path), timeout=400)
    for pid, (code, out, err) in enumerate(results):
        assert code not in (0, None), f"process {pid} exited {code}"
        assert "the reward server went away" in out + err, f"process {pid}:\n{(out + err)[-3000:]}"
    assert "Done:" not in results[0][1]
    # The update side says what failed on the other process, without a traceback of its own.
    assert "Error: the rollout side failed (process 0): SystemExit: the reward server went away" in results[1][2]
    assert "Traceback" not in results[1][2], results[1][2][-3000:]


def test_a_rollout_failure_on_one_of_two_rollout_processes_stops_all_four(tmp_path):
    """Issue 51, item 3 (failures stop everyone, carried to N processes): 4 processes x 2
    devices, 2 + 2, and a reward that exits in the first rollout on process 1 alone.
    Process 0, its rollout peer, then waits for it in the rollout side's gather of the
    rewards, and the update processes wait in the exchange that process 0 never enters:
    before, the failure went into that exchange alone and every process hung. Now it is
    also posted to the coordination service, which every process watches: all four stop
    (exit status 1), each with the one message naming the side, the process and the
    cause. The failure comes before the first step, so no update program runs."""
    (tmp_path / "boom.py").write_text(BOOM)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {a} ="}) + "\n" for a in range(32)))
    config = dict(CONFIG, task={"name": "custom", "options": {"rewards": ["boom:close"],
                                                              "data_files": {"train": str(tmp_path / "d.jsonl")}}},
                  train={**CONFIG["train"], "async": {**CONFIG["train"]["async"], "max_staleness": 1}},
                  checkpoint={"every_n_steps": 0, "at_end": False})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "BOOM_AFTER": "0",
           "BOOM_PROCESS": "1"}
    results = wait_all(_launch(path, tmp_path / "run", env=env, cwd=tmp_path, processes=4), timeout=400)
    message = "Error: the rollout side failed (process 1): SystemExit: the reward server went away"
    for pid, (code, out, err) in enumerate(results):
        assert code == 1 and message in err, f"process {pid} exited {code}:\n{(out + err)[-3000:]}"
        assert "Done:" not in out
    assert not (tmp_path / "run" / "metrics.jsonl").is_file() or not read_metrics(tmp_path / "run")
