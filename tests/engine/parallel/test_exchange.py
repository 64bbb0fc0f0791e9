"""The rendezvous of a multi-process asynchronous run (grpo/engine/parallel/exchange.py):
the byte packing and header on one process, and the swap itself between 2 real
processes x 4 CPU devices (gloo), checked against what the other process sent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from _runs import free_port
from grpo.engine.parallel.exchange import HEADER_BYTES, header_bytes, pack, read_header, unpack

WORKER = Path(__file__).with_name("_exchange_worker.py")


def _worker():
    spec = importlib.util.spec_from_file_location("_exchange_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pack_round_trips_bit_for_bit():
    rng = np.random.default_rng(0)
    payload = {"b": rng.standard_normal((3, 7)).astype(ml_dtypes.bfloat16), "a": np.int64(-3),
               "nan": np.array([np.nan, -0.0, np.inf], np.float32), "empty": np.zeros((0, 4), np.int32),
               "mask": np.array([True, False, True])}
    data, layout = pack(payload)
    assert data.dtype == np.uint8 and data.size == sum(np.asarray(v).nbytes for v in payload.values())
    assert [row[0] for row in layout] == sorted(payload)  # name order: both ends agree
    back = unpack(np.concatenate([data, np.full(5, 255, np.uint8)]), layout)  # padding after is ignored
    for name, value in payload.items():
        value = np.asarray(value)
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        assert back[name].tobytes() == value.tobytes(), name


def test_header_round_trips_and_an_overlong_one_becomes_a_failure():
    header = {"side": 1, "layout": [["w", [3, 7], "bfloat16"]], "meta": {"position": 16}, "stop": False}
    buf = header_bytes(header)
    assert buf.shape == (HEADER_BYTES,) and read_header(buf) == header
    long = read_header(header_bytes({"meta": "x" * 100}, size=64))
    assert set(long) == {"error"} and "over its 60" in long["error"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_processes_swap_payloads_stop_and_failures(tmp_path):
    """Process 0 (rollout side, devices 0-3) and process 1 (update side, 4-7), each after
    a program of its own on its own devices: the first exchange hands each the other's
    arrays bit for bit (bf16 weights one way, a rollout's ints, floats and bools the
    other, sizes that do not divide the 4 devices) and metadata; a stop asked by one side
    reaches both in the same exchange; a failure on the rollout side raises on the
    update side with its message instead of leaving it waiting."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    worker = _worker()
    for pid in range(2):
        result = json.loads((tmp_path / f"p{pid}.json").read_text())
        sent, sent_meta = worker.payload(1 - pid)  # what the other process sent
        got = np.load(tmp_path / f"p{pid}.npz")
        assert result["side"] == ("rollout", "update")[pid]
        assert result["own"] == [56.0, 84.0][pid]  # sum(0..7) x 2 on the rollout side, x 3 on the update side
        assert result["meta"] == sent_meta
        assert sorted(result["layout"]) == sorted(sent)
        for name, value in sent.items():
            value = np.asarray(value)
            assert result["layout"][name] == [list(value.shape), str(value.dtype)]
            assert got[name].tobytes() == value.tobytes(), (pid, name)
        assert result["stop"] == [False, True]
    assert json.loads((tmp_path / "p1.json").read_text())["failure"] == \
        "the rollout side failed: rollout of step 3 failed: boom"
