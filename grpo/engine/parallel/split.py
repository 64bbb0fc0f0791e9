"""The two meshes of asynchronous GRPO (``train.async``): the devices split into a
rollout mesh (the first ``train.async.rollout_devices``, laid out by the rollout style)
and an update mesh (the rest, in the training layout).

The split is inside one process, or by whole processes, any number a side: with 4
processes x 4 devices and ``rollout_devices: 8``, processes 0 and 1 roll out and 2 and 3
update, each side running its own programs on its own devices and its host side over its
own processes (:mod:`grpo.engine.loop.processes`), and the two meet once a step in
:class:`~grpo.engine.parallel.exchange.SideExchange`. A split that puts a process on both
sides is a config error naming ``train.async.rollout_devices`` (exit status 2): its host
would score rollouts and train at once. Every feature runs over processes (LoRA/QLoRA,
the continuous engine, partial rollouts, dynamic sampling, evaluation, multi-turn tasks
on either engine) but model rewards (a config error naming ``task.model_rewards``);
:func:`check_split` is the one check, which ``grpo config validate --processes``,
``grpo plan --topology`` and the run all call.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

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


def _whole_processes_refusal(devices: list, r: int) -> str | None:
    """Why ``devices[:r]`` / ``devices[r:]`` is refused for splitting a process, or None."""
    n = len(devices)
    rollout = sorted({d.process_index for d in devices[:r]})
    update = sorted({d.process_index for d in devices[r:]})
    if set(rollout) & set(update):
        return (
            f"train.async.rollout_devices={r} does not split this run's {n} devices (of "
            f"{len(set(rollout) | set(update))} processes) by whole processes: a process would hold devices of both "
            f"the rollout and the update mesh, which asynchronous GRPO does not support: give the rollout whole "
            f"processes' devices (a multiple of {n // max(len(set(rollout) | set(update)), 1)}), or set "
            f"train.async.enabled=false."
        )
    return None


@dataclasses.dataclass(frozen=True)
class HostDevice:
    """A device as the split reads one, without a runtime (``grpo config validate
    --processes``, ``grpo plan --topology``): its process and id."""

    process_index: int
    id: int
    platform: str = "unknown"


def topology_devices(processes: int, local_devices: int) -> list[HostDevice]:
    """The devices of ``processes`` x ``local_devices``, as :func:`split_devices` reads them."""
    return [HostDevice(p, p * local_devices + i) for p in range(processes) for i in range(local_devices)]


def default_rollout_devices(devices: Sequence[Any]) -> int:
    """What ``train.async.rollout_devices: null`` means: half the devices; over several
    processes, the devices of the first half of the processes (whole processes)."""
    counts = collections.Counter(d.process_index for d in devices)
    if len(counts) == 1:
        return len(devices) // 2
    owners = sorted(counts)
    return sum(counts[p] for p in owners[: len(owners) // 2])


def split_devices(devices: Sequence[Any], *, rollout_devices: int | None) -> tuple[list, list]:
    """``(rollout, update)`` devices: the first ``rollout_devices`` (None:
    :func:`default_rollout_devices`) of the host-major order and the rest; a side left
    without devices, or a process on both sides (see the module docstring), is a config
    error naming ``train.async.rollout_devices``."""
    devices = ordered_devices(devices)
    n = len(devices)
    r = default_rollout_devices(devices) if rollout_devices is None else int(rollout_devices)
    if not 1 <= r < n:
        side = "update" if r >= n else "rollout"
        raise ConfigError(
            f"train.async.rollout_devices={r} leaves the {side} mesh without devices: this run has {n} devices, "
            f"and the rollout takes the first rollout_devices of them, the update the rest (give 1 to {n - 1}).",
        )
    if len({d.process_index for d in devices}) > 1:
        why = _whole_processes_refusal(devices, r)
        if why is not None:
            raise ConfigError(why)
    return devices[:r], devices[r:]


def check_split(config, devices: Sequence[Any], *, plugins=None) -> tuple[list, list, list[tuple[Topology, MeshLayout]]]:
    """The runtime's one check of ``config``'s split of ``devices`` (real ones, or
    :class:`HostDevice` s of a topology): ``(rollout, update, [(topology, layout) a
    side])``, each side laid out as the config's mesh policy resolves it for its devices
    with every topology-dependent check (batch divisible by the rollout shards,
    micro-batch by the update's dp x fsdp); a split that cannot run is a
    :class:`ConfigError` naming ``train.async.rollout_devices`` (or the features the
    multi-process loop does not carry: model rewards). ``grpo config
    validate --processes``, ``grpo plan --topology`` and the run call it alike, so they
    refuse the same splits with the same message."""
    from grpo.core.config import resolve_layout

    rollout, update = split_devices(list(devices), rollout_devices=config.train.async_.rollout_devices)
    if len({d.process_index for d in rollout + update}) > 1:
        from grpo.core.config.validate import model_reward_process_problems

        processes = len({d.process_index for d in rollout + update})
        problems = model_reward_process_problems(config, processes)
        if problems:
            procs = [sorted({d.process_index for d in side}) for side in (rollout, update)]
            raise ConfigError(
                f"train.async.rollout_devices={len(rollout)} splits the run by processes (processes {procs[0]} roll "
                f"out, processes {procs[1]} update), which this config cannot run that way:", problems=problems,
            )
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
        sides.append((topology, layout))
    return rollout, update, sides


def validate_split(config, processes: int, local_devices: int, *, plugins=None) -> None:
    """:func:`check_split` of ``config`` on ``processes`` x ``local_devices`` devices."""
    check_split(config, topology_devices(processes, local_devices), plugins=plugins)


def async_meshes(config, devices: Sequence[jax.Device] | None = None, *, plugins=None) -> AsyncMeshes:
    """The rollout and update meshes of ``config`` (``train.async.enabled``) as
    :func:`check_split` lays them out."""
    rollout, update, sides = check_split(config, list(devices if devices is not None else jax.devices()),
                                         plugins=plugins)
    built = [MeshSide(topology=t, layout=layout, mesh=build_mesh(layout, devs))
             for (t, layout), devs in zip(sides, (rollout, update))]
    return AsyncMeshes(rollout=built[0], update=built[1])


__all__ = ["AsyncMeshes", "HostDevice", "MeshSide", "async_meshes", "check_split", "default_rollout_devices",
           "split_devices", "topology_devices", "validate_split"]
