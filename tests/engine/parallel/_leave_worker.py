"""One process of the exit test (tests/engine/parallel/test_leave.py):
``python _leave_worker.py PROCESS_ID PORT EXIT_CODE``. Starts the 2-process runtime the way
``grpo run`` does (``distributed.initialize``), runs one cross-process collective, writes
its result to stdout, then leaves with EXIT_CODE."""

from __future__ import annotations

import sys


def main(pid: int, port: int, code: int) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from grpo.core.config import DistributedConfig
    from grpo.engine.parallel import distributed

    distributed.initialize(DistributedConfig(mode="explicit", coordinator_address=f"127.0.0.1:{port}",
                                             num_processes=2, process_id=pid, heartbeat_timeout_s=10))
    total = np.asarray(multihost_utils.process_allgather(np.array([pid + 1]))).sum()
    sys.stdout.write(f"sum {int(total)}")  # no newline: held in the buffer until leave flushes it
    distributed.leave(code)
    sys.stdout.write(" after leave")  # a one-process leave(0) returns; here it never does


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
