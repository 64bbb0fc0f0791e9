"""The loop split by processes: the first processes' devices roll out, the others'
update (``train.async.rollout_devices`` = the rollout processes' devices, e.g. 8 of a
v6e-16's 4 x 4: 2 + 2 hosts), any number of processes a side.

The same ``grpo run`` runs on every process (JAX's multi-controller model) and builds the
same trainer; each process then plays its side. Programs whose devices are all the other
side's are not run here. Each side's host side runs over its own processes alone: the
rollout side's (prompts, scoring, dynamic sampling's rounds, the logged sample group,
evaluation) gathers over the rollout processes
(:func:`~grpo.engine.parallel.mesh.mesh_processes`,
:func:`~grpo.engine.parallel.rows.gather_processes`), the update side's over the update
processes. Every process of a side hands the exchange the same thing: the rollout side's
entries as its first process drew them (process 0 alone makes the logged group), the
update side's weights and state.

On the update processes the run is the one :class:`~grpo.engine.loop.loop.Loop`, with a
:class:`ProcessLink` as both its rollout source and its weight sync. The rollout
processes run the link's far end, :class:`RolloutSide`: they draw, take the weights in
through the same :meth:`~grpo.engine.loop.sync.WeightSync.sync` a one-process run
reshards them with (:class:`~grpo.engine.loop.sync.OtherMesh`), and evaluate, at the
weights they were sent, while the update side trains on.

The weights move on device (:meth:`~grpo.engine.parallel.exchange.SideExchange.swap_arrays`:
no host round trip), what moves is :func:`sent_weights` (one function), and each move
logs ``time/train/weight_sync_s`` (the update side's seconds until it arrived) and
``weight_sync/bytes``.

The sides meet in :class:`~grpo.engine.parallel.exchange.SideExchange`, always both at
once and in the same order (``m = max_staleness``, ``s`` the step):

- at the start: the update side sends the weights (version ``s``) and the run's state
  (step, data position, counters); the rollout side draws the steps not yet buffered,
  ``s .. s + m - 1``, and sends them (an exchange only when there are some);
- step ``s`` with ``m = 0``: the rollout side draws step ``s`` at version ``s`` and sends
  it, then waits while the update side trains it (nothing overlaps: the run equals the
  one-process one);
- step ``s`` with ``m >= 1``: the update side trains step ``s`` while the rollout side
  draws step ``s + m`` at version ``s`` (on its own processes: the two overlap);
- then one exchange: the new weights (version ``s + 1``), the step's metrics row and the
  state one way, the drawn rollout the other.

So both sides hold the same buffer at every checkpoint: the rollouts drawn and not yet
trained, as the host arrays that crossed, which every process hands Orbax alike
(process 0 writes them) in the one format (:mod:`grpo.engine.loop.buffer`); a resumed
run trains them as drawn, with no group lost or drawn twice.

Partial rollouts (``train.async.partial_rollouts``): the stream
(:class:`~grpo.engine.rollout.partial.PartialRollouts`) lives on the rollout processes,
every one running it alike, and draws at most one step ahead, as in one process; the
ledger of trained groups is the update side's (the loop's), whose groups trained ahead
of its frontier cross with the state every exchange. A checkpoint needs the same Orbax
items on every process (Orbax saves one tree, collectively, and process 0 writes host
arrays and the JSON), so the stream's snapshot (its rows in flight: tokens so far,
behaviour log-probs, token versions, keys, groups, the feed's position) crosses to the
update side in one exchange after the state (:func:`_inflight_exchange`) and both sides
save it as the item ``inflight``, as a one-process run does; a resumed rollout side puts
the rows back into a new stream, which rebuilds their KV cache and decodes on
(``async/regenerated_tokens`` 0). Each process saving only its own part instead would
make the trees differ between processes, which Orbax's collective save does not allow,
and the stream is the same on every rollout process anyway. Process 0 writes the logs,
samples and checkpoint metadata, as in every run, from the state the update side sends.
A failure on one process is sent in place of its next exchange, so every other process
stops with its message, naming the side and the process
(:class:`~grpo.engine.parallel.exchange.RemoteFailure`), instead of waiting.
"""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo.engine.loop.buffer import (Buffered, RolloutFailed, decode, encode, host_like, keep_inflight, key, leaves,
                                     placed, read_inflight)
from grpo.engine.loop.sources import RolloutSource, partial_entry
from grpo.engine.loop.sync import OtherMesh, WeightSync
from grpo.engine.parallel.exchange import RemoteFailure, SideExchange, pack, unpack
from grpo.engine.parallel.rows import gather_processes, host_value
from grpo.engine.rollout.partial import Ledger, PartialRollouts


def side_exchange(trainer: Any) -> SideExchange:
    """The run's exchange (this process's side: its ``name``)."""
    meshes = trainer.meshes
    exchange = SideExchange(list(meshes.rollout.mesh.devices.flat), list(meshes.update.mesh.devices.flat))
    return exchange.watch_failures()  # a failure reaches the processes outside the exchange too


def _specs(got: dict[str, np.ndarray]) -> list[tuple[Any, dict[str, np.ndarray]]]:
    """The entries the rollout side sent: their specs and host arrays."""
    meta = json.loads(got.pop("specs").tobytes()) if "specs" in got else []
    return [(spec, {k: got[key(spec, k)] for k in names}) for spec, names in meta]


def _state_exchange(exchange: SideExchange, state: dict[str, Any], role: str) -> dict[str, Any]:
    """The trainer's state (params, optimizer) for a checkpoint, as host arrays both
    processes hold alike: the update side sends it over in one exchange. (Orbax refuses
    to save, in a multi-process run, an array whose devices are one process's: "Cannot
    serialize host local jax.Array"; host arrays it writes from process 0, which now has
    them.) Both processes call it at the same point."""
    flat, treedef = jax.tree.flatten(state)
    if role == "update":
        host = [host_value(x) for x in flat]  # gathered over the update side's processes
        exchange.exchange({f"c{i:05d}": x for i, x in enumerate(host)}, None)
    else:
        got, _, _ = exchange.exchange({}, None)
        host = [got[f"c{i:05d}"] for i in range(len(flat))]
    return jax.tree.unflatten(treedef, host)


def _host_like(state: dict[str, Any]) -> dict[str, Any]:
    """What Orbax restores the held state into: host arrays."""
    return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state)


def _inflight_exchange(exchange: SideExchange, inflight: tuple[dict, dict] | None, role: str
                       ) -> tuple[dict, dict] | None:
    """The partial-rollouts stream's rows in flight (its snapshot: JSON, host arrays) on
    both sides, for a checkpoint: the rollout side holds the stream and sends
    ``inflight`` over in one exchange (the JSON as bytes: no header limit), so every
    process hands Orbax the same item (process 0 writes it). Both sides call it at the
    same point, after :func:`_state_exchange`."""
    if role == "rollout":
        payload = {} if inflight is None else {f"a_{k}": v for k, v in inflight[1].items()}
        if inflight is not None:
            payload["meta"] = np.frombuffer(json.dumps(inflight[0]).encode(), np.uint8)
        exchange.exchange(payload, None)
        return inflight
    got, _, _ = exchange.exchange({}, None)
    if "meta" not in got:
        return None
    return json.loads(got.pop("meta").tobytes()), {k[len("a_"):]: v for k, v in got.items()}


def lead(config: Any) -> int:
    """Steps the rollout side draws ahead of the update: ``max_staleness``, or under
    partial rollouts at most one (the stream's rows go on across weight changes within
    the staleness budget: :class:`~grpo.engine.loop.sources.PartialSource`)."""
    a = config.train.async_
    return min(a.max_staleness, 1) if a.partial_rollouts else a.max_staleness


def sent_weights(params: Any) -> Any:
    """What a weight sync moves from the update side to the rollout side: the one place
    that says it (both sides call it, the rollout side on its placeholders for the
    shapes): the trainable tree, which under LoRA is the adapters alone."""
    return params


def rollout_base(trainer: Any, mesh: Any) -> Any:
    """The frozen (maybe quantized) LoRA base on the rollout side's ``mesh``, or None
    without LoRA. Every process builds the same model from the same config and seed (the
    same checkpoint, or the same random init: the key does not depend on the sharding),
    so the base is already identical on both sides at start and never crosses processes;
    only the adapters move (:func:`sent_weights`). The trainer builds it
    (:meth:`~grpo.engine.trainer.Trainer.frozen_on`)."""
    return None if trainer.frozen is None else trainer.frozen_on(mesh)


def received_weights(exchange: SideExchange, like: Any, replicated: NamedSharding) -> Any:
    """The rollout side's end of :meth:`SideExchange.swap_arrays`: the weights
    :func:`sent_weights` sent, each leaf whole on every rollout device (``replicated``),
    on device; the sync's ``device_put`` then lays them out for the engine."""
    blocks = exchange.swap_arrays(like)
    leaves, treedef = jax.tree.flatten(like)
    out = [jax.make_array_from_single_device_arrays(x.shape, replicated, [row[i] for row in blocks])
           for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


class ProcessLink(RolloutSource, WeightSync):
    """The update process's source and weight sync at once: the entries arrive, and the
    weights leave, in the exchanges of the module docstring. :meth:`sync` stages the
    weights; they cross in the step's next exchange."""

    checkpoints_buffer = True

    def __init__(self, trainer: Any, exchange: SideExchange):
        self.trainer, self.exchange = trainer, exchange
        self.lead, self.partial = lead(trainer.config), trainer.config.train.async_.partial_rollouts
        self.in_order = not self.partial  # a partial batch is the first groups to finish
        self.ledger = Ledger()  # the loop's (reset): its groups trained ahead go over with the state
        self.rows, self.replicated = trainer.programs.train_sharding, trainer.programs.replicated
        self.forms: dict[int, tuple[Any, dict[str, np.ndarray]]] = {}  # each buffered step as it crossed
        self.staged: Any = None
        self.sync_s, self.sync_bytes = 0.0, 0

    # ------------------------------------------------------------------ weight sync

    def sync(self, params: Any, version: int) -> None:
        # The rollout side's engine is on the other process: its OtherMesh's sync hands
        # them to it (the state that crosses with them says the version).
        del version
        self.staged = params

    def figures(self) -> dict[str, float]:
        # The previous weights' move, seen from the update side.
        return {"time/train/weight_sync_s": self.sync_s, "weight_sync/bytes": float(self.sync_bytes)}

    # ------------------------------------------------------------------ source

    def _swap(self, row: dict[str, Any] | None = None) -> list[Buffered]:
        """One exchange: the staged weights (if any), the trainer's state and ``row`` out;
        the entries the rollout side drew in."""
        tr = self.trainer
        weights = self.staged
        state = {"step": tr.step, "data_position": tr.data_position, "skipped": tr.skipped_nonfinite,
                 "reward_errors": tr.reward_errors, "row": row, "weights": weights is not None,
                 "trained_ahead": sorted(self.ledger.ahead)}
        got, _, _ = self.exchange.exchange({}, state)
        if weights is not None:  # the weights' move, on device: its seconds until it has arrived
            t = time.perf_counter()
            sent = sent_weights(weights)
            self.exchange.swap_arrays(sent)
            jax.block_until_ready(sent)
            self.sync_s, self.staged = time.perf_counter() - t, None
            self.sync_bytes = sum(x.nbytes for x in jax.tree.leaves(sent))
        out = []
        for spec, arrays in _specs(got):
            self.keep(spec, arrays)
            out.append(self._placed(spec, arrays))
        return out

    def _placed(self, spec: Any, arrays: dict[str, np.ndarray]) -> Buffered:
        entry = placed(spec, arrays, rows=self.rows, replicated=self.replicated)
        entry.rollout.group = None  # process 0 writes it
        return entry

    def fill(self, loop: Any, count: int) -> None:
        entries = self._swap() if self.staged is not None else []  # the start: the weights over
        if count:
            entries += self._swap()  # the rollout side draws them meanwhile
        for entry in entries:
            loop.append(entry)

    def settle(self, loop: Any, row: dict[str, Any]) -> list[Buffered]:
        return self._swap(row)

    def trained(self, entry: Buffered, ledger: Ledger) -> int:
        self.forms.pop(entry.step)
        return super().trained(entry, ledger)

    def stored(self, entry: Buffered) -> tuple[Any, dict[str, np.ndarray]]:
        return self.forms[entry.step]

    def keep(self, spec: Any, arrays: dict[str, np.ndarray]) -> None:
        self.forms[spec["record"][1]["step"]] = (spec, arrays)

    def reset(self, ledger: Ledger) -> None:
        self.forms.clear()
        self.ledger = ledger

    def inflight(self) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        # The rollout side's stream, sent over for the checkpoint (RolloutSide.saved).
        return _inflight_exchange(self.exchange, None, "update") if self.partial else None

    def resume_inflight(self, saved: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        pass  # the rollout side puts the rows back (RolloutSide.restore); this side read them alike

    def evaluate(self, evaluator: Any, step: int, params: Any) -> dict[str, Any]:
        # The rollout side evaluates (RolloutSide.evaluate) while this side goes on training;
        # process 0, on that side, logs its row.
        return {"step": step}

    def failed(self, err: BaseException) -> None:
        if not isinstance(err, RemoteFailure):  # the other side must hear
            self.exchange.fail(f"{type(err).__name__}: {err}")

    def close(self) -> None:
        self.exchange.close()

    # ------------------------------------------------------------------ checkpoint

    def held(self, state: dict[str, Any]) -> dict[str, Any]:
        return _state_exchange(self.exchange, state, "update")

    def held_like(self, state: dict[str, Any]) -> dict[str, Any]:
        return _host_like(state)

    def placed(self, restored: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """The restored host state on the update side's devices, in ``state``'s shardings."""
        return jax.tree.map(lambda h, x: jax.device_put(h, x.sharding), restored, state)


class RolloutSide:
    """The rollout process's loop: the far end of :class:`ProcessLink`. It draws the
    steps, writes each step's sample group when it trains, and takes in the weights, the
    state and the step's row the update side sends (its trainer's step and data position
    are the update side's)."""

    def __init__(self, trainer: Any, exchange: SideExchange, programs: Any):
        self.trainer, self.exchange = trainer, exchange
        self.max_staleness, self.lead = trainer.config.train.async_.max_staleness, lead(trainer.config)
        # Partial rollouts: the stream lives here, across steps; the ledger of trained groups
        # is the update side's (its groups trained ahead arrive with the state).
        self.partial = (PartialRollouts(trainer.collector, max_staleness=self.max_staleness)
                        if trainer.config.train.async_.partial_rollouts else None)
        self.trained_ahead: list[int] = []
        # What the weights arrive into: the update side's shapes, whole on the rollout mesh.
        self.like = sent_weights(trainer.params)
        self.replicated = NamedSharding(programs.mesh, P())
        # Where the weights enter the rollout side: its engine's update_weights (under
        # LoRA beside the base, built on this side's mesh: only the adapters cross).
        self.sync = OtherMesh(programs, trainer.collector.sampler, trainer.params,
                              rollout_base(trainer, programs.mesh))
        self.version = -1
        # Drawn and not yet trained, in step order: each entry's spec and host arrays.
        self.stored: collections.deque[tuple[Any, dict[str, np.ndarray]]] = collections.deque()
        self.started = False

    def step(self) -> dict[str, Any]:
        """One step of the multi-process loop on the rollout side: the row the update side
        sent."""
        try:
            if not self.started:
                self._start()
            if self.lead == 0:
                self._swap([self._draw()])
            ahead = [self._draw()] if self.lead > 0 else []
            self._trained()  # the step the update side trains now
            return self._buffered(self._swap(ahead))
        except RemoteFailure:
            raise
        except BaseException as err:  # a KeyboardInterrupt or a library's sys.exit too: the other side must hear
            self.exchange.fail(f"{type(err).__name__}: {err}")
            raise

    def _buffered(self, row: dict[str, Any]) -> dict[str, Any]:
        """The step's row with ``async/buffered_steps`` as this side counts it: the steps
        drawn and not yet trained once the step trained (:attr:`stored`). The update
        side's loop counts its own buffer when it builds the row, before the step drawn
        meanwhile crosses to it (in the exchange that carries the row), so it says 0
        where a one-process run, whose step drawn ahead is in its buffer by then, says
        ``lead``; this process writes the row (process 0 is a rollout process)."""
        if row is not None and "async/buffered_steps" in row:
            row = {**row, "async/buffered_steps": len(self.stored)}
        return row

    def evaluate(self, evaluator: Any, step: int, params: Any) -> dict[str, Any]:
        """The evaluation at ``step`` on this side's mesh, at the weights of version
        ``step`` it was sent (a run's first, before its first step, once they are here);
        the update side trains on meanwhile."""
        try:
            if not self.started:
                self._start()
            return evaluator(step, self.sync.params)
        except RemoteFailure:
            raise
        except BaseException as err:  # the update side must hear
            self.exchange.fail(f"{type(err).__name__}: {err}")
            raise

    def _start(self) -> None:
        """The first exchange of a run (or a resumed one): the weights and state, then the
        rollouts of steps ``s .. s + m - 1`` not buffered yet."""
        self._swap([])
        missing = max(self.lead - len(self.stored), 0)
        if missing:
            self._swap([self._draw() for _ in range(missing)])
        self.started = True

    def _swap(self, entries: list[tuple[Any, dict]]) -> dict[str, Any] | None:
        """One exchange: ``entries`` out; the weights (when sent), the update side's state
        and row in."""
        tr = self.trainer
        payload = {key(e, k): v for e, arrays in entries for k, v in arrays.items()}
        if entries:  # their structure (with the logged group's texts) as JSON bytes: no header limit
            payload["specs"] = np.frombuffer(json.dumps([[e, sorted(a)] for e, a in entries]).encode(), np.uint8)
        _, state, _ = self.exchange.exchange(payload, None)
        if state["weights"]:  # the weights, on device, onto the rollout mesh
            self.version = int(state["step"])
            self.sync.sync(received_weights(self.exchange, self.like, self.replicated), self.version)
        tr.step, tr.data_position = int(state["step"]), int(state["data_position"])
        tr.skipped_nonfinite, tr.reward_errors = int(state["skipped"]), dict(state["reward_errors"])
        self.trained_ahead = list(state["trained_ahead"])
        return state["row"]

    def _draw(self) -> tuple[Any, dict[str, np.ndarray]]:
        """The next step's rollout at the synced weights, encoded and kept."""
        tr = self.trainer
        if self.stored:
            last = self.stored[-1][0]["record"][1]
            step = last["step"] + 1
            position = last["position"] + int(last["rollout"]["record"][1]["prompts_drawn"])
        else:
            step, position = tr.step, tr.data_position
        sample_group = tr.is_main and step % tr.config.logging.every_n_steps == 0
        try:
            if self.partial is not None:  # the stream's next batch (it feeds itself, from the ledger)
                drawn = partial_entry(self.partial, step=step, version=self.version, sample_group=sample_group)
            else:
                rollout = tr.collector.collect(step=step, position=position, sample_group=sample_group)
                drawn = Buffered(step=step, position=position, rollout=rollout,
                                 versions=np.full(rollout.rewards.shape[0], self.version, np.int64))
        except Exception as err:
            raise RolloutFailed(
                f"async GRPO: the rollout of step {step + 1} (data position {position}, policy version "
                f"{self.version}) failed on the rollout process: {type(err).__name__}: {err}") from err
        arrays: dict[str, Any] = {}
        spec = encode(drawn, arrays, {})
        entry = (spec, {k: host_value(v) for k, v in arrays.items()})  # gathered over the rollout side's processes
        entry = self._as_first(*entry)
        self.stored.append(entry)
        return entry

    def _as_first(self, spec: Any, arrays: dict[str, np.ndarray]) -> tuple[Any, dict[str, np.ndarray]]:
        """The entry as the rollout side's first process drew it, on every process of the
        side: the same but for the logged sample group, which process 0 alone makes (and
        every process of a side must hand the exchange and the checkpoint the same)."""
        mesh = self.sync.programs.mesh
        if len({d.process_index for d in mesh.devices.flat}) == 1:
            return spec, arrays
        data, layout = pack(arrays)
        head = np.frombuffer(json.dumps([spec, layout]).encode(), np.uint8)
        sizes = gather_processes(np.array([head.size, data.size], np.int64), mesh)  # [processes, 2]
        buf = np.zeros(int(sizes[:, 0].max() + sizes[:, 1].max()), np.uint8)
        buf[: head.size], buf[head.size : head.size + data.size] = head, data
        first = gather_processes(buf, mesh)[0]
        h, n = (int(x) for x in sizes[0])
        spec, layout = json.loads(first[:h].tobytes())
        return spec, unpack(first[h : h + n], layout)

    def _trained(self) -> None:
        """The buffer's first step is the one training now: its sample group written, as
        a one-process run writes it when it trains."""
        spec, arrays = self.stored.popleft()
        entry = decode(spec, arrays)  # the logged group rode in the buffer (so a checkpoint keeps it)
        # Every process of the side holds process 0's group (_as_first); process 0 alone writes it.
        if entry.rollout.group is not None and self.trainer.is_main:
            self.trainer._write_samples(entry.rollout.group, step=entry.step)

    # ------------------------------------------------------------------ checkpoint

    def saved(self, state: dict[str, Any], meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The same items and metadata as the update side's :meth:`Loop.saved
        <grpo.engine.loop.loop.Loop.saved>` (this process writes the metadata)."""
        items = dict(_state_exchange(self.exchange, state, "rollout"))
        arrays = {key(spec, name): x for spec, host in self.stored for name, x in host.items()}
        if arrays:
            items["buffer"] = arrays
        meta = {**meta, "partial_trained_ahead": list(self.trained_ahead),
                "async": {"entries": [spec for spec, _ in self.stored], "max_staleness": self.max_staleness}}
        if self.partial is not None:  # the stream's rows in flight, on both sides (ProcessLink.inflight)
            keep_inflight(items, meta, _inflight_exchange(self.exchange, self.partial.snapshot(), "rollout"))
        return items, meta

    def held_like(self, state: dict[str, Any]) -> dict[str, Any]:
        return _host_like(state)

    def placed(self, restored: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        return state  # the update side's arrays: this side keeps its placeholders (it never reads them)

    def restore(self, meta: dict[str, Any], read: Any) -> None:
        """The checkpoint's buffer back, as host arrays (``read(name, like)``: Orbax's
        restore of the item ``name``, here ``buffer``, into ``like``)."""
        self.stored.clear()
        self.started = False
        self.trained_ahead = list(meta.get("partial_trained_ahead", ()))
        saved = read_inflight(meta, read)  # in Loop.restore's order: the rows in flight, then the buffer
        if self.partial is not None:  # the stream goes on from its rows in flight (None: re-fed from the ledger)
            self.partial.reset(frontier=self.trainer.data_position, ahead=self.trained_ahead, saved=saved)
        specs = (meta.get("async") or {}).get("entries")
        if specs:
            arrays = read("buffer", host_like(specs))
            for spec in specs:
                self.stored.append((spec, {leaf["name"]: np.asarray(arrays[key(spec, leaf["name"])])
                                           for leaf in leaves(spec)}))

    def close(self) -> None:
        self.sync.close()
        self.exchange.close()


__all__ = ["ProcessLink", "RolloutSide", "received_weights", "rollout_base", "sent_weights", "side_exchange"]
