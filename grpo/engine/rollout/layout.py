"""Where the rollout programs run: the training layout, or a rollout style's own.

A rollout style either leaves the rollout on the training layout (``legacy``,
``maxtext``: the parameters as they are, the batch over the style's ``batch_axes``) or
gives it a :class:`~grpo.core.contracts.RolloutLayout` (``serving``): a mesh over the same
devices *in the same order*, reshaped, with its own parameter, activation and KV-cache
rules. Then the policy is resharded into it once per step (:meth:`RolloutPlacement.
reshard`, one jitted identity with ``out_shardings``), decoded there, and the copy
dropped. Because the two meshes list the same devices in the same order, arrays on
either can meet in one jitted program (rollout outputs go back to the update's layout by
a jitted identity too), on one process or many.

Picking among several candidate layouts (``tensor_parallel: auto``) is a roofline of one
decode step per chip (:func:`grpo.engine.planning.costs.decode_step_estimate`), by the
cost model ``grpo plan`` states: ``max(compute, HBM, ICI)`` where HBM is the weights a
chip holds (``1/tp`` of the matmul weights; the KV projections and the KV cache of its
rows over the mesh's ``tp`` axis only, ``gcd(tp, KV heads)`` ways), and ICI is two
all-reduces of ``[rows, hidden]`` per layer (the attention and MLP outputs,
``2 (tp-1)/tp`` of the buffer into each chip, at half the chip's bidirectional ICI
figure). A candidate fits when the resident training state, the resharded copy and its
KV cache fit in the chip's HBM. Without chip figures (CPU, GPU) the smallest valid ``tp``
is taken: no per-layer collectives at all.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo.core.contracts import ModelDims, RolloutLayout
from grpo.engine.planning.costs import decode_step_estimate
from grpo.sharding import ACTIVATION_RULES, fit_sharding, mesh_axes, with_batch_axes


def rollout_mesh(train_mesh: Mesh, sizes: Any) -> Mesh:
    """The training mesh's devices, in the same flat order, reshaped to ``sizes``'s
    (dp, fsdp[, ep], tp). Devices are ordered host-major, so a trailing ``tp`` that divides a
    host's device count stays inside a host."""
    devices = np.asarray(train_mesh.devices).reshape(-1)
    return Mesh(devices.reshape(tuple(sizes.shape.values())), sizes.axis_names)


def state_shardings(state: Any, mesh: Mesh, rules: Mapping[str, Any]) -> Any:
    """An ``nnx.State`` like ``state`` whose leaves are the ``NamedSharding`` of each
    parameter under ``rules`` on ``mesh``, by the logical names in its ``out_sharding``
    metadata (every parameter of the decoder, LoRA adapters and QLoRA codes carry them)."""
    flat = []
    for path, var in nnx.to_flat_state(state):
        names = var.get_metadata().get("out_sharding")
        value = var.get_value()
        if names is None or len(names) != len(value.shape):
            raise ValueError(f"parameter {'.'.join(map(str, path))} has no logical axis names to reshard by")
        flat.append((path, var.replace(fit_sharding(value.shape, names, mesh, rules))))
    return nnx.from_flat_state(flat)


@dataclasses.dataclass
class RolloutPlacement:
    """The mesh and rules of the rollout programs.

    ``layout`` is None on the training layout (``param_rules`` None: nothing is
    resharded; the sampler reads the training arrays)."""

    mesh: Mesh
    batch_axes: tuple[str, ...]
    activation_rules: dict
    cache_rules: dict
    param_rules: dict | None = None
    layout: RolloutLayout | None = None
    estimates: dict | None = None  # tensor_parallel -> costs.decode_step_estimate (auto's choice)
    _reshard: Any = None

    @classmethod
    def training(cls, mesh: Mesh, batch_axes: Sequence[str]) -> "RolloutPlacement":
        batch_axes = mesh_axes(batch_axes, mesh)  # "ep" only on a mesh with expert parallelism
        rules = with_batch_axes(ACTIVATION_RULES, batch_axes)
        return cls(mesh=mesh, batch_axes=tuple(batch_axes), activation_rules=rules, cache_rules=rules)

    @classmethod
    def of_layout(cls, train_mesh: Mesh, layout: RolloutLayout, estimates: dict | None = None) -> "RolloutPlacement":
        activation = with_batch_axes(layout.activation_rules, layout.batch_axes)
        cache = activation if layout.cache_rules is None else with_batch_axes(layout.cache_rules, layout.batch_axes)
        return cls(
            mesh=rollout_mesh(train_mesh, layout.mesh), batch_axes=tuple(layout.batch_axes),
            activation_rules=activation, cache_rules=cache, param_rules=dict(layout.param_rules), layout=layout,
            estimates=estimates,
        )

    @property
    def resharded(self) -> bool:
        return self.param_rules is not None

    @property
    def tensor_parallel(self) -> int:
        return self.layout.tensor_parallel if self.layout is not None else int(self.mesh.shape["tp"])

    def shardings(self, state: Any) -> Any:
        """The rollout shardings of the sampler state ``state`` (concrete or abstract)."""
        return state_shardings(state, self.mesh, self.param_rules or {})

    def reshard_jit(self, state: Any, fn: Any = None) -> Any:
        """The jitted ``fn`` (default: the identity) with the rollout shardings of
        ``state`` as ``out_shardings``: the once-per-step reshard (cached; one program)."""
        if self._reshard is None:
            self._reshard = jax.jit(fn or (lambda s: s), out_shardings=self.shardings(state))
        return self._reshard

    def describe(self) -> dict[str, Any]:
        out = {
            "mesh": {k: int(v) for k, v in self.mesh.shape.items()},
            "batch_axes": list(self.batch_axes),
            "tensor_parallel": self.tensor_parallel,
            "resharded": self.resharded,
        }
        if self.estimates:
            out["candidates"] = {str(k): v for k, v in self.estimates.items()}
        return out

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


# --------------------------------------------------------------------------- auto


def choose_layout(
    candidates: Sequence[RolloutLayout],
    dims: ModelDims,
    *,
    rows: int,
    chip: Any = None,
    **estimate: Any,
) -> tuple[RolloutLayout, dict | None]:
    """The candidate to run among those whose shards divide ``rows``: with ``chip``
    figures the fastest that fits (the smallest-memory one when none fits), without them
    the first (the smallest tensor parallelism); returns it and every candidate's
    estimate (None without a chip)."""
    usable = [c for c in candidates if rows % c.shards == 0]
    if not usable:
        raise ValueError("no candidate layout splits the rollout batch")
    if chip is None:
        return usable[0], None
    est = {c.tensor_parallel: decode_step_estimate(c, dims, rows=rows, chip=chip, **estimate) for c in usable}
    fitting = [c for c in usable if est[c.tensor_parallel]["fits"]]
    if fitting:
        best = min(fitting, key=lambda c: (est[c.tensor_parallel]["step_s"], c.tensor_parallel))
    else:
        best = min(usable, key=lambda c: est[c.tensor_parallel]["memory_bytes"])
    return best, est


def state_bytes(state: Any) -> float:
    """Bytes of every leaf of ``state`` once (unsharded)."""
    from grpo.models import quant

    return float(sum(
        (math.prod(leaf.shape) * quant.bits_per_element(leaf.dtype) + 7) // 8 for leaf in jax.tree.leaves(state)
    ))


__all__ = [
    "RolloutPlacement", "choose_layout", "rollout_mesh", "state_bytes", "state_shardings",
]
