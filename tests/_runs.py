"""Helpers for tests that run the trainer: the tiny run config (``TINY``, ``_config``), and
preempting a trainer and resuming it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import jax
import numpy as np
import pytest

from grpo.core.config import load_config
from grpo.engine.runs.metrics import read_eval, read_metrics
from grpo.engine.trainer import Interrupted, Trainer


TINY = {
    "model": {"source": "random", "random": {"preset": "tiny"}},
    "rollout": {"num_generations": 2, "max_prompt_length": 32, "max_new_tokens": 3, "early_stop_chunk": 0},
    # The shaping rewards give a random policy non-zero advantages, so every step updates.
    "task": {"name": "arithmetic", "options": {"max_operand": 9, "num_examples": 64, "num_test_examples": 8,
                                               "reward_weights": {"close": 0.5, "length": 0.25, "format": 0.25}}},
    "train": {"steps": 1, "prompts_per_step": 8, "optimizer": {"learning_rate": 1e-3}},
    "checkpoint": {"every_n_steps": 0, "at_end": False},
    "logging": {"progress_bar": False, "plot": False},
}


def _config(**overrides):
    sets = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    return load_config(TINY, sets)


def preempted_and_resumed(config, run_dir, *, after: int, after_preempt=None, after_resume=None) -> Trainer:
    """Run ``config`` in ``run_dir`` (a path or a bucket URL) with a real SIGTERM after step
    ``after`` (as on a preempted TPU), then resume it in a new trainer to the end; returns
    that trainer. ``after_preempt(trainer)`` looks at what the preempted trainer left,
    ``after_resume(trainer)`` at the new trainer just resumed (before its first step)."""
    first = Trainer(config, run_dir)
    step_fn = first.train_step

    def train_step_then_preempt():
        row = step_fn()
        if first.step == after:
            os.kill(os.getpid(), signal.SIGTERM)
        return row

    first.train_step = train_step_then_preempt
    with pytest.raises(Interrupted) as stop:
        first.run()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert stop.value.step == after and stop.value.exit_code == 128 + signal.SIGTERM
    assert first.checkpointer.latest_step() == after
    if after_preempt is not None:
        after_preempt(first)
    second = Trainer(config, run_dir)
    assert second.maybe_resume() and second.step == after
    if after_resume is not None:
        after_resume(second)
    second.run()
    return second


def assert_same_run(a: Trainer, b: Trainer) -> None:
    """Bitwise the same trained parameters, and the same metrics and evaluations, timings and
    compile counts aside."""
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    timing = ("time/", "throughput/", "compile/")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rows]  # noqa: E731
    assert strip(read_metrics(b.run_dir)) == strip(read_metrics(a.run_dir))
    assert strip(read_eval(b.run_dir)) == strip(read_eval(a.run_dir))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a coordinator's or an emulator's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs, timeout=600):
    """Each subprocess's (return code, stdout, stderr), all within ``timeout`` seconds;
    on a timeout every one of them is killed (a hung process must not hang the suite)."""
    outs = []
    deadline = time.time() + timeout
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs
