"""The two meshes of asynchronous GRPO (``train.async``): the devices split into a
rollout mesh (the first ``train.async.rollout_devices``, laid out by the rollout style)
and an update mesh (the rest, in the training layout).

The split is inside one process, or by whole processes: with 2 processes (e.g. 2 x 4
devices, ``rollout_devices: 4``) process 0's devices roll out and process 1's update, each
side running its own programs on its own devices and its host side as if it were alone,
and the two meet once a step in :class:`~grpo.engine.parallel.exchange.SideExchange`
(:mod:`grpo.engine.loop.processes`). Anything else over several processes is a
config error naming ``train.async.rollout_devices`` (exit status 2): a split that puts a
process on both sides (its host would score rollouts and train at once, and a
``device_put`` between processes works only between equal shardings: JAX 0.10.2 on CPU
with ``jax_cross_host_transfer_socket_address`` set; a resharding transfer fails with
"Cannot reshard an input that is not fully addressable"), or more than one process a
side. Features the two-process loop does not carry (:func:`multiprocess_problems`) are
config errors naming theirs.
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


def _sides_refusal(devices: list, r: int) -> str | None:
    """Why a split by whole processes is refused (more than one process a side), or None."""
    n = len(devices)
    rollout = sorted({d.process_index for d in devices[:r]})
    update = sorted({d.process_index for d in devices[r:]})
    if len(rollout) > 1 or len(update) > 1:
        return (
            f"train.async.rollout_devices={r} splits this run's {n} devices by whole processes (rollout: processes "
            f"{rollout}, update: processes {update}), but asynchronous GRPO over several processes runs one "
            f"process a side (2 processes). Run with 2 processes, or set train.async.enabled=false."
        )
    return None


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
    return _sides_refusal(devices, r)


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
        why = _whole_processes_refusal(devices, r)
        if why is not None:
            raise ConfigError(why)
    return devices[:r], devices[r:]


def multiprocess_problems(config) -> list[str]:
    """What a two-process asynchronous run does not carry, one line a field. The run is
    the one loop (:mod:`grpo.engine.loop`); what stays refused needs work beyond it:
    the LoRA base lives on the update process (it would have to cross once); the
    partial-rollouts stream and its ledger would live on the rollout process while the
    trained positions are known on the update side; the continuous engine's host side
    gathers over every process, not its mesh's; dynamic sampling's rounds gather rows
    over processes (unverified with one side a process); evaluation runs on the update
    side while process 0 writes its rows."""
    a, out = config.train.async_, []
    if config.model.lora is not None:
        out.append("model.lora is set: the two-process loop moves full weights only (no frozen base)")
    if a.partial_rollouts:
        out.append("train.async.partial_rollouts=true: the stream's in-flight rows do not cross processes")
    if config.rollout.engine != "static":
        out.append(f"rollout.engine={config.rollout.engine}: the two-process loop runs the static sampler")
    if config.train.dynamic_sampling.enabled:
        out.append("train.dynamic_sampling.enabled=true: not carried by the two-process loop")
    if config.eval.every_n_steps:
        out.append(f"eval.every_n_steps={config.eval.every_n_steps}: evaluation is not run by the two-process loop")
    return out


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
    if len({d.process_index for d in rollout + update}) > 1 and multiprocess_problems(config):
        raise ConfigError(
            f"train.async.rollout_devices={len(rollout)} splits the run by processes (process "
            f"{rollout[0].process_index} rolls out, process {update[0].process_index} updates), which this config "
            f"cannot run that way:", problems=multiprocess_problems(config),
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
        sides.append(MeshSide(topology=topology, layout=layout, mesh=build_mesh(layout, devs)))
    return AsyncMeshes(rollout=sides[0], update=sides[1])


__all__ = ["AsyncMeshes", "MeshSide", "async_meshes", "multiprocess_problems", "split_devices"]
