"""One process of the 2-process exchange test (tests/engine/parallel/test_exchange.py):
``python _exchange_worker.py PROCESS_ID PORT OUT_DIR``. Process 0 is the rollout side
(its 4 devices), process 1 the update side; each runs a program of its own on its local
devices, then three exchanges: payloads both ways, a stop asked by the update side, a
failure of the rollout side. What it received goes to OUT_DIR/p<id>.npz and .json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def payload(side: int) -> tuple[dict[str, np.ndarray], dict]:
    """What ``side`` sends in the first exchange: arrays whose sizes do not divide the 4
    devices, of several dtypes, and JSON metadata."""
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


def main(pid: int, port: int, out: Path) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from grpo.engine.parallel.exchange import RemoteFailure, SideExchange

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    ex = SideExchange(devices[:4], devices[4:])
    # Each side's own program on its own devices only (the other process runs another).
    local = Mesh(np.array(ex.local), ("x",))
    x = jax.device_put(jnp.arange(8.0), NamedSharding(local, P("x")))
    own = float(jax.jit(lambda a: jnp.sum(a * (2 if pid == 0 else 3)))(x))
    mine, meta = payload(pid)
    got, their_meta, stop = ex.exchange(mine, meta)
    _, _, stop2 = ex.exchange({} if pid == 0 else mine, None, stop=pid == 1)
    failure = None
    if pid == 0:
        ex.fail("rollout of step 3 failed: boom")
    else:
        try:
            ex.exchange(mine, None)
        except RemoteFailure as err:
            failure = str(err)
    np.savez(out / f"p{pid}.npz", **{k: np.frombuffer(v.tobytes(), np.uint8) for k, v in got.items()})
    (out / f"p{pid}.json").write_text(json.dumps({
        "side": ex.name, "own": own, "meta": their_meta, "stop": [stop, stop2], "failure": failure,
        "layout": {k: [list(v.shape), str(v.dtype)] for k, v in got.items()},
    }))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
