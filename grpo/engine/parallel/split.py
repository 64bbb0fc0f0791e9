"""The two meshes of asynchronous GRPO (``train.async``): the devices split into a
rollout mesh (the first ``train.async.rollout_devices``, laid out by the rollout style)
and an update mesh (the rest, in the training layout).

The split is inside one process. Several processes are refused: with the installed JAX
(0.10.2) a ``device_put`` between devices of different processes is a cross-host
transfer, which needs the source and destination shardings to have the same HLO sharding
and a backend with cross-host transfers (TPU/GPU plugins) or a DCN socket address
(``jax_cross_host_transfer_socket_address``; measured on CPU with 2 processes x 4
devices: with it set, ``P('x')`` over one process's 4 devices to ``P('x')`` over the
other's arrives, while a resharding transfer is refused with "Cannot reshard an input
that is not fully addressable"). None of that is wired here, and a rollout on one
process's devices would leave the other process's host scoring without rows, and its
host gathers (``process_allgather`` over every process) would run in the rollout thread
in an order the other process's update thread does not share.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
from jax.sharding import Mesh

from grpo.core.contracts import MeshLayout, Topology
from grpo.core.errors import ConfigError, UserError
from grpo.engine.parallel.mesh import build_mesh, current_topology, ordered_devices


@dataclasses.dataclass(frozen=True)
class MeshSide:
    """One side of the split: its devices' topology, resolved layout and mesh."""

    topology: Topology
    layout: MeshLayout
    mesh: Mesh


@dataclasses.dataclass(frozen=True)
class AsyncMeshes:
    rollout: MeshSide
    update: MeshSide


def split_devices(devices: Sequence[jax.Device], *, rollout_devices: int | None) -> tuple[list, list]:
    """``(rollout, update)`` devices: the first ``rollout_devices`` (None: half) of the
    host-major order and the rest; a side left without devices, or devices of several
    processes, is a config error naming ``train.async.rollout_devices``."""
    devices = ordered_devices(devices)
    n = len(devices)
    r = n // 2 if rollout_devices is None else int(rollout_devices)
    if len({d.process_index for d in devices}) > 1:
        raise UserError(
            "train.async.enabled=true runs on one process only: splitting the devices of several processes into "
            "a rollout mesh and an update mesh needs cross-host transfers of the weights and the rollouts, which "
            "this version does not do; run asynchronously on one host, or set train.async.enabled=false."
        )
    if not 1 <= r < n:
        side = "update" if r >= n else "rollout"
        raise ConfigError(
            f"train.async.rollout_devices={r} leaves the {side} mesh without devices: this run has {n} devices, "
            f"and the rollout takes the first rollout_devices of them, the update the rest (give 1 to {n - 1}).",
        )
    return devices[:r], devices[r:]


def async_meshes(config, devices: Sequence[jax.Device] | None = None, *, plugins=None) -> AsyncMeshes:
    """The rollout and update meshes of ``config`` (``train.async.enabled``), each with
    the layout the config's mesh policy resolves for its devices and every
    topology-dependent check (batch divisible by the rollout shards, micro-batch by the
    update's dp x fsdp); a failing side's problems are reported under
    ``train.async.rollout_devices``."""
    from grpo.core.config import resolve_layout

    requested = config.train.async_.rollout_devices
    rollout, update = split_devices(list(devices if devices is not None else jax.devices()),
                                    rollout_devices=requested)
    sides = []
    for name, devs in (("rollout", rollout), ("update", update)):
        topology = current_topology(devs)
        try:
            layout = resolve_layout(config, topology, plugins=plugins)
        except UserError as err:
            problems = getattr(err, "problems", None) or [str(err)]
            raise ConfigError(
                f"train.async.rollout_devices={len(rollout)} (of {len(rollout) + len(update)} devices) gives "
                f"{'an' if name == 'update' else 'a'} {name} mesh of {len(devs)} devices that does not fit this config "
                f"(rollout.style={config.rollout.style}):", problems=problems,
            ) from None
        sides.append(MeshSide(topology=topology, layout=layout, mesh=build_mesh(layout, devs)))
    return AsyncMeshes(rollout=sides[0], update=sides[1])


__all__ = ["AsyncMeshes", "MeshSide", "async_meshes", "split_devices"]
