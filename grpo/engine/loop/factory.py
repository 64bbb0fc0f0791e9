"""The one place a run's mode is chosen: a rollout source x a weight sync.

=========================================  =========================  ===================
mode                                       source                     weight sync
=========================================  =========================  ===================
synchronous                                :class:`InlineSource`      :class:`SameDevices`
asynchronous, one process                  :class:`BackgroundSource`  :class:`OtherMesh`
... with ``train.async.partial_rollouts``  :class:`PartialSource`     :class:`OtherMesh`
asynchronous, by processes (update side)   :class:`ProcessLink`       the same link
=========================================  =========================  ===================

The rollout processes of a run split by processes (any number a side) run the link's far
end (:class:`~grpo.engine.loop.processes.RolloutSide`) in place of the loop.
"""

from __future__ import annotations

from typing import Any

from grpo.engine.loop.loop import Loop
from grpo.engine.loop.processes import ProcessLink, RolloutSide, side_exchange
from grpo.engine.loop.sources import BackgroundSource, InlineSource, PartialSource
from grpo.engine.loop.sync import OtherMesh, SameDevices


def processes(meshes: Any) -> int:
    """The processes holding an asynchronous run's devices (over 1: split by processes)."""
    return len({d.process_index for side in (meshes.rollout, meshes.update) for d in side.mesh.devices.flat})


def build_loop(trainer: Any, rollout_programs: Any) -> Loop | RolloutSide:
    """The trainer's loop for its config: ``rollout_programs`` are the rollout side's
    (the trainer's own when synchronous); ``trainer.collector`` draws on them, with the
    engine (``trainer.collector.sampler``) the weight sync hands the weights to."""
    engine = trainer.collector.sampler
    if trainer.meshes is None:
        return Loop(trainer, InlineSource(trainer.collector), SameDevices(engine), max_staleness=None)
    cfg = trainer.config.train.async_
    if processes(trainer.meshes) > 1:
        exchange = side_exchange(trainer)
        if exchange.name == "rollout":
            return RolloutSide(trainer, exchange, rollout_programs)
        link = ProcessLink(trainer, exchange)
        return Loop(trainer, link, link, max_staleness=cfg.max_staleness)
    kind = PartialSource if cfg.partial_rollouts else BackgroundSource
    source = kind(trainer.collector, update=trainer.programs, max_staleness=cfg.max_staleness)
    return Loop(trainer, source, OtherMesh(rollout_programs, engine, trainer.params, trainer.frozen),
                max_staleness=cfg.max_staleness)


__all__ = ["build_loop", "processes"]
