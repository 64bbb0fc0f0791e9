"""The loop's buffer: the record every rollout source yields (:class:`Buffered`), the
staleness refusal, and the one checkpoint format of the rollouts drawn and not yet
trained.

Every buffered rollout records the version that drew it; the update refuses groups
staler than ``m = max_staleness`` (exactly zero advantage: no gradient;
``async/refused_groups``).

The checkpoint format (one for every mode): the entries' structure goes into the
checkpoint's JSON metadata (``meta["async"]["entries"]``, one :func:`encode` spec an
entry), their arrays into one Orbax item (``buffer``), named ``s<step>_<name>`` and held
as host arrays that every process holds alike (Orbax writes numpy arrays and the JSON
from the primary process; every process reads them back). An array that was a device
array keeps its partition spec in the spec, and comes back onto the update mesh by the
one placement rule (:func:`placed`): batch-sharded over the update's rows when its rows
divide, replicated otherwise, which is where the loop moved it when it was drawn.
Host-only extras of process 0 (the logged sample group) are kept on process 0 only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo.engine.rollout.step import StepRollout


class RolloutFailed(RuntimeError):
    """The rollout side failed: the run stops with what failed and where."""


@dataclasses.dataclass
class Buffered:
    """A rollout waiting for its update: the step it trains at, the data position its
    prompts start at, and each row's policy version ([B] host ints)."""

    step: int
    position: int
    versions: np.ndarray
    rollout: StepRollout
    # Partial rollouts: each token's version [B, N] (host, -1 off the mask; ``versions`` is
    # then each row's oldest) and the batch's groups' data positions.
    token_versions: np.ndarray | None = None
    positions: list[int] | None = None


def staleness(*, step: int, versions: np.ndarray) -> np.ndarray:
    """Optimizer steps each row's policy lags the policy training at ``step`` ([B])."""
    return step - np.asarray(versions, np.int64)


def accepted_groups(*, step: int, versions: np.ndarray, max_staleness: int, group_size: int) -> np.ndarray:
    """[G] bool: the groups whose every row is at most ``max_staleness`` steps stale.
    ``versions`` [G*K], group-major. A group is refused whole: its advantages are
    relative to its own rows, so a partial group would bias them."""
    ok = staleness(step=step, versions=versions) <= max_staleness  # G*K
    return ok.reshape(-1, group_size).all(axis=1)  # G


def refuse(advantages: jax.Array, accepted: np.ndarray, *, group_size: int) -> jax.Array:
    """``advantages`` ([B] or [B, N]) with the refused groups' rows exactly zero."""
    rows = jnp.asarray(np.repeat(accepted, group_size))  # B
    rows = rows if advantages.ndim == 1 else rows[:, None]
    return jnp.where(rows, advantages, jnp.zeros_like(advantages))


# The records a checkpointed buffer is made of, by name (nothing else is rebuilt).
def _record_types() -> dict[str, type]:
    from grpo.engine.rollout.sampler import RolloutOutput
    from grpo.engine.rollout.step import SampleGroup, ToolTotals

    return {cls.__name__: cls for cls in (Buffered, StepRollout, RolloutOutput, SampleGroup, ToolTotals)}


def encode(value: Any, arrays: dict[str, Any], memo: dict[int, str]) -> Any:
    """``value`` as JSON, its arrays moved into ``arrays`` (named by index; an array met
    twice, like ``logged_rewards is rewards``, stored once and restored as one object).
    Every tagged node is a one-key dict, so a record's own dicts never read as tags."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        if id(value) not in memo:
            memo[id(value)] = name = str(len(arrays))
            arrays[name] = np.asarray(value) if isinstance(value, np.generic) else value
        x, name = value, memo[id(value)]
        leaf = {"name": name, "shape": list(np.shape(x)), "dtype": str(x.dtype)}
        if isinstance(x, jax.Array):
            leaf["spec"] = [list(a) if isinstance(a, tuple) else a for a in getattr(x.sharding, "spec", P())]
        else:
            leaf["kind"] = "scalar" if isinstance(x, np.generic) else "numpy"
        return {"array": leaf}
    if dataclasses.is_dataclass(value) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        name = type(value).__name__
        if _record_types().get(name) is not type(value):
            raise TypeError(f"async GRPO: cannot checkpoint a buffered {name}")
        fields = ([f.name for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value)
                  else list(value._fields))
        return {"record": [name, {f: encode(getattr(value, f), arrays, memo) for f in fields}]}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [encode(v, arrays, memo) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: encode(v, arrays, memo) for k, v in value.items()}}
    raise TypeError(f"async GRPO: cannot checkpoint a buffered {type(value).__name__}")


def leaves(spec: Any):
    """The array leaves of an :func:`encode` spec."""
    if isinstance(spec, dict):
        if "array" in spec:
            yield spec["array"]
            return
        for v in spec.values():
            yield from leaves(v)
    elif isinstance(spec, list):
        for v in spec:
            yield from leaves(v)


def like(spec: Any, mesh: Any) -> dict[str, Any]:
    """What Orbax restores an :func:`encode`'s arrays into: device arrays as
    ``ShapeDtypeStruct``s in their saved sharding on ``mesh``, host arrays as numpy."""
    out = {}
    for leaf in leaves(spec):
        shape, dtype = tuple(leaf["shape"]), jnp.dtype(leaf["dtype"])
        if "spec" in leaf:
            sharding = NamedSharding(mesh, P(*[tuple(a) if isinstance(a, list) else a for a in leaf["spec"]]))
            out[leaf["name"]] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        else:
            out[leaf["name"]] = np.zeros(shape, dtype)
    return out


def decode(spec: Any, arrays: dict[str, Any]) -> Any:
    """The value :func:`encode` described, with its arrays from ``arrays``."""
    if not isinstance(spec, dict):
        return spec
    (tag, body), = spec.items()
    if tag == "array":
        x = arrays[body["name"]]
        return np.asarray(x)[()] if body.get("kind") == "scalar" else x
    if tag == "record":
        name, fields = body
        return _record_types()[name](**{f: decode(v, arrays) for f, v in fields.items()})
    if tag in ("list", "tuple"):
        return (list if tag == "list" else tuple)(decode(v, arrays) for v in body)
    return {k: decode(v, arrays) for k, v in body.items()}


def moved(value: Any, *, rows: NamedSharding, replicated: NamedSharding) -> Any:
    """``value``'s device arrays (through pytrees and dataclasses) on the other mesh: a
    batch-sharded array over ``rows`` (when its rows divide), anything else replicated."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: moved(getattr(value, f.name), rows=rows, replicated=replicated)
                                             for f in dataclasses.fields(value)})

    def move(x):
        if not isinstance(x, jax.Array):
            return x
        batched = _batched(x.shape, getattr(x.sharding, "spec", P()), rows)
        return jax.device_put(x, rows if batched else replicated)

    return jax.tree.map(move, value)


def _batched(shape: tuple, spec: Any, rows: NamedSharding) -> bool:
    """The one placement rule: an array batch-sharded where it was drawn goes over the
    update's rows when they divide its first dimension."""
    shards = int(np.prod([rows.mesh.shape[a] for a in rows.spec[0]]))
    return len(shape) > 0 and len(spec) > 0 and spec[0] is not None and shape[0] % shards == 0


def key(spec: Any, name: str) -> str:
    """An entry's array's name in an exchange or a checkpoint: ``s<step>_<name>``."""
    return f"s{spec['record'][1]['step']}_{name}"


def stored(entry: Buffered) -> tuple[Any, dict[str, np.ndarray]]:
    """``entry`` in the checkpoint format: its spec and its arrays on the host."""
    arrays: dict[str, Any] = {}
    spec = encode(entry, arrays, {})
    return spec, {k: np.asarray(v) for k, v in arrays.items()}


def host_like(specs: list[Any]) -> dict[str, np.ndarray]:
    """What Orbax restores the entries ``specs``' arrays into: host arrays, by :func:`key`."""
    return {key(e, leaf["name"]): np.zeros(tuple(leaf["shape"]), jnp.dtype(leaf["dtype"]))
            for e in specs for leaf in leaves(e)}


def placed(spec: Any, arrays: dict[str, np.ndarray], *, rows: NamedSharding, replicated: NamedSharding) -> Buffered:
    """An entry decoded onto the update mesh from its host arrays: the arrays that were
    device arrays batch-sharded over ``rows`` (when their rows divide), other device
    arrays ``replicated``, host arrays as they are."""
    out = {}
    for leaf in leaves(spec):
        x = arrays[leaf["name"]]
        if "spec" in leaf:
            x = jax.device_put(x, rows if _batched(np.shape(x), leaf["spec"], rows) else replicated)
        out[leaf["name"]] = x
    return decode(spec, out)


def keep_inflight(items: dict[str, Any], meta: dict[str, Any],
                  inflight: tuple[dict[str, Any], dict[str, np.ndarray]] | None) -> None:
    """A partial-rollouts stream's rows in flight (its snapshot: JSON, host arrays) into a
    checkpoint's ``items`` (the Orbax item ``inflight``, in the same step as the params)
    and ``meta`` (``meta["async"]["inflight"]``: the JSON and each array's shape and
    dtype, what :func:`read_inflight` restores into); nothing for None."""
    if inflight is None:
        return
    rows_meta, rows = inflight
    items["inflight"] = rows
    meta["async"]["inflight"] = {"meta": rows_meta, "arrays": {
        name: [list(np.shape(x)), str(np.asarray(x).dtype)] for name, x in rows.items()}}


def read_inflight(meta: dict[str, Any], read: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """What :func:`keep_inflight` kept (``read(name, like)``: Orbax's restore of the item
    ``name`` into ``like``), or None: the checkpoint holds no rows in flight."""
    saved = (meta.get("async") or {}).get("inflight")
    if saved is None:
        return None
    like = {name: np.zeros(tuple(shape), np.dtype(dtype)) for name, (shape, dtype) in saved["arrays"].items()}
    return saved["meta"], read("inflight", like)


__all__ = ["Buffered", "RolloutFailed", "accepted_groups", "decode", "encode", "host_like", "keep_inflight", "key",
           "leaves", "like", "moved", "placed", "read_inflight", "refuse", "staleness", "stored"]
