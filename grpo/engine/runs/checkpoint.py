"""Orbax checkpoints: params, optimizer state, step, data position, RNG, run metadata.

Each checkpoint is one Orbax step directory under ``RUN_DIR/checkpoints`` holding one
PyTree item per piece of state (``params``, ``opt_state``; arrays restored straight into
their shardings) and a ``meta`` JSON (step, data position, seed, counters). Items are
separate so a consumer restores only what it needs (``grpo export`` reads ``params``
and never allocates optimizer moments).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from grpo.engine.runs import rundir

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int):
        # Local paths absolute; gs:// and s3:// kept as URLs (Orbax writes them through
        # epath for its metadata and TensorStore's cloud drivers for the arrays).
        self.directory = rundir.path(directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, items: dict[str, Any], meta: dict[str, Any]) -> None:
        args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
        self._manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args), force=True)
        self._manager.wait_until_finished()

    def restore(self, like: dict[str, Any], step: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore the items named in ``like`` into its structure, dtypes and shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        args = {name: ocp.args.StandardRestore(_abstract(tree)) for name, tree in like.items()}
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **args))
        return {name: out[name] for name in like}, dict(out["meta"])

    def close(self) -> None:
        self._manager.close()


def _abstract(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        tree,
    )
