"""Logical axis names -> mesh axes.

Model, sampler and loss code speak only logical names; these tables map them to the
(dp, fsdp, tp) mesh axes (MaxText's logical-axis rules). Parameters and activations have
separate tables: parameters are FSDP-sharded over their large ``embed`` dimension and
tensor-parallel over heads/mlp/vocab; activations are batch-sharded over dp x fsdp.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

Rules = Mapping[str, "str | tuple[str, ...] | None"]

PARAM_RULES: dict[str, str | tuple[str, ...] | None] = {
    # The expert axis ep (present only with expert parallelism) is one more FSDP axis
    # for every parameter but the experts, which it splits by expert.
    "embed": ("fsdp", "ep"),
    "vocab": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "layers": None,
    "norm": None,
    # LoRA adapters: the rank axis takes fsdp where the matrix has no embed dim (B of
    # q/k/v/gate/up, A of o/down), so every adapter is split over the chips, not copied.
    "lora_rank": "fsdp",
    # Mixture-of-experts: the experts are split over the expert axis ep (replicated
    # without one); each expert's hidden width is tensor-parallel like a dense MLP's; the
    # router's output (one logit per expert) is small and replicated.
    "experts": "ep",
    "expert_mlp": "tp",
    "router_experts": None,
}

ACTIVATION_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("dp", "fsdp", "ep"),
    "length": None,
    "embed": None,
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "vocab": "tp",
    "cache_length": None,
}


DATA_AXES: tuple[str, ...] = ("dp", "fsdp", "ep")
"""The mesh axes the update's batch is split over (``ep`` only where the mesh has it)."""


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """:data:`DATA_AXES` that ``mesh`` has: ("dp", "fsdp"), plus "ep" with expert parallelism."""
    return tuple(a for a in DATA_AXES if a in mesh.shape)


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """PartitionSpec for an array whose dims carry these logical names (None: replicated).

    A mesh axis is used at most once per array: a later dim that maps to an axis already
    taken is replicated instead (e.g. a square [embed, embed] weight).
    """
    used: set[str] = set()
    out = []
    for name in names:
        axes = rules.get(name) if name is not None else None
        if axes is None:
            out.append(None)
            continue
        tup = (axes,) if isinstance(axes, str) else tuple(axes)
        tup = tuple(a for a in tup if a not in used)
        used.update(tup)
        out.append(tup[0] if len(tup) == 1 else (tup or None))
    return PartitionSpec(*out)


def with_batch_axes(rules: Rules, batch_axes: Sequence[str]) -> dict:
    """Activation rules with the batch dimension over ``batch_axes`` (a rollout style's)."""
    out = dict(rules)
    out["batch"] = tuple(batch_axes) or None
    return out


def mesh_axes(axes: Sequence[str], mesh: Mesh) -> tuple[str, ...]:
    """``axes`` without those ``mesh`` does not have (``ep`` without expert parallelism)."""
    return tuple(a for a in axes if a in mesh.shape)


# --------------------------------------------------------------------------- concrete shapes
# Every sharded dimension must divide evenly over its mesh axes. A dimension that does not
# (e.g. 2 KV heads on tp=4, a 320-token vocab on tp=3) is replicated instead of refused:
# always numerically correct (XLA inserts whatever communication a layout needs), it only
# costs memory, so it is logged once per shape.

_warned: set[tuple] = set()


def fit_spec(
    shape: Sequence[int],
    names: Sequence[str | None],
    mesh: Mesh,
    rules: Mapping[str, "str | tuple[str, ...] | None"],
) -> PartitionSpec:
    """The PartitionSpec of ``rules`` for an array of ``shape`` on ``mesh``.

    Mesh axes the mesh does not have are dropped; a dimension that does not divide evenly
    over its mesh axes is sharded over the longest leading part of them it divides (e.g.
    12 prompts over ``("dp", "fsdp")`` of sizes 2 x 8: over ``dp`` only), replicated when
    there is none (logged once).
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
            continue
        fitted = tup
        while fitted and dim % math.prod(mesh.shape[a] for a in fitted):
            fitted = fitted[:-1]  # the longest leading part of the axes that divides
        if fitted != tup:
            key = (tuple(shape), tuple(names), tup)
            if key not in _warned:
                _warned.add(key)
                log.warning(
                    "dimension %r of size %d does not divide over mesh axes %s (size %d); "
                    "%s for shape %s",
                    name, dim, tup, size,
                    f"sharding it over {fitted} only" if fitted else "replicating it", tuple(shape),
                )
        out.append(None if not fitted else fitted[0] if len(fitted) == 1 else fitted)
    return PartitionSpec(*out)


def fit_sharding(
    shape: Sequence[int],
    names: Sequence[str | None],
    mesh: Mesh,
    rules: Mapping[str, "str | tuple[str, ...] | None"],
) -> NamedSharding:
    return NamedSharding(mesh, fit_spec(shape, names, mesh, rules))
