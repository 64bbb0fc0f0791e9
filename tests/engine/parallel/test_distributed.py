"""Real multi-process JAX runs on localhost: 2 processes x 4 CPU devices, gloo collectives.

Each process is a real ``grpo run`` (the same command on every "host"), started with
``--coordinator-address/--num-processes/--process-id``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from _runs import free_port, wait_all
from _xla import CPU_FAST_COMPILE
from grpo.engine.runs.metrics import read_eval, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

CONFIG = {
    "model": {"source": "random", "random": {"preset": "tiny"}},
    "rollout": {"num_generations": 2, "max_prompt_length": 32, "max_new_tokens": 3, "early_stop_chunk": 0},
    "task": {"name": "arithmetic", "options": {"max_operand": 4, "num_examples": 64}},
    "train": {"steps": 2, "prompts_per_step": 8, "optimizer": {"learning_rate": 1e-3}},
    "checkpoint": {"every_n_steps": 0, "at_end": False},
    "logging": {"progress_bar": False, "plot": False},
    "distributed": {"heartbeat_timeout_s": 10, "initialization_timeout_s": 120},
}


def _write_config(tmp_path: Path, **sections) -> Path:
    data = json.loads(json.dumps(CONFIG))
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _launch(config: Path, run_dir: Path, *, processes: int = 2, extra=(), path: Path | None = None) -> list[subprocess.Popen]:
    """``path``: a directory put first on the processes' PYTHONPATH (a plugin's site)."""
    port = free_port()
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {CPU_FAST_COMPILE}",
               JAX_PLATFORMS="cpu")
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
    return [
        subprocess.Popen(
            [sys.executable, "-m", "grpo.core.cli", "run", str(config), "--run-dir", str(run_dir),
             "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(processes),
             "--process-id", str(i), *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(processes)
    ]


# Shaping rewards give the random policy non-zero advantages, so the adapters train.
LORA = {
    "model": {"lora": {"rank": 4, "alpha": 8, "dropout": 0.2}},
    "task": {"options": {"max_operand": 4, "num_examples": 64,
                         "reward_weights": {"close": 0.5, "length": 0.25, "format": 0.25}}},
    "checkpoint": {"at_end": True},
    # PODS down-sampling: 4 samples of each prompt rolled out, the 2 of largest reward
    # variance trained on (rows chosen from every process's rewards, gathered across them).
    # Rolled out (and evaluated) by the continuous engine: a step's 32 rows queue for 8
    # slots, refilled every 2 decode steps; each process gathers the prompts and every
    # chunk boundary's done/lengths, so both run the same schedule (one process x 8
    # devices: 8 parts of the page pool of 1 slot each; maxtext's dp=2: 2 of 4).
    "rollout": {"num_generations": 4, "engine": "continuous", "continuous": {"slots": 8, "chunk": 2}},
    # Packed (train.packing is on by default) into bins of two longest sequences (32 + 3 each).
    "train": {"down_sampling": {"keep": 2}, "packing": {"bin_length": 70}},
    # Sampled pass@3 on the 5 test prompts in batches of 3: padded to 8 prompts on one
    # process's 8 rollout shards, to 4 on two processes with maxtext's 2 (dp) shards.
    "eval": {"every_n_steps": 2, "batch_size": 3, "k": 3, "greedy": False},
}


# The third-party `length` task with a tool: a multi-turn rollout. The random policy ends a
# turn only where it happens to write a stop token (its first turns are mostly cut by the
# 48-token turn limit, rollout.max_turn_tokens, which ends those conversations), so a few rows
# call (malformed calls get error replies) and take a second turn; each process runs the tools
# of its own rows. Greedy evaluation of 3 prompts rolls out conversations too. (The turn limit
# keeps the decode short: over two processes each decode step's collectives take
# milliseconds, and first turns running the whole 128-token budget took most of the test.)
#
# Its reward raises on every other prompt: failures on both processes' rows, each process
# scoring its own. Those prompts' groups all score 0, so dynamic sampling drops them and
# rolls out more: which groups it keeps is decided from rewards gathered from both
# processes, and the kept rows (with their loss masks) are gathered across them.
TOOLS = {
    # The tiny tokenizer's tool tags are single tokens: a random policy writes some calls.
    "model": {"random": {"preset": "tiny", "tool_tokens": True}},
    "task": {"name": "length", "options": {"num_examples": 64, "tools": True, "raise_every": 2}},
    # Packed, two conversations (up to 320 + 128 tokens each) to a bin of 704 tokens: both
    # steps' fullest loss rows round to the same head width, so the update compiles once (in
    # bins of 896 they rounded to 224 and 112 slots: two compiles).
    "train": {"dynamic_sampling": {"enabled": True, "max_rounds": 2}, "packing": {"bin_length": 704}},
    "rollout": {"num_generations": 2, "max_prompt_length": 320, "prompt_buckets": [320], "max_new_tokens": 128,
                "max_turns": 3, "max_turn_tokens": 48, "early_stop_chunk": 8},
    "eval": {"every_n_steps": 2, "at_start": False, "batch_size": 3, "num_examples": 3},
}


def _failing_rows(*, rounds: int, processes: int) -> list[int]:
    """Rows whose reward raises, per process, over the first ``rounds`` rollouts of the
    TOOLS case (each of a round's prompts is num_generations rows; process p takes the
    p-th share)."""
    from grpo.engine.rollout.prompts import position_indices, process_slice

    pps, k = CONFIG["train"]["prompts_per_step"], TOOLS["rollout"]["num_generations"]
    out = [0] * processes
    for r in range(rounds):
        idx = position_indices(64, start=r * pps, count=pps, seed=0)
        for p in range(processes):
            out[p] += k * int(np.sum(idx[process_slice(pps, p, processes)] % 2 == 0))
    return out


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory):
    """Each config run in this process, 1 process x 8 devices (once per module):
    ``name -> run directory``."""
    from grpo.core.config import load_config
    from grpo.engine.trainer import Trainer

    runs: dict[str, Path] = {}

    def run(name: str, config: Path) -> Path:
        if name not in runs:
            runs[name] = tmp_path_factory.mktemp(f"single_{name}")
            Trainer(load_config(config), runs[name]).run()
        return runs[name]

    return run


def _export_adapters(run_dir: Path, out: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    from grpo.engine.runs.export import export_run

    return load_file(str(export_run(run_dir, out, adapter=True) / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    "mesh, style, model",
    [("auto", "legacy", "tools"), ("host_local", "maxtext", "lora")],
)
def test_two_processes_match_single_process(tmp_path, example_plugin, single_process_reference, mesh, style, model):
    """2 processes x 4 devices give the single-process metrics for each mesh and rollout
    style, the update's passes packed (the same bins: each process plans them from the
    lengths of every process's rows). The ``lora`` case rolls out with the continuous engine (its host schedule run alike
    on both processes) and trains LoRA with dropout (adapters sharded over both
    processes' devices, per-row dropout keys, the frozen base beside them) on
    down-sampled groups (2 of 4 samples each, picked from both processes' rewards), and the
    adapters the two processes checkpointed export (PEFT) to the single-process run's, and
    its evaluations (batches that divide neither mesh's shards) are the single process's.
    The ``tools`` case (full fine-tuning) is a multi-turn task with dynamic sampling and a
    reward that fails on rows of both processes: each process runs its own rows'
    environments and scores its own rows, and the tool counters, turns, reward-error
    counters, dynamic-sampling decisions and evaluations are the single process's."""
    extra = {"lora": LORA, "tools": TOOLS}[model]
    single_dir = single_process_reference(model, _write_config(tmp_path, **extra))
    config = _write_config(tmp_path, mesh={"policy": mesh},
                           **{**extra, "rollout": {**extra.get("rollout", {}), "style": style}})
    run_dir = tmp_path / "run"
    results = wait_all(_launch(config, run_dir, path=example_plugin))
    for code, out, err in results:
        assert code == 0, err[-3000:]
    assert "Done: 2 steps" in results[0][1]
    assert "Done" not in results[1][1]  # only process 0 reports
    rows, want = read_metrics(run_dir), read_metrics(single_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for got, ref in zip(rows, want):
        for key in ("reward/mean", "loss", "grad_norm", "completion/length_mean", "kl"):
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-5, err_msg=key)
        kept = [key for key in ref if key.startswith("down_sampling/")]
        assert bool(kept) == (model == "lora")
        for key in kept:
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
        for key in ("reward_errors", "skipped_nonfinite_steps", "packing/efficiency", "packing/bins",
                    "packing/bins_used"):
            assert got[key] == ref[key], (key, got[key], ref[key])
        assert ref["packing/bins_used"] < 16  # packed: 16 sequences a step, several to a bin
        assert {k: v for k, v in got.items() if k.startswith("dynamic_sampling/")} == \
            {k: v for k, v in ref.items() if k.startswith("dynamic_sampling/")}
    if model == "tools":
        rounds = sum(int(r["dynamic_sampling/rounds"]) for r in rows)
        assert rounds > 2  # a step refilled
        per_process = _failing_rows(rounds=rounds, processes=2)
        assert min(per_process) > 0  # both processes scored failing rows
        assert rows[-1]["reward_errors"] == sum(per_process)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["reward_errors"] == {"length": sum(per_process)}
    if model == "tools":
        for got, ref in zip(rows, want):
            for key in ("tools/calls_per_sample", "tools/errors", "tools/timeouts", "tools/truncated", "turns/mean"):
                assert got[key] == ref[key], (key, got[key], ref[key])
        assert max(r["turns/mean"] for r in want) > 1 and max(r["tools/calls_per_sample"] for r in want) > 0
        evals, want_evals = read_eval(run_dir), read_eval(single_dir)
        assert [r["step"] for r in evals] == [2] == [r["step"] for r in want_evals]
        # Rewards are gathered across processes as f32: 1/3 is 0.33333334 there.
        assert {k: v for k, v in evals[0].items() if not k.startswith("time/")} == pytest.approx({
            k: v for k, v in want_evals[0].items() if not k.startswith("time/")}, rel=1e-6)
    if model == "lora":
        assert rows[-1]["grad_norm"] > 0  # the adapters trained
        evals, want_evals = read_eval(run_dir), read_eval(single_dir)
        assert [r["step"] for r in evals] == [0, 2] and [r["step"] for r in want_evals] == [0, 2]
        for got, ref in zip(evals, want_evals):
            assert got["eval/num_prompts"] == 5 and got["eval/num_samples"] == 3
            assert got.keys() == ref.keys()
            for key in ref:
                if not key.startswith("time/"):
                    assert got[key] == pytest.approx(ref[key], rel=1e-6), key
        multi = _export_adapters(run_dir, tmp_path / "peft_multi")
        single = _export_adapters(single_dir, tmp_path / "peft_single")
        assert multi.keys() == single.keys()
        for key, value in single.items():
            np.testing.assert_allclose(multi[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_require_process_count_fails_fast_on_every_process(tmp_path):
    config = _write_config(tmp_path, distributed={"require_process_count": 3})
    start = time.time()
    results = wait_all(_launch(config, tmp_path / "run"), timeout=120)
    assert time.time() - start < 120
    for code, _out, err in results:
        assert code == 2
        assert "require_process_count=3" in err and "every worker" in err and "Traceback" not in err


def test_dead_process_makes_the_other_exit(tmp_path):
    config = _write_config(tmp_path, train={"steps": 10_000})
    run_dir = tmp_path / "run"
    procs = _launch(config, run_dir)
    deadline = time.time() + 400
    while time.time() < deadline and not read_metrics(run_dir):
        time.sleep(0.5)
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
    assert read_metrics(run_dir), "no step finished"
    procs[1].send_signal(signal.SIGKILL)
    start = time.time()
    try:
        procs[0].wait(timeout=180)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("process 0 hung after process 1 died")
    assert procs[0].returncode != 0
    assert time.time() - start < 180
    for p in procs:
        p.communicate()


def _bench_memory(mode, *extra):
    return ["bench", "memory", "--mode", mode, "--dtype", "f32", "--target-bytes-gib", "0.001",
            "--cols", "256", "--json", *extra]


@pytest.mark.parametrize("mode", ["sharded", "gather"])
def test_bench_memory_single_process(mode):
    from click.testing import CliRunner

    from grpo.core.cli import cli

    result = CliRunner().invoke(cli, _bench_memory(mode))
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    total = out["actual_total_bytes"]
    assert out["mesh_shape"] == {"dp": 1, "fsdp": 8, "tp": 1} and out["mode"] == mode
    assert out["rows"] % 8 == 0 and total == out["rows"] * 256 * 4
    per_device = out["per_device_array_bytes_all_processes_max"]
    assert per_device == (total // 8 if mode == "sharded" else total)
    assert "bytes_in_use_max" not in out  # CPU reports no memory stats: omitted, not zero


@pytest.mark.parametrize("mode", ["sharded", "gather"])
def test_bench_memory_two_processes(mode):
    port = free_port()
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {CPU_FAST_COMPILE}",
               JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "grpo.core.cli", *_bench_memory(
                mode, "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i))],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    (code0, out0, err0), (code1, out1, err1) = wait_all(procs, timeout=180)
    assert code0 == 0 and code1 == 0, err0 + err1
    # Gloo writes "[Gloo] Rank ..." to the same stdout from C++, whose buffer is flushed on
    # its own schedule and can land in front of the JSON on its line: find the object.
    assert '{"' not in out1, out1  # process 0 prints for everyone
    assert out0.count('{"') >= 1, out0 + err0
    out, _ = json.JSONDecoder().raw_decode(out0[out0.index('{"'):])
    total = out["actual_total_bytes"]
    assert out["processes"] == 2 and out["mesh_shape"] == {"dp": 1, "fsdp": 8, "tp": 1}
    assert out["per_device_array_bytes_local_max"] == out["per_device_array_bytes_all_processes_max"]
    assert out["per_device_array_bytes_all_processes_max"] == (total // 8 if mode == "sharded" else total)
    assert any("fsdp spans 2 hosts" in w for w in out["warnings"])


def test_gather_int64_is_64_bit_safe():
    from grpo.engine.bench.memory import gather_int64

    big = [2**40 + 7, -1, 2**33]
    np.testing.assert_array_equal(gather_int64(big), np.array([big], np.int64))

