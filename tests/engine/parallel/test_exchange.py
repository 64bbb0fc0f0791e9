"""The rendezvous of a multi-process asynchronous run (grpo/engine/parallel/exchange.py):
the byte packing and header on one process, and the swap itself between 2 real
processes x 4 CPU devices (gloo), checked against what the other process sent."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from _runs import free_port
from grpo.engine.parallel.exchange import (FAILURE_KEYS, HEADER_BYTES, failure_message, header_bytes, pack, read_header,
                                           route, unpack)

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
@pytest.mark.timeout(400)
@pytest.mark.parametrize("processes, per, rollout_processes, victim", [(4, 2, 2, 1), (4, 2, 1, 3)])
def test_processes_swap_payloads_weights_stop_and_failures(tmp_path, processes, per, rollout_processes, victim):
    """Real processes (gloo) split into a rollout side and an update side: 1 + 1 of 2 x 4
    devices, and (issue 51) 2 + 2 and 1 + 3 of 4 x 2. Each process, after a program of
    its own side on its side's devices: the first exchange hands every process of a side
    the other side's arrays bit for bit (bf16 weights one way, a rollout's ints, floats
    and bools the other, sizes that do not divide the devices) and metadata; a stop asked
    by one side reaches all in the same exchange; the update side's weights (sharded on
    its mesh) arrive on every rollout device bit for bit, on device; a failure on one
    rollout process raises on every other process, the other rollout processes too, with
    its message and the process, instead of leaving them waiting. Then (issue 51, item 2) a
    process dies (SIGKILL: a rollout process of the 2 + 2 split, an update process of the
    1 + 3) while the others wait in an exchange: every other process stops (the runtime's
    ``Task <victim> heartbeat timeout``, after the worker's 10 s) instead of hanging, and
    every process's log says which side each process is on."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={per}")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), str(tmp_path), str(processes),
                               str(rollout_processes), str(victim)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(processes)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    sides = (f"processes {list(range(rollout_processes))} roll out, processes "
             f"{list(range(rollout_processes, processes))} update")
    for pid, (p, err) in enumerate(zip(procs, errs)):
        assert "enters the last exchange" in err and "the last exchange returned" not in err, (pid, err[-3000:])
        if pid == victim:
            assert p.returncode == -signal.SIGKILL
            continue
        # It stopped (communicate returned) with an error. The runtime's message names the dead
        # task when its heartbeat times out first; under load (a suite run on 2 cores, twice) a
        # collective with the dead process failed first and the runtime aborted (SIGABRT) instead.
        assert p.returncode != 0, (pid, err[-3000:])
        assert f"Task {victim} heartbeat timeout" in err or p.returncode == -signal.SIGABRT, (pid, p.returncode,
                                                                                              err[-3000:])
        assert sides in err and f"process {pid} is on the {('rollout', 'update')[pid >= rollout_processes]} side" in err
    worker = _worker()
    n_rollout = rollout_processes * per
    sums = {"rollout": 2 * sum(range(n_rollout)), "update": 3 * sum(range(processes * per - n_rollout))}
    for pid in range(processes):
        side = 0 if pid < rollout_processes else 1
        result = json.loads((tmp_path / f"p{pid}.json").read_text())
        sent, sent_meta = worker.payload(1 - side)  # what the other side sent
        got = np.load(tmp_path / f"p{pid}.npz")
        assert result["side"] == ("rollout", "update")[side]
        assert result["own"] == sums[result["side"]]
        assert result["meta"] == sent_meta
        assert sorted(result["layout"]) == sorted(sent)
        for name, value in sent.items():
            value = np.asarray(value)
            assert result["layout"][name] == [list(value.shape), str(value.dtype)]
            assert got[name].tobytes() == value.tobytes(), (pid, name)
        assert result["stop"] == [False, True]
        if side == 0:  # every local device holds every leaf, bit for bit
            assert result["moved"] == sorted(f"{k}@{i}" for k in ("e", "w") for i in range(per))
            for key in result["moved"]:
                assert got[f"moved_{key}"].tobytes() == worker.weights()[key.split("@")[0]].tobytes(), (pid, key)
        if pid != rollout_processes - 1:
            assert result["failure"] == (f"the rollout side failed (process {rollout_processes - 1}): "
                                         "rollout of step 3 failed: boom"), pid


def test_route_sends_each_block_once_a_round():
    """The swap's rounds (issue 51: sides of any size): every device of each side
    receives exactly one block, from a device of the other side; no device sends or
    receives twice in a round."""
    for n_rollout, n_update in [(1, 1), (4, 4), (2, 6), (6, 2), (3, 5)]:
        rounds, when = route(n_rollout, n_update)
        received = {}
        for t, pairs in enumerate(rounds):
            assert len({s for s, _ in pairs}) == len(pairs) == len({d for _, d in pairs})
            for s, d in pairs:
                assert (s < n_rollout) != (d < n_rollout) and d not in received and when[d] == t
                received[d] = s
        assert sorted(received) == list(range(n_rollout + n_update))
        assert len(rounds) == -(-max(n_rollout, n_update) // min(n_rollout, n_update))


@pytest.mark.parametrize("topology, rollout_devices", [("v6e-16", 8), ("v6e-32", 16), ("v6e-16", 4)])
def test_the_move_compiles_to_point_to_point_permutes_on_tpu(topology, rollout_devices):
    """Issue 51: the on-device move (weights and bytes alike) on the TPU compiler (libtpu,
    no TPU): a v6e-16 split 2 + 2 hosts and a v6e-32 4 + 4 compile to one
    collective-permute (each rollout chip receives one update chip's block), 1 + 3 hosts
    to three rounds; never an all-gather of the blocks."""
    pytest.importorskip("libtpu")
    import re

    import jax
    import jax.numpy as jnp

    from grpo.engine.parallel.exchange import SideExchange
    from grpo.engine.parallel.split import split_devices
    from grpo.engine.planning.tpu import parse_topology

    rollout, update = split_devices(parse_topology(topology).devices(), rollout_devices=rollout_devices)
    ex = SideExchange(rollout, update)
    x = jax.ShapeDtypeStruct((len(ex.devices), 1 << 16), jnp.bfloat16, sharding=ex._blocks)
    hlo = ex._move.lower({"w": x}).compile().as_text()
    permutes = re.findall(r"collective-permute(?:-start)?\(", hlo)
    small, large = sorted((len(rollout), len(update)))
    assert len(permutes) == -(-large // small)  # rounds: a device sends at most once a round
    assert not re.search(r"\b(all-gather|all-to-all|all-reduce)(-start)?\(", hlo)


def test_the_failure_message_is_the_lowest_failed_process_s():
    """Issue 51, item 3: the failures posted to the coordination service (one key a
    process) read as one message naming the side, the process and the cause: the lowest
    process's when several failed; none posted, no message."""
    assert failure_message([]) is None
    posted = [(f"{FAILURE_KEYS}3", json.dumps({"side": "update", "error": "RemoteFailure: x"})),
              (f"{FAILURE_KEYS}1", json.dumps({"side": "rollout", "error": "SystemExit: the reward server went away"}))]
    assert failure_message(posted) == "the rollout side failed (process 1): SystemExit: the reward server went away"
