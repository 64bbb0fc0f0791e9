"""Rows of a batch-sharded array: each process holds its own slice of the rows
(JAX's multi-controller model), and the programs take one global array.

``to_global`` makes the global array from every process's local rows; ``local_rows``
hands a process back the rows it owns, in global row order; ``row_range`` reads a given
range of global rows from the shards this process holds (evaluation, whose batches need
not shard the way a training step's do). On one process all three are plain conversions.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding


def to_global(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The global array whose rows are every process's ``local`` rows, in process order
    (every process of ``sharding``'s mesh).

    When ``sharding`` does not split the rows by process (replicated rows, or rows over
    mesh axes inside a host only: e.g. 12 prompts of two processes prefilled over a
    divisor of the batch axes), each process needs rows it does not own; they are
    gathered from every process first (host arrays: prompts, rewards)."""
    from grpo.engine.parallel.mesh import mesh_processes

    # The processes holding the mesh (in a two-process async run, the rollout side's own).
    processes = mesh_processes(sharding.mesh)[1] if jax.process_count() > 1 else 1
    if processes > 1:
        rows = local.shape[0] * processes
        index = sharding.addressable_devices_indices_map((rows,) + tuple(local.shape[1:]))
        blocks = {(i[0].indices(rows)[:2] if i else (0, rows)) for i in index.values()}
        if sum(b - a for a, b in blocks) != local.shape[0]:
            from jax.experimental import multihost_utils

            full = np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))
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


__all__ = ["local_rows", "row_range", "to_global"]
