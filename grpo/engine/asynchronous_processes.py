"""Asynchronous GRPO over two processes: process 0's devices roll out, process 1's
update (``train.async.rollout_devices`` = process 0's device count, e.g. 4 of 2 x 4).

The same ``grpo run`` runs on both (JAX's multi-controller model) and builds the same
trainer; each process then plays its side. Programs whose devices are all the other
process's are not run here (and would do nothing if they were: JAX runs a program on the
processes holding its devices). The rollout side's host side (prompts, scoring, the
logged sample group) runs as if it were the only process, over its own mesh
(:func:`~grpo.engine.parallel.mesh.mesh_processes`).

The sides meet in :class:`~grpo.engine.parallel.exchange.SideExchange`, always both
at once and in the same order (``m = max_staleness``, ``s`` the step):

- at the start: the update side sends the weights (version ``s``) and the run's state
  (step, data position, counters); the rollout side draws the steps not yet buffered,
  ``s .. s + m - 1``, and sends them (an exchange only when there are some);
- step ``s`` with ``m = 0``: the rollout side draws step ``s`` at version ``s`` and sends
  it, then waits while the update side trains it (nothing overlaps: the run equals the
  one-process one);
- step ``s`` with ``m >= 1``: the update side trains step ``s`` while the rollout side
  draws step ``s + m`` at version ``s`` (on its own process: the two overlap);
- then one exchange: the new weights (version ``s + 1``), the step's metrics row and the
  state one way, the drawn rollout the other.

So both sides hold the same buffer at every checkpoint: the rollouts drawn and not yet
trained, as host arrays (the ones that crossed), which both processes hand Orbax alike
(process 0 writes them), with their structure in the checkpoint's JSON; a resumed run
trains them as drawn, with no group lost or drawn twice. Process 0 writes the logs,
samples and checkpoint metadata, as in every run, from the state the update side sends.
A failure on one side is sent in place of its next exchange, so the other side stops
with its message (:class:`~grpo.engine.parallel.exchange.RemoteFailure`) instead of
waiting.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from typing import Any

import jax
import numpy as np

from grpo.engine.asynchronous import Buffered, RolloutFailed, decode, encode, leaves, step_row, train_entry
from grpo.core.errors import ConfigError
from grpo.engine.parallel.exchange import RemoteFailure, SideExchange


def _key(spec: Any, name: str) -> str:
    """An entry's array's name in an exchange or a checkpoint: ``s<step>_<name>``."""
    return f"s{spec['record'][1]['step']}_{name}"


def _host_arrays(arrays: dict[str, Any]) -> dict[str, np.ndarray]:
    """An encoded entry's arrays on the host (a side's device arrays are its own)."""
    return {k: np.asarray(v) for k, v in arrays.items()}


class ProcessPipeline:
    """The two-process loop's state beside a :class:`~grpo.engine.trainer.Trainer`."""

    def __init__(self, trainer: Any, programs: Any):
        from grpo.engine.rollout.layout import state_shardings
        from grpo.sharding import PARAM_RULES

        meshes = trainer.meshes
        if trainer.conversations is not None:
            raise ConfigError(
                f"train.async.rollout_devices={meshes.rollout.mesh.devices.size} splits the run by processes, and "
                f"task.name={trainer.config.task.name} rolls out conversations (tools), which the two-process loop "
                f"does not: run it asynchronously on one host, or set train.async.enabled=false.")
        self.trainer = trainer
        self.programs = programs  # on the rollout mesh
        self.exchange = SideExchange(list(meshes.rollout.mesh.devices.flat), list(meshes.update.mesh.devices.flat))
        self.role = self.exchange.name  # "rollout" or "update"
        self.max_staleness = trainer.config.train.async_.max_staleness
        self.group_size = trainer.config.group_size
        self.treedef = jax.tree.structure(trainer.params)
        self.param_shardings = jax.tree.leaves(state_shardings(trainer.params, programs.mesh, PARAM_RULES))
        self.params: Any = None  # the rollout side's copy
        self.version = -1
        # Drawn and not yet trained, in step order: (entry spec, its host arrays) on both
        # sides; the update side also holds each entry decoded onto its mesh.
        self.stored: collections.deque[tuple[Any, dict[str, np.ndarray]]] = collections.deque()
        self.buffer: collections.deque[Buffered] = collections.deque()
        self.started = False
        self.partial = None
        self.sync_s = 0.0

    # ------------------------------------------------------------------ checkpoint

    def meta(self) -> dict[str, Any]:
        return {}

    def saved(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The buffer for a checkpoint: its host arrays (named ``s<step>_<name>``), the
        same on both processes, and the entries' specs (JSON)."""
        arrays = {_key(e, k): v for e, entry in self.stored for k, v in entry.items()}
        return arrays, {"entries": [e for e, _ in self.stored], "max_staleness": self.max_staleness,
                        "processes": True}

    def restore(self, saved: dict[str, Any] | None, read: Any, meta: dict[str, Any] | None = None) -> None:
        """The checkpoint's buffer back on both sides (``read(like)``: Orbax's restore of
        the ``buffer`` item into ``like``)."""
        self.stored.clear()
        self.buffer.clear()
        self.started = False
        if not saved or not saved.get("entries"):
            return
        if not saved.get("processes"):
            raise RuntimeError("async GRPO: this checkpoint's buffer was saved by a one-process run; resume it there")
        like = {}
        for e in saved["entries"]:
            step = e["record"][1]["step"]
            for leaf in leaves(e):
                like[_key(e, leaf['name'])] = np.zeros(tuple(leaf["shape"]), jax.numpy.dtype(leaf["dtype"]))
        arrays = read(like)
        for e in saved["entries"]:
            step = e["record"][1]["step"]
            self._store(e, {leaf["name"]: np.asarray(arrays[_key(e, leaf['name'])]) for leaf in leaves(e)})

    def host_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The trainer's state (params, optimizer) for a checkpoint, as host arrays both
        processes hold alike: the update side sends it over in one exchange. (Orbax
        refuses to save, in a multi-process run, an array whose devices are one
        process's: "Cannot serialize host local jax.Array"; host arrays it writes from
        process 0, which now has them.) Both processes call it at the same point."""
        leaves, treedef = jax.tree.flatten(state)
        if self.role == "update":
            host = [np.asarray(x) for x in leaves]
            self.exchange.exchange({f"c{i:05d}": x for i, x in enumerate(host)}, None)
        else:
            got, _, _ = self.exchange.exchange({}, None)
            host = [got[f"c{i:05d}"] for i in range(len(leaves))]
        return jax.tree.unflatten(treedef, host)

    @staticmethod
    def host_like(state: dict[str, Any]) -> dict[str, Any]:
        """What Orbax restores :meth:`host_state`'s checkpoint into: host arrays."""
        return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state)

    def placed(self, restored: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """The restored host state on the update side's devices, in ``state``'s
        shardings (the rollout side keeps its placeholders: it never reads them)."""
        if self.role == "rollout":
            return state
        return jax.tree.map(lambda h, x: jax.device_put(h, x.sharding), restored, state)

    def _store(self, spec: Any, arrays: dict[str, np.ndarray]) -> None:
        self.stored.append((spec, arrays))
        if self.role == "update":
            self.buffer.append(self._on_update(spec, arrays))

    def _on_update(self, spec: Any, arrays: dict[str, np.ndarray]) -> Buffered:
        """An entry decoded onto the update mesh: batch-sharded arrays over the update's
        rows (when they divide), other device arrays replicated, host arrays as they are."""
        up = self.trainer.programs
        shards = int(np.prod([up.train_sharding.mesh.shape[a] for a in up.train_sharding.spec[0]]))
        placed = {}
        for leaf in leaves(spec):
            x = arrays[leaf["name"]]
            if "spec" in leaf:
                batched = x.ndim > 0 and leaf["spec"] and leaf["spec"][0] is not None and x.shape[0] % shards == 0
                x = jax.device_put(x, up.train_sharding if batched else up.replicated)
            placed[leaf["name"]] = x
        entry = decode(spec, placed)
        entry.rollout = dataclasses.replace(entry.rollout, group=None)  # process 0 writes it
        return entry

    # ------------------------------------------------------------------ the exchange

    def _state(self, row: dict[str, Any] | None) -> dict[str, Any]:
        tr = self.trainer
        return {"step": tr.step, "data_position": tr.data_position, "skipped": tr.skipped_nonfinite,
                "reward_errors": tr.reward_errors, "row": row}

    def _swap(self, *, weights: bool = False, entries: list[tuple[Any, dict]] = (), row: dict | None = None):
        """One exchange: the update side sends its state (and the weights), the rollout
        side ``entries``; each side takes in what the other sent."""
        tr, t = self.trainer, time.perf_counter()
        if self.role == "update":
            payload = {f"w{i:05d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(tr.params))} if weights else {}
            got, _, _ = self.exchange.exchange(payload, self._state(row))
            meta = json.loads(got.pop("specs").tobytes()) if "specs" in got else []
            if weights:  # the weights' move: this side's seconds in the exchange (host copies and all)
                self.sync_s = time.perf_counter() - t
            for spec, arrays in (meta or []):
                self._store(spec, {k: got[_key(spec, k)] for k in arrays})
            return None
        payload = {_key(e, k): v for e, arrays in entries for k, v in arrays.items()}
        if entries:  # their structure (with the logged group's texts) as JSON bytes: no header limit
            payload["specs"] = np.frombuffer(json.dumps([[e, sorted(a)] for e, a in entries]).encode(), np.uint8)
        got, state, _ = self.exchange.exchange(payload, None)
        if got:  # the weights, on the rollout mesh
            leaves = [jax.device_put(got[f"w{i:05d}"], s) for i, s in enumerate(self.param_shardings)]
            self.params, self.version = jax.tree.unflatten(self.treedef, leaves), int(state["step"])
        tr.step, tr.data_position = int(state["step"]), int(state["data_position"])
        tr.skipped_nonfinite, tr.reward_errors = int(state["skipped"]), dict(state["reward_errors"])
        return state["row"]

    def _draw(self) -> tuple[Any, dict[str, np.ndarray]]:
        """The rollout side: the next step's rollout at the synced weights, encoded (its
        sample group written here, where its texts are)."""
        tr = self.trainer
        if self.stored:
            last = self.stored[-1][0]["record"][1]
            step, position = last["step"] + 1, None
        else:
            step, position = tr.step, tr.data_position
        if position is None:
            position = self._next_position
        try:
            rollout = tr.collector.collect(step=step, position=position, params=self.sampler_params,
                                           sample_group=tr.is_main and step % tr.config.logging.every_n_steps == 0)
        except Exception as err:
            raise RolloutFailed(
                f"async GRPO: the rollout of step {step + 1} (data position {position}, policy version "
                f"{self.version}) failed on the rollout process: {type(err).__name__}: {err}") from err
        versions = np.full(rollout.rewards.shape[0], self.version, np.int64)
        arrays: dict[str, Any] = {}
        spec = encode(Buffered(step=step, position=position, versions=versions, rollout=rollout), arrays, {})
        self._next_position = position + rollout.prompts_drawn
        entry = (spec, _host_arrays(arrays))
        self.stored.append(entry)
        return entry

    def trained(self) -> None:
        """The rollout side: the buffer's first step is the one training now (its sample
        group written, as a one-process run writes it when it trains)."""
        spec, arrays = self.stored.popleft()
        entry = decode(spec, arrays)  # the logged group rode in the buffer (so a checkpoint keeps it)
        if entry.rollout.group is not None:
            self.trainer._write_samples(entry.rollout.group, step=entry.step)

    def sampler_params(self) -> Any:
        return self.programs.sampler_state(self.params, None)

    def _start(self) -> None:
        """The first exchange of a run (or a resumed one): the weights and state, then
        the rollouts of steps ``s .. s + m - 1`` not buffered yet."""
        tr = self.trainer
        self._swap(weights=True)
        if self.stored:
            last = self.stored[-1][0]["record"][1]
            self._next_position = last["position"] + self._drawn(self.stored[-1])
        have = len(self.stored)
        missing = max(self.max_staleness - have, 0)
        if missing:
            fresh = [self._draw() for _ in range(missing)] if self.role == "rollout" else []
            self._swap(entries=fresh)
        if self.role == "update" and self.buffer and (self.buffer[0].step, self.buffer[0].position) != \
                (tr.step, tr.data_position):
            raise RuntimeError(f"async GRPO: the buffer starts at step {self.buffer[0].step + 1} where step "
                               f"{tr.step + 1} is due")
        self.started = True

    def _drawn(self, entry: tuple[Any, dict[str, np.ndarray]]) -> int:
        return int(entry[0]["record"][1]["rollout"]["record"][1]["prompts_drawn"])

    def close(self) -> None:
        pass


def _train(pipeline: ProcessPipeline, entry: Buffered) -> dict[str, Any]:
    """The update side: train ``entry`` (the step due) and return the step's row."""
    tr, m, k = pipeline.trainer, pipeline.max_staleness, pipeline.group_size
    t0 = time.perf_counter()
    if (entry.step, entry.position) != (tr.step, tr.data_position):
        raise RuntimeError(f"async GRPO: the buffer holds step {entry.step + 1} at data position {entry.position} "
                           f"where step {tr.step + 1} at {tr.data_position} is due")
    rollout = entry.rollout
    accepted, selection, epochs, trainer_logprobs, t_update = train_entry(tr, entry, max_staleness=m, group_size=k)
    tr.data_position = entry.position + rollout.prompts_drawn
    tr.step += 1
    times = {"rollout": rollout.rollout_s, "update": t_update, "step": time.perf_counter() - t0}
    row = step_row(tr, rollout, epochs, trainer_logprobs, times, selection, entry=entry, accepted=accepted,
                   buffered=len(pipeline.buffer))
    row["time/train/weight_sync_s"] = pipeline.sync_s  # the previous weights' exchange, seen from the update side
    return row


def train_step(pipeline: ProcessPipeline) -> dict[str, Any]:
    """One step of the two-process loop (the module docstring), on this process's side;
    both return the step's metrics row (the rollout side as the update side sent it)."""
    try:
        if not pipeline.started:
            pipeline._start()
        if pipeline.role == "rollout":
            lead = pipeline._draw() if pipeline.max_staleness == 0 else None
            if lead is not None:
                pipeline._swap(entries=[lead])
            ahead = [pipeline._draw()] if pipeline.max_staleness > 0 else []
            pipeline.trained()  # the step the update side trains now
            return pipeline._swap(entries=ahead)
        if pipeline.max_staleness == 0:
            pipeline._swap()
        pipeline.stored.popleft()
        row = _train(pipeline, pipeline.buffer.popleft())
        pipeline._swap(weights=True, row=row)
        return row
    except RemoteFailure:
        raise
    except BaseException as err:  # a KeyboardInterrupt or a library's sys.exit too: the other side must hear
        pipeline.exchange.fail(f"{type(err).__name__}: {err}")
        raise


__all__ = ["ProcessPipeline", "train_step"]
