"""Asynchronous GRPO split by whole processes, several a side (issue 51): 4 real
`grpo run` processes x 2 CPU devices (gloo), processes 0-1 rolling out and 2-3 updating
(``rollout_devices: 4``), against the one-process runs of the same config in this
process (8 devices): at ``max_staleness: 0`` the synchronous run, at 1 the asynchronous
run with the same split (4 + 4); between them, every feature the issue lists (QLoRA, the
continuous engine, partial rollouts, dynamic sampling, evaluation, a multi-turn tool
task). Each test takes about 400 s on 2 shared cores (4 processes compile the same
programs at once), about 90 s on a quiet machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from _runs import free_port, wait_all
from _xla import CPU_FAST_COMPILE

from grpo.core.config import load_config
from grpo.engine.runs.metrics import read_metrics
from grpo.engine.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(1800)]

STEPS, PROMPTS, PROCESSES = 2, 8, 4
CONFIG = {
    "model": {"source": "random", "random": {"preset": "tiny"}},
    "rollout": {"num_generations": 2, "max_prompt_length": 32, "max_new_tokens": 3, "early_stop_chunk": 0},
    # Shaping rewards give the random policy non-zero advantages, so the weights move.
    "task": {"name": "arithmetic", "options": {"max_operand": 4, "num_examples": 64,
                                               "reward_weights": {"close": 0.5, "length": 0.25, "format": 0.25}}},
    "train": {"steps": STEPS, "prompts_per_step": PROMPTS, "optimizer": {"learning_rate": 1e-2},
              "async": {"enabled": True, "max_staleness": 0, "rollout_devices": 4}},
    "checkpoint": {"every_n_steps": 0, "at_end": False},
    "logging": {"progress_bar": False, "plot": False},
    "distributed": {"heartbeat_timeout_s": 10, "initialization_timeout_s": 120},
}


def _pod_run(tmp: Path, config: dict) -> Path:
    """The run of ``config`` on 4 processes x 2 devices; its run directory."""
    path, run_dir, port = tmp / "config.yaml", tmp / "run", free_port()
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {CPU_FAST_COMPILE}",
               JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "grpo.core.cli", "run", str(path), "--run-dir", str(run_dir),
         "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(PROCESSES), "--process-id", str(i)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(PROCESSES)]
    for pid, (code, out, err) in enumerate(wait_all(procs, timeout=1200)):  # 4 processes compiling on shared cores
        assert code == 0, f"process {pid}:\n{(out + err)[-3000:]}"
        assert ("Done: " in out) == (pid == 0)
    return run_dir


def _one_process(tmp: Path, config: dict) -> Trainer:
    path = tmp / "single.yaml"
    path.write_text(yaml.safe_dump(config))
    trainer = Trainer(load_config(str(path)), tmp / "single")
    trainer.run()
    return trainer


# Evaluation every step, on the rollout side (issue 51); a few prompts.
EVAL = {"every_n_steps": 1, "num_examples": 8, "at_start": False}
# Both runs: QLoRA (an int8 base, built on each side's mesh: only the adapters cross), the
# continuous engine and evaluation on the rollout side.
QLORA = {**CONFIG["model"], "lora": {"rank": 4, "alpha": 8, "base_quantization": "int8"}}
# Staleness 0 also rolls out conversations, with dynamic sampling: the built-in `lookup`
# task with its tool (the tools quickstart's), the continuous engine's turn scheduler on
# both rollout processes over every row's tokens, each process stepping its own rows'
# environments, the replies gathered over the rollout side's processes; dynamic sampling's
# rounds gathered over them too. Partial rollouts are not in this run: they stream
# single-turn rows and do not combine with dynamic sampling (both refused by
# `grpo config validate`). A random policy earns little reward here, so the entropy bonus
# moves the weights; a few rows call the tool (malformed calls: error replies, counted).
TOOLS = {
    "model": {**QLORA, "random": {"preset": "tiny", "overrides": {"initializer_range": 0.125}, "tool_tokens": True}},
    "rollout": {"num_generations": 2, "max_prompt_length": 44, "max_new_tokens": 24, "max_turns": 2,
                "max_turn_tokens": 6, "temperature": 1.5, "early_stop_chunk": 0, "engine": "continuous"},
    "task": {"name": "lookup", "options": {
        "key_alphabets": ["BDEFGHIJKL", "0123456789"], "value_alphabet": "bcdefghjkl", "value_digits": 1,
        "question": "{key} {key} {key} {key} {key} {key} {key} {key}", "reply": "{value} {value} {value} {value}"}},
    "loss": {"entropy_coef": 0.2},
    "train": {"dynamic_sampling": {"enabled": True, "max_rounds": 2}},
}
# Staleness 1 runs partial rollouts (the stream on the rollout processes) and the
# evaluation before the first step too.
PARTIAL = {"model": QLORA, "rollout": {**CONFIG["rollout"], "engine": "continuous"},
           "eval": {**EVAL, "at_start": True}, "train": {"async": {"partial_rollouts": True}}}


def _config(staleness: int) -> dict:
    """The pod run's config at ``staleness``: :data:`TOOLS` at 0, :data:`PARTIAL` at 1."""
    features = PARTIAL if staleness else TOOLS
    train = {**CONFIG["train"], **features["train"],
             "async": {**CONFIG["train"]["async"], "max_staleness": staleness, **features["train"].get("async", {})}}
    return {**CONFIG, "eval": EVAL, **features, "train": train}


@pytest.mark.parametrize("staleness", [0, 1])
def test_two_plus_two_processes_equal_the_one_process_run(tmp_path, staleness):
    """2 + 2 processes, with QLoRA, the continuous engine and evaluation on the rollout
    side: every step once at its data position and staleness, the same rewards and
    evaluation rows, losses within 1e-5 of the one-process synchronous run (staleness 0,
    a multi-turn task with a tool and dynamic sampling: the same tool counters and
    rounds) or the one-process asynchronous run with the same split (staleness 1, with
    partial rollouts and an evaluation at the start: every ``async/`` figure equal,
    ``async/buffered_steps`` too); the weights moved on device every step
    (``weight_sync/bytes``: the adapters' alone). Issue 51, item 1: LoRA/QLoRA and
    multi-turn tasks over processes were refused before, and (round 8) the continuous
    engine's multi-turn rollouts when the rollout side had several processes; item 2:
    the pod logged ``async/buffered_steps`` 0 where the one-process run logs 1."""
    config = _config(staleness)
    run_dir = _pod_run(tmp_path, config)
    rows = read_metrics(run_dir)
    single = dict(config, train={**config["train"], "async": {"enabled": False}}) if staleness == 0 else config
    trainer = _one_process(tmp_path, single)
    want = read_metrics(trainer.run_dir)
    assert [(r["step"], r["async/staleness_max"]) for r in rows] == [(s + 1, min(s, staleness)) for s in range(STEPS)]
    if staleness:  # every asynchronous figure: data positions, token versions, rows in flight, steps buffered
        for got, ref in zip(rows, want, strict=True):
            for key in ref:
                if key.startswith(("async/", "partial/")):
                    assert got[key] == ref[key], (got["step"], key, got[key], ref[key])
        assert [r["async/buffered_steps"] for r in rows] == [1] * STEPS
    else:  # each step's prompts start where the synchronous run's do: after its rounds of prompts
        assert [r["async/buffered_steps"] for r in rows] == [0] * STEPS
        rounds = [r["dynamic_sampling/rounds"] for r in want]
        assert [r["dynamic_sampling/rounds"] for r in rows] == rounds
        assert [r["async/data_position"] for r in rows] == [PROMPTS * sum(rounds[:s]) for s in range(STEPS)]
    assert any(r["grad_norm"] > 0 for r in want) and (any(r["reward/mean"] > 0 for r in want) or not staleness)
    for got, ref in zip(rows, want, strict=True):
        assert got["reward/mean"] == ref["reward/mean"]
        for key in ("loss", "grad_norm", "kl", "completion/length_mean"):
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-5, err_msg=key)
        assert got["weight_sync/bytes"] > 0 and got["time/train/weight_sync_s"] > 0
    # What moved: under QLoRA the adapters alone (trainer.params), not the base.
    moved = sum(x.nbytes for x in jax.tree.leaves(trainer.params))
    assert {r["weight_sync/bytes"] for r in rows} == {moved}
    assert moved < sum(x.nbytes for x in jax.tree.leaves(trainer.frozen))
    if not staleness:  # the conversations' counters are the one-process run's, and some rows called the tool
        for got, ref in zip(rows, want, strict=True):
            for key in ("tools/calls_per_sample", "tools/errors", "tools/truncated", "turns/mean"):
                assert got[key] == ref[key], (key, got[key], ref[key])
        assert max(r["tools/calls_per_sample"] for r in want) > 0
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    want_evals = [json.loads(line) for line in (trainer.run_dir / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals] == list(range(0 if staleness else 1, STEPS + 1))
    for got, ref in zip(evals, want_evals, strict=True):
        assert {k: v for k, v in got.items() if k != "time/eval_s"} == {k: v for k, v in ref.items() if k != "time/eval_s"}
