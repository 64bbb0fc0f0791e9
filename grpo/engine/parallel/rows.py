"""Rows of a batch-sharded array: each process holds its own slice of the rows
(JAX's multi-controller model), and the programs take one global array.

``to_global`` makes the global array from every process's local rows; ``local_rows``
hands a process back the rows it owns, in global row order. On one process both are
plain conversions.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding


def to_global(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The global array whose rows are every process's ``local`` rows, in process order.

    When ``sharding`` does not split the rows by process (replicated rows, or rows over
    mesh axes inside a host only: e.g. 12 prompts of two processes prefilled over a
    divisor of the batch axes), each process needs rows it does not own; they are
    gathered from every process first (host arrays: prompts, rewards)."""
    if jax.process_count() > 1:
        rows = local.shape[0] * jax.process_count()
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


__all__ = ["local_rows", "to_global"]
