"""The XLA:CPU set-up, made before JAX starts a backend (``import grpo`` calls
:func:`configure`): numerics that do not depend on the machine, and no rendezvous deadlock
with several virtual CPU devices.

XLA:CPU runs each device's part of a program, and the ops' intra-op parallel work, on one
thread pool of ``max(PJRT_NPROC or the machine's cores, CPU devices)`` threads. Measured
with jaxlib 0.10.2 on a 2-core Xeon (Sapphire Rapids):

- **Numerics follow the machine.** The pool's size changes the low bits: a matmul that
  contracts a long axis (the gradient's ``x.T @ dy``) is split by threads, and YNNPACK's
  reductions split their sum by threads (``PJRT_NPROC`` 1, 2 and 16 give three different
  quickstart losses from step 5). XLA's "platform dependent math" (on by default: "faster
  code at the expense of consistent results across CPUs") changes them too, and YNNPACK and
  XNNPACK pick their kernels for the CPU they find at run time. 800 steps of RL amplify
  low bits into another held-out curve, so the same quickstart gave another curve on a
  machine of the same kind. So a CPU run's pool is sized from its device count alone
  (:data:`THREADS_PER_DEVICE` threads a device), and :data:`FLAGS` take the CPU-dependent
  paths out: the instruction set XLA compiles for is capped at AVX2 (x86-64 only),
  platform-dependent math is off and the YNNPACK/XNNPACK paths are off, so XLA's own
  emitters (compiled for that instruction set) do the work.
- **Collectives deadlock with a pool of one thread per device.** A program with a
  collective needs all its devices' parts running at once; with more than about 32 such
  programs in flight (dispatch running ahead of execution: a loaded machine runs them
  slower than Python dispatches them), parts of different programs fill the pool and wait
  for each other: ``rendezvous.cc:161 Termination timeout for all gather ... Expected 8
  threads to join the rendezvous, but only 7 of them arrived on time``, then the process
  aborts (exit 134) after ``--xla_cpu_collective_call_terminate_timeout_seconds`` (40 s).
  A longer timeout only waits longer: nothing runs. 300 independent all-gather programs
  on 8 devices aborted every time with 8 or 15 threads and never with 16 or more, and two
  threads dispatching on 4 devices each (an asynchronous run's two meshes) aborted with 8
  threads and never with 16. Two threads a device is that bound.

A user's own settings win: ``PJRT_NPROC`` (or ``NPROC``) set by hand is kept, and a flag
already in ``XLA_FLAGS`` is not repeated. Nothing is set when JAX has already started its
backends (too late to matter) or when ``JAX_PLATFORMS`` leaves the CPU out. On a TPU or
GPU host the settings reach only JAX's CPU client (XLA's ``xla_cpu_*`` flags, and the
CPU client's pool: ``PJRT_NPROC`` sizes nothing else), which grpo runs nothing on.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from typing import MutableMapping

THREADS_PER_DEVICE = 2
"""XLA:CPU's thread pool per CPU device (see the module docstring)."""

FLAGS = (
    "--xla_cpu_enable_platform_dependent_math=false",
    "--xla_cpu_use_xnnpack=false",
    "--xla_cpu_experimental_ynn_fusion_type=-reduce,-dot,-eltwise",
)
"""XLA flags that take the CPU-dependent code paths out (see the module docstring)."""

X86_FLAGS = ("--xla_cpu_max_isa=AVX2",)
"""Added on x86-64 only: the instruction set XLA:CPU compiles for, capped."""

_OURS = "GRPO_SET_PJRT_NPROC"
# The PJRT_NPROC grpo set, so that a process it starts (which inherits the environment)
# sizes its own pool from its own device count instead of taking the value as the user's.


def _devices(env: MutableMapping[str, str]) -> int:
    """The CPU device count JAX will create: ``--xla_force_host_platform_device_count``
    (the last one wins, as in XLA), else ``JAX_NUM_CPU_DEVICES``, else 1."""
    counts = re.findall(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
    if counts:
        return max(int(counts[-1]), 1)
    try:
        return max(int(env.get("JAX_NUM_CPU_DEVICES", "")), 1)
    except ValueError:
        return 1


def _cpu_client(env: MutableMapping[str, str]) -> bool:
    """Whether JAX will start its CPU client: ``JAX_PLATFORMS`` unset or naming ``cpu``."""
    platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    return not platforms or "cpu" in platforms


def _started() -> bool:
    """Whether JAX has already created its backends in this process."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except Exception:  # noqa: BLE001 - a JAX without that attribute: assume not started
        return False


def configure(env: MutableMapping[str, str] | None = None, *, machine: str | None = None) -> dict[str, str]:
    """Set the XLA:CPU thread pool (``PJRT_NPROC``) and :data:`FLAGS` in ``env``
    (``os.environ``), as the module docstring says; returns what it set (empty when it set
    nothing). ``machine``: ``platform.machine()`` unless given (tests)."""
    real = env is None
    env = os.environ if env is None else env
    if (real and _started()) or not _cpu_client(env):
        return {}
    out: dict[str, str] = {}
    user_threads = ("PJRT_NPROC" in env and env.get(_OURS) != env["PJRT_NPROC"]) or "NPROC" in env
    if not user_threads:
        out["PJRT_NPROC"] = out[_OURS] = str(THREADS_PER_DEVICE * _devices(env))
    flags = env.get("XLA_FLAGS", "")
    x86 = (machine or platform.machine()).lower() in ("x86_64", "amd64")
    extra = [f for f in FLAGS + (X86_FLAGS if x86 else ()) if f.split("=", 1)[0] + "=" not in flags]
    if extra:
        out["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
    env.update(out)
    return out


__all__ = ["FLAGS", "THREADS_PER_DEVICE", "X86_FLAGS", "configure"]
