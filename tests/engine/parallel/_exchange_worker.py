"""One process of the multi-process exchange tests (tests/engine/parallel/test_exchange.py):
``python _exchange_worker.py PROCESS_ID PORT OUT_DIR PROCESSES ROLLOUT_PROCESSES VICTIM``. The
first ROLLOUT_PROCESSES processes' devices are the rollout side, the rest the update
side; each process runs a program of its own side on its side's devices, then three
exchanges (payloads both ways, a stop asked by the update side, a failure of the last
rollout process) and one on-device move of the update side's weights. What it received
goes to OUT_DIR/p<id>.npz and .json. Then process VICTIM dies (SIGKILL: no message, no
exit hook) while every other enters one more exchange: they must stop, not hang."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def payload(side: int) -> tuple[dict[str, np.ndarray], dict]:
    """What ``side`` sends in the first exchange (every process of the side alike):
    arrays whose sizes do not divide the devices, of several dtypes, and JSON metadata."""
    import ml_dtypes

    rng = np.random.default_rng(side)
    if side == 0:  # a rollout: tokens, log-probs, a mask, data position and versions
        return ({"tokens": rng.integers(0, 1000, (8, 5), dtype=np.int32),
                 "logprobs": rng.standard_normal((8, 5)).astype(np.float32),
                 "done": rng.random(8) < 0.5},
                {"position": 16, "versions": [0] * 8})
    return ({"w": rng.standard_normal((3, 7)).astype(ml_dtypes.bfloat16),  # weights
             "b": rng.standard_normal(13).astype(np.float32),
             "count": np.int64(7)},
            {"version": 1})


def weights() -> dict[str, np.ndarray]:
    """The update side's weights for the on-device move (values to check bit for bit:
    a negative zero, a NaN, bf16)."""
    import ml_dtypes

    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    w[0, 0], w[0, 1] = -0.0, np.nan
    return {"w": w, "e": rng.standard_normal((5, 3)).astype(ml_dtypes.bfloat16)}


def main(pid: int, port: int, out: Path, processes: int, rollout_processes: int, victim: int) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the exchange's start-up line
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes, process_id=pid,
                               heartbeat_timeout_seconds=10)
    from grpo.engine.parallel.exchange import RemoteFailure, SideExchange

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    r = sum(1 for d in devices if d.process_index < rollout_processes)
    ex = SideExchange(devices[:r], devices[r:])
    side = ex.side
    own_devices = devices[:r] if side == 0 else devices[r:]
    # Each side's own program on its own devices only (the other side runs another).
    mesh = Mesh(np.array(own_devices), ("x",))
    x = jax.device_put(jnp.arange(float(len(own_devices))), NamedSharding(mesh, P("x")))
    own = float(jax.jit(lambda a: jnp.sum(a * (2 if side == 0 else 3)), out_shardings=NamedSharding(mesh, P()))(x)
                .addressable_data(0))
    mine, meta = payload(side)
    got, their_meta, stop = ex.exchange(mine, meta)
    _, _, stop2 = ex.exchange({} if side == 0 else mine, None, stop=side == 1)
    # The weights, on device: sharded on the update side's mesh, received whole on each rollout device.
    w = weights()
    if side == 1:
        tree = {"w": jax.device_put(w["w"], NamedSharding(mesh, P("x" if 8 % len(own_devices) == 0 else None))),
                "e": jax.device_put(w["e"], NamedSharding(mesh, P()))}
    else:
        tree = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in w.items()}
    moved = ex.swap_arrays(tree)
    received = {}
    if side == 0:
        for i, device_leaves in enumerate(moved):
            for name, leaf in zip(sorted(w), device_leaves):
                assert leaf.devices() == {ex.local[i]}
                received[f"{name}@{i}"] = np.asarray(leaf)
    failure = None
    if pid == rollout_processes - 1:
        ex.fail("rollout of step 3 failed: boom")
    else:
        try:
            ex.exchange(mine, None)
        except RemoteFailure as err:
            failure = str(err)
    np.savez(out / f"p{pid}.npz", **{k: np.frombuffer(v.tobytes(), np.uint8) for k, v in got.items()},
             **{f"moved_{k}": np.frombuffer(v.tobytes(), np.uint8) for k, v in received.items()})
    (out / f"p{pid}.json").write_text(json.dumps({
        "side": ex.name, "own": own, "meta": their_meta, "stop": [stop, stop2], "failure": failure,
        "layout": {k: [list(v.shape), str(v.dtype)] for k, v in got.items()},
        "moved": sorted(received), "local": len(ex.local),
    }))
    # A dead process: the others wait in the exchange until the runtime says it is gone.
    import os
    import signal

    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("the failure has reached everyone")  # before anyone dies
    print(f"process {pid} ({ex.name} side) enters the last exchange", file=sys.stderr, flush=True)
    if pid == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    ex.exchange(mine, None)
    print(f"process {pid}: the last exchange returned", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
