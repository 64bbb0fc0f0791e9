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
        # Shapes first, from the stored metadata: a mismatch found by Orbax mid-restore leaves
        # its other reads failing on a closed event loop (pages of noise after the error).
        wrong = self.mismatches(like, step)
        if wrong:
            raise CheckpointMismatch("; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""))
        args = {name: ocp.args.StandardRestore(_abstract(tree)) for name, tree in like.items()}
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **args))
        return {name: out[name] for name in like}, dict(out["meta"])

    def mismatches(self, like: dict[str, Any], step: int) -> list[str]:
        """``"params.embed.value: stored (320, 64), requested (320, 32)"`` for each array of
        ``like`` whose stored shape differs; [] when they fit or when the stored metadata
        cannot be read (Orbax's own checks then apply, as they do to the tree's structure)."""
        out = []
        for name, tree in like.items():
            try:
                handler = ocp.StandardCheckpointHandler()
                try:
                    stored = _shapes(handler.metadata(self.directory / str(step) / name))
                finally:
                    handler.close()
            except Exception:  # noqa: BLE001 - an unreadable metadata file is Orbax's to report
                continue
            wanted = _shapes(tree)
            for path in sorted(set(stored) & set(wanted)):
                if stored[path] != wanted[path]:
                    out.append(f"{name}.{path}: stored {stored[path]}, requested {wanted[path]}")
        return out

    def close(self) -> None:
        self._manager.close()


class CheckpointMismatch(ValueError):
    """Stored arrays whose shapes do not fit the requested tree."""


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    # Plain flattening: NNX variable states have a `shape` too, but their arrays sit one
    # key deeper (`embed.value`), as Orbax stores them.
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(_key(k) for k in path): tuple(x.shape) for path, x in leaves if hasattr(x, "shape")}


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        tree,
    )
