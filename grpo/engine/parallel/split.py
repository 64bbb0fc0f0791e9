"""The two meshes of asynchronous GRPO (``train.async``): the devices split into a
rollout mesh (the first ``train.async.rollout_devices``, laid out by the rollout style)
and an update mesh (the rest, in the training layout).

The split is inside one process. Several processes are refused, with a config error
naming ``train.async.rollout_devices`` (exit status 2) that says which of two cases it is:

- a split that is not by whole processes (a process with devices on both sides): its
  host would score rollouts and train at once, and a ``device_put`` between processes
  works only between equal shardings (JAX 0.10.2 on CPU with
  ``jax_cross_host_transfer_socket_address`` set; a resharding transfer fails with
  "Cannot reshard an input that is not fully addressable"), so this is not planned;
- a split by whole processes (e.g. 2 processes x 4 devices, ``rollout_devices: 4``): the
  cross-process move it needs exists and is tested
  (:class:`~grpo.engine.parallel.exchange.SideExchange`: one program over both sides'
  devices swaps the weights and the rollouts, with a stop flag and failures), but the
  trainer does not run it yet: each side's loop (the rollout side's host scoring as if
  it were alone, the update side's logs and checkpoints, Orbax saving with processes
  that hold different state) is still to be built.
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


def _multiprocess_refusal(devices: list, r: int) -> str:
    """Why a split of several processes' devices (host-major ``devices``) is refused: the
    message for :func:`split_devices`."""
    n = len(devices)
    rollout = sorted({d.process_index for d in devices[:r]})
    update = sorted({d.process_index for d in devices[r:]})
    if set(rollout) & set(update):
        return (
            f"train.async.rollout_devices={r} does not split this run's {n} devices (of "
            f"{len(set(rollout) | set(update))} processes) by whole processes: a process would hold devices of both "
            f"the rollout and the update mesh, which asynchronous GRPO does not support. Asynchronous runs are "
            f"single-process in this version: run on one host, or set train.async.enabled=false."
        )
    return (
        f"train.async.rollout_devices={r} splits this run's {n} devices by whole processes (rollout: processes "
        f"{rollout}, update: processes {update}), but asynchronous GRPO does not run over several processes yet "
        f"(the cross-process exchange of weights and rollouts exists, the per-side loop does not). Run "
        f"asynchronously on one host, or set train.async.enabled=false."
    )


def split_devices(devices: Sequence[jax.Device], *, rollout_devices: int | None) -> tuple[list, list]:
    """``(rollout, update)`` devices: the first ``rollout_devices`` (None: half) of the
    host-major order and the rest; a side left without devices, or devices of several
    processes (see the module docstring), is a config error naming
    ``train.async.rollout_devices``."""
    devices = ordered_devices(devices)
    n = len(devices)
    r = n // 2 if rollout_devices is None else int(rollout_devices)
    if not 1 <= r < n:
        side = "update" if r >= n else "rollout"
        raise ConfigError(
            f"train.async.rollout_devices={r} leaves the {side} mesh without devices: this run has {n} devices, "
            f"and the rollout takes the first rollout_devices of them, the update the rest (give 1 to {n - 1}).",
        )
    if len({d.process_index for d in devices}) > 1:
        raise ConfigError(_multiprocess_refusal(devices, r))
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
