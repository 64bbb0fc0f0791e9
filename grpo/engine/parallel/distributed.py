"""Multi-controller start-up: the same ``grpo run`` on every host.

``distributed.mode``:
- ``none``: one process (the default);
- ``auto``: ``jax.distributed.initialize()`` detects TPU pods, SLURM, ... by itself;
- ``explicit``: coordinator address, process count and id from the config or CLI flags
  (GPU clusters, CPU tests).

``require_process_count`` fails fast on every process when the count differs — the
classic mistake is launching on worker 0 only.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import jax

from grpo.core.config import DistributedConfig
from grpo.core.errors import UserError

log = logging.getLogger(__name__)

_LAUNCH_HINT = (
    "Launch `grpo run` on every worker (on a TPU pod: `gcloud compute tpus tpu-vm ssh NAME "
    "--worker=all --command=...`), with the same config everywhere."
)


def _require(cfg: DistributedConfig, count: int, where: str) -> None:
    want = cfg.require_process_count
    if want is not None and count != want:
        raise UserError(
            f"distributed.require_process_count={want}, but {where} {count} process(es). {_LAUNCH_HINT}"
        )


def initialize(cfg: DistributedConfig) -> None:
    """Start JAX's distributed runtime as configured (idempotent)."""
    if cfg.mode == "none":
        _require(cfg, 1, "distributed.mode is 'none', which runs")
        return
    if jax.distributed.is_initialized():
        _require(cfg, jax.process_count(), "this runtime has")
        return
    kwargs: dict = {
        "initialization_timeout": cfg.initialization_timeout_s,
        "heartbeat_timeout_seconds": cfg.heartbeat_timeout_s,
    }
    if cfg.mode == "explicit":
        _require(cfg, int(cfg.num_processes), "distributed.num_processes says")  # type: ignore[arg-type]
        kwargs.update(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
        )
    if cfg.cpu_collectives != "none":
        # Only consulted by the CPU backend; harmless elsewhere.
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as err:  # noqa: BLE001 - turn start-up failures into one clear message
        raise UserError(
            f"jax.distributed.initialize failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
            f"Check distributed.coordinator_address and that every process started within "
            f"{cfg.initialization_timeout_s}s. {_LAUNCH_HINT}"
        ) from None
    _require(cfg, jax.process_count(), "the runtime started with")
    log.info("process %d of %d, %d local devices", jax.process_index(), jax.process_count(), jax.local_device_count())


def is_main() -> bool:
    return jax.process_index() == 0


LEAVE_GRACE_S = 2.0
"""How long process 0 keeps the coordination service up after the last shutdown barrier:
the other processes' disconnect replies are still on their way when its own returns."""


def leave(exit_code: int = 0) -> None:
    """End a multi-process ``grpo run`` with ``exit_code`` once its work is saved.

    JAX's exit hook shuts the distributed runtime down client first, then (on process 0)
    the coordination service. Destroying that service's gRPC server while another
    process's last requests are in flight aborts process 0 now and then
    (``server.cc: Check failed: queue.Pop() == nullptr`` in
    ``DistributedRuntimeService::Shutdown``) after a run that finished and saved. So here
    every process shuts its client down (a barrier: every process has finished); the
    others then exit as usual, and process 0, :data:`LEAVE_GRACE_S` later (a process whose
    disconnect reply finds the service gone aborts too), exits without destroying the
    service: the service ends with its process. A one-process run returns (0) or exits as
    usual.
    """
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        if exit_code:
            sys.exit(exit_code)
        return
    from jax._src import distributed as _state  # the client and service handles

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if jax.process_index() != 0:
        jax.distributed.shutdown()  # the client alone: this process holds no service
        sys.exit(exit_code)
    state = _state.global_state
    if state.preemption_sync_manager is not None:
        state.preemption_sync_manager.shutdown()
        state.preemption_sync_manager = None
    if state.client is not None:
        state.client.shutdown()  # returns once every process has called it
        state.client = None
    time.sleep(LEAVE_GRACE_S)
    os._exit(exit_code)
