"""Logical axis names -> mesh axes.

Model, sampler and loss code speak only logical names; these tables map them to the
(dp, fsdp, tp) mesh axes (MaxText's logical-axis rules). Parameters and activations have
separate tables: parameters are FSDP-sharded over their large ``embed`` dimension and
tensor-parallel over heads/mlp/vocab; activations are batch-sharded over dp x fsdp.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Mapping[str, "str | tuple[str, ...] | None"]

PARAM_RULES: dict[str, str | tuple[str, ...] | None] = {
    "embed": "fsdp",
    "vocab": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "layers": None,
    "norm": None,
}

ACTIVATION_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("dp", "fsdp"),
    "length": None,
    "embed": None,
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "vocab": "tp",
    "cache_length": None,
}


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


def named_sharding(mesh: Mesh, names: Sequence[str | None], rules: Rules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules))


def with_batch_axes(rules: Rules, batch_axes: Sequence[str]) -> dict:
    """Activation rules with the batch dimension over ``batch_axes`` (a rollout style's)."""
    out = dict(rules)
    out["batch"] = tuple(batch_axes) or None
    return out
