"""Logical axis names -> ``NamedSharding`` for concrete shapes.

:func:`grpo.engine.sharding.logical_to_spec` maps names to mesh axes; this module adds
the one thing a concrete array needs on top: every sharded dimension must divide evenly
over its mesh axes. A dimension that does not (e.g. 2 KV heads on tp=4, a 320-token vocab
on tp=3) is replicated instead of refused. That is always numerically correct — XLA's
SPMD partitioner inserts whatever communication a layout needs — it only costs memory,
so it is logged once per shape.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo.engine.sharding import logical_to_spec

log = logging.getLogger(__name__)

_warned: set[tuple] = set()


def fit_spec(
    shape: Sequence[int],
    names: Sequence[str | None],
    mesh: Mesh,
    rules: Mapping[str, "str | tuple[str, ...] | None"],
) -> PartitionSpec:
    """The PartitionSpec of ``rules`` for an array of ``shape`` on ``mesh``.

    Mesh axes the mesh does not have are dropped; dimensions that do not divide evenly
    over their mesh axes are replicated (logged once).
    """
    if len(shape) != len(names):
        raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    spec = logical_to_spec(names, rules)
    out: list[str | tuple[str, ...] | None] = []
    for dim, name, axes in zip(shape, names, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if axes is None:
            out.append(None)
            continue
        tup = (axes,) if isinstance(axes, str) else tuple(axes)
        tup = tuple(a for a in tup if a in mesh.shape and mesh.shape[a] > 1)
        size = math.prod(mesh.shape[a] for a in tup)
        if not tup:
            out.append(None)
        elif dim % size:
            key = (tuple(shape), tuple(names), tup)
            if key not in _warned:
                _warned.add(key)
                log.warning(
                    "dimension %r of size %d does not divide over mesh axes %s (size %d); "
                    "replicating it for shape %s",
                    name, dim, tup, size, tuple(shape),
                )
            out.append(None)
        else:
            out.append(tup[0] if len(tup) == 1 else tup)
    return PartitionSpec(*out)


def fit_sharding(
    shape: Sequence[int],
    names: Sequence[str | None],
    mesh: Mesh,
    rules: Mapping[str, "str | tuple[str, ...] | None"],
) -> NamedSharding:
    return NamedSharding(mesh, fit_spec(shape, names, mesh, rules))
