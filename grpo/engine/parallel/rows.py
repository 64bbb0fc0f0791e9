"""Rows of a batch-sharded array: each process holds its own slice of the rows
(JAX's multi-controller model), and the programs take one global array.

``to_global`` makes the global array from every process's local rows; ``local_rows``
hands a process back the rows it owns, in global row order; ``row_range`` reads a given
range of global rows from the shards this process holds (evaluation, whose batches need
not shard the way a training step's do). On one process all three are plain conversions.

The gathers are over the processes that hold the mesh's devices, not over the run's:
in a multi-process asynchronous run each side is a group of processes that runs its own
programs (:mod:`grpo.engine.loop.processes`), so a side's host code gathers over its
own processes alone (``gather_processes``, ``host_value``: one small program over the
side's devices; ``multihost_utils.process_allgather`` when the mesh spans every process).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def _owners(devices) -> list[int]:
    return sorted({d.process_index for d in devices})


@functools.lru_cache(maxsize=None)
def _replicate(sharding: NamedSharding):
    """A program that makes an array on ``sharding``'s mesh whole on every device."""
    return jax.jit(lambda x: x, out_shardings=NamedSharding(sharding.mesh, P()))


def gather_processes(local, mesh: Mesh, *, tiled: bool = False) -> np.ndarray:
    """``multihost_utils.process_allgather(local, tiled=tiled)`` over the processes that
    hold ``mesh``'s devices (in process order), on every one of them: a collective of
    those processes alone (the others may run programs of their own meanwhile). Each
    process's ``local`` has the same shape and dtype."""
    local = np.asarray(local)
    owners = _owners(mesh.devices.flat)
    if len(owners) == 1:
        return local if tiled else local[None]
    if len(owners) == jax.process_count():
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(local, tiled=tiled))
    first: dict[int, jax.Device] = {}
    for d in sorted(mesh.devices.flat, key=lambda d: (d.process_index, d.id)):
        first.setdefault(d.process_index, d)
    sharding = NamedSharding(Mesh(np.array([first[p] for p in owners], dtype=object), ("p",)), P("p"))
    x = jax.make_array_from_single_device_arrays(
        (len(owners),) + local.shape, sharding, [jax.device_put(local[None], first[jax.process_index()])])
    full = np.asarray(_replicate(sharding)(x).addressable_data(0))
    return full.reshape((-1,) + local.shape[1:]) if tiled and local.ndim else full


def host_value(x) -> np.ndarray:
    """The whole value of ``x`` on this process's host: a device array whose shards span
    other processes is made whole over its own mesh's processes first (a collective of
    those processes); anything else as it is."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    if not isinstance(x.sharding, NamedSharding):
        raise TypeError(f"host_value needs a NamedSharding array, not {x.sharding}")
    return np.asarray(_replicate(x.sharding)(x).addressable_data(0))


def to_global(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The global array whose rows are every process's ``local`` rows, in process order
    (every process of ``sharding``'s mesh).

    When ``sharding`` does not split the rows by process (replicated rows, or rows over
    mesh axes inside a host only: e.g. 12 prompts of two processes prefilled over a
    divisor of the batch axes), each process needs rows it does not own; they are
    gathered from every process first (host arrays: prompts, rewards)."""
    from grpo.engine.parallel.mesh import mesh_processes

    # The processes holding the mesh (split by processes: its side's own).
    processes = mesh_processes(sharding.mesh)[1] if jax.process_count() > 1 else 1
    if processes > 1:
        rows = local.shape[0] * processes
        index = sharding.addressable_devices_indices_map((rows,) + tuple(local.shape[1:]))
        blocks = {(i[0].indices(rows)[:2] if i else (0, rows)) for i in index.values()}
        if sum(b - a for a, b in blocks) != local.shape[0]:
            full = gather_processes(local, sharding.mesh, tiled=True)
            return jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])
    return jax.make_array_from_process_local_data(sharding, local)


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in global row order."""
    if jax.process_count() == 1:
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    rows, seen = [], set()
    for s in shards:
        start = s.index[0].start or 0
        if start in seen:  # replicated over other mesh axes
            continue
        seen.add(start)
        rows.append(np.asarray(s.data))
    return np.concatenate(rows, axis=0)


def row_range(x: jax.Array, rows: slice) -> np.ndarray:
    """Global rows ``rows.start:rows.stop`` of ``x`` (leading dimension: rows), read from
    this process's own shards: they must hold every one of them (a batch sharded
    host-major over the processes, or replicated), which a :class:`RuntimeError` says
    when not."""
    start, stop, _ = rows.indices(x.shape[0])
    if jax.process_count() == 1:
        return np.asarray(x)[start:stop]
    out = np.empty((stop - start,) + tuple(x.shape[1:]), dtype=x.dtype)
    have = np.zeros(stop - start, bool)
    for s in x.addressable_shards:
        a, b, _ = s.index[0].indices(x.shape[0]) if s.index else (0, x.shape[0], 1)
        lo, hi = max(a, start), min(b, stop)
        if lo >= hi or have[lo - start : hi - start].all():
            continue
        # A shard holds its rows whole: the other dimensions are never split over processes
        # for row data (at most replicated or split within this process's shards).
        data = np.asarray(s.data)
        if data.shape[1:] != out.shape[1:]:
            raise RuntimeError(f"row_range needs whole rows; shard {s.index} of {x.shape} splits them")
        out[lo - start : hi - start] = data[lo - a : hi - a]
        have[lo - start : hi - start] = True
    if not have.all():
        raise RuntimeError(
            f"process {jax.process_index()} holds rows {np.flatnonzero(~have)[:8] + start} of the requested "
            f"{start}:{stop} of a {x.shape} array in no shard ({x.sharding})"
        )
    return out


__all__ = ["gather_processes", "host_value", "local_rows", "row_range", "to_global"]
