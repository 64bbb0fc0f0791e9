"""``distributed.leave``: how a multi-process ``grpo run`` ends (every client shut down
together, process 0 exiting without tearing the coordination service down). Two real
processes (gloo): the run's exit code is both processes', neither aborts, ``leave`` does
not return, and what the process wrote to a block-buffered stdout reaches the pipe (process
0 leaves through ``os._exit``, which flushes nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _runs import free_port, wait_all

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("_leave_worker.py")


def _run(code: int) -> list[tuple[int, str, str]]:
    port = free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    env.pop("PYTHONUNBUFFERED", None)  # stdout to a pipe is then block-buffered: leave must flush it
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), str(code)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    return wait_all(procs, timeout=240)


def test_both_processes_leave_with_the_runs_exit_code():
    """143 (a preempted run's status): a code that is not 0 shows it is the run's, not the
    interpreter's; every other multi-process test checks 0 at the end of its runs."""
    code = 143
    for pid, (rc, out, err) in enumerate(_run(code)):
        assert rc == code, f"process {pid} exited {rc}:\n{err[-3000:]}"
        # The collective ran, leave flushed its unterminated line and did not return.
        assert out.endswith("sum 3") and "after leave" not in out, (pid, out)
        assert "Check failed" not in err and "Terminating process" not in err, err[-3000:]
