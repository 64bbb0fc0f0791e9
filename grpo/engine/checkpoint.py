"""Orbax checkpoints: params, optimizer state, step, data position, RNG, run metadata.

Each checkpoint is one Orbax step directory under ``RUN_DIR/checkpoints`` holding a
``state`` PyTree (arrays restored straight into their shardings) and a ``meta`` JSON
(step, data position, seed, metric history needed to resume bit-for-bit).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore(self, state_like: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore into the structure, dtypes and shardings of ``state_like``."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
            if hasattr(x, "shape")
            else x,
            state_like,
        )
        out = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self._manager.close()
