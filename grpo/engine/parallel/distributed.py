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
