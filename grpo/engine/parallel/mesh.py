"""Building the real ``jax.sharding.Mesh`` from a resolved layout."""

from __future__ import annotations

import collections
import logging
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from grpo.core.contracts import MeshLayout, Topology

log = logging.getLogger(__name__)


def current_topology(devices: Sequence[jax.Device] | None = None) -> Topology:
    """The topology of this JAX runtime (all processes)."""
    devices = list(devices if devices is not None else jax.devices())
    per_process = collections.Counter(d.process_index for d in devices)
    counts = tuple(per_process[p] for p in sorted(per_process))
    return Topology(
        process_count=len(counts),
        local_device_count=counts[jax.process_index()] if jax.process_index() < len(counts) else counts[0],
        devices_per_process=counts,
        platform=getattr(devices[0], "platform", "unknown"),
    )


def mesh_processes(mesh: Mesh) -> tuple[int, int]:
    """``(rank, count)``: this process's place among the processes holding ``mesh``'s
    devices, and how many they are. The run's processes when the mesh spans them all
    (``jax.process_index()``, ``jax.process_count()``); ``(0, 1)`` for a mesh on this
    process's devices alone (the rollout mesh of a multi-process asynchronous run, whose
    host side runs as if it were the only process)."""
    owners = sorted({d.process_index for d in mesh.devices.flat})
    me = jax.process_index()
    return (owners.index(me) if me in owners else 0), len(owners)


def ordered_devices(devices: Sequence[jax.Device]) -> list[jax.Device]:
    """Host-major, then device id: reshaping to (dp, fsdp[, ep], tp) keeps the trailing axes
    inside a host whenever they fit there."""
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def build_mesh(layout: MeshLayout, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if layout.size != len(devices):
        raise ValueError(f"mesh {layout.shape} needs {layout.size} devices, got {len(devices)}")
    shape = tuple(layout.shape.values())
    topo = current_topology(devices)
    if topo.process_count == 1 and devices[0].platform == "tpu":
        # Physical-topology-aware order (ICI rings) on a single TPU slice.
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    else:
        grid = np.array(ordered_devices(devices), dtype=object).reshape(shape)
    for w in layout.warnings:
        log.warning(w)
    return Mesh(grid, layout.axis_names)
