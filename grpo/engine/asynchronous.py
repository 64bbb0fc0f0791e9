"""Asynchronous GRPO (``train.async``): the rollout runs on its own mesh, up to
``max_staleness`` steps ahead of the update.

The schedule, for ``m = max_staleness`` (``v`` = the weights' version: optimizer steps
applied to them):

- before step ``s``'s update the buffer holds the rollouts of steps ``s .. s + m - 1``
  (at the start they are drawn there and then, at the start weights; after a resume
  they come back from the checkpoint, as drawn);
- step ``s``: the update trains on the rollout of step ``s`` on the update mesh while the
  rollout of step ``s + m`` is drawn on the rollout mesh with the weights of version
  ``s`` (so it trains at staleness exactly ``m``); then the new weights (version
  ``s + 1``) move to the rollout mesh in one resharding ``device_put``, dispatched and
  not waited for: the main thread goes on (logs, checkpoint, the next step's batch) and
  the next rollout's first program waits for the weights on the device side
  (``time/train/weight_sync_s``: that transfer's seconds from dispatch to arrival, timed
  by a thread that waits for it; ``time/train/weight_sync_dispatch_s``: what the main
  thread spent dispatching it);
- with ``m = 0`` nothing overlaps: every rollout is drawn at the weights that train on
  it, and the run equals the synchronous one (up to the reduction order of a smaller
  mesh).

The two sides overlap through one worker thread that draws the next rollout while the
main thread runs the update. That is safe here because the run is one process (two
processes, one a side, run :mod:`grpo.engine.asynchronous_processes` instead, with no
thread): the two sides' programs run
on disjoint devices and share no collective, so no cross-process ordering exists to
break. Only the main thread touches the trainer's state, the logs and the weights.

A checkpoint holds the buffer (:meth:`Pipeline.saved`, :meth:`Pipeline.restore`): the
rollouts drawn but not yet trained, every array the update and the logs read (tokens,
masks, sampler and behaviour log-probs, rewards, lengths, the logged group, each row's
version), so a resumed run trains them exactly as the uninterrupted run would have
(same completions, same versions) and goes on drawing step ``s + m`` at version ``s``.
The record's structure goes into the checkpoint's JSON metadata, its arrays into one
Orbax item (``buffer``): device arrays as the global arrays they are on the update mesh
(Orbax writes each process's shards, and restores them into the same shardings), host
arrays and scalars as values every process holds alike (Orbax writes numpy arrays and
the JSON from the primary process; every process reads them back). Host-only extras of
process 0 (the logged sample group) are kept on process 0 only.

Every buffered rollout records the version that drew it; the update refuses groups
staler than ``m`` (exactly zero advantage: no gradient; ``async/refused_groups``).
Off-policy correction is the loss's ``loss.mismatch`` (defaulted on when ``m > 0``):
the importance weight ``exp(logp_current - logp_behaviour)`` against the sampler's own
(top-k/top-p truncated) log-probs, while the PPO ratio is taken against the trainer's
log-probs at its current weights (decoupled PPO); the loss logs ``mismatch/weight_mean``
and the fraction truncated or masked.

With ``train.async.partial_rollouts`` (the continuous engine) the rollout side is one
stream that lives across steps (:mod:`grpo.engine.rollout.partial`): it runs at most one
step ahead, a step's batch is the first groups to finish, rows in flight at a weight
change go on under the new weights, each token records its version, and a row is as
stale as its oldest token.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo.engine.rollout.partial import PartialRollouts, oldest_versions, token_staleness
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


def _moved(value: Any, *, rows: NamedSharding, replicated: NamedSharding) -> Any:
    """``value``'s device arrays (through pytrees and dataclasses) on the other mesh: a
    batch-sharded array over ``rows`` (when its rows divide), anything else replicated."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _moved(getattr(value, f.name), rows=rows, replicated=replicated)
                                             for f in dataclasses.fields(value)})

    def move(x):
        if not isinstance(x, jax.Array):
            return x
        spec = getattr(x.sharding, "spec", P())
        shards = int(np.prod([rows.mesh.shape[a] for a in rows.spec[0]]))
        batched = x.ndim > 0 and len(spec) > 0 and spec[0] is not None and x.shape[0] % shards == 0
        return jax.device_put(x, rows if batched else replicated)

    return jax.tree.map(move, value)


class Pipeline:
    """The asynchronous loop's state beside a :class:`~grpo.engine.trainer.Trainer`:
    the rollout programs (built on the rollout mesh by the program builder), the
    policy's copy on the rollout mesh and its version, and the buffer of rollouts."""

    def __init__(self, trainer: Any, programs: Any):
        from grpo.engine.rollout.layout import state_shardings
        from grpo.sharding import PARAM_RULES

        self.trainer = trainer
        self.programs = programs  # on the rollout mesh
        self.max_staleness = trainer.config.train.async_.max_staleness
        self.group_size = trainer.config.group_size
        self.param_shardings = state_shardings(trainer.params, programs.mesh, PARAM_RULES)
        # The LoRA base never changes: moved once.
        self.frozen = None if trainer.frozen is None else jax.device_put(
            trainer.frozen, state_shardings(trainer.frozen, programs.mesh, PARAM_RULES))
        self.params: Any = None
        self.version = -1  # of self.params
        self.buffer: collections.deque[Buffered] = collections.deque()
        self.next_step: int | None = None
        self.next_position = 0
        cfg = trainer.config.train.async_
        self.partial = PartialRollouts(trainer.collector, max_staleness=self.max_staleness) \
            if cfg.partial_rollouts else None
        # Steps the rollout runs ahead: m whole batches; with partial rollouts at most one,
        # so that rows may go on across weight changes within the staleness budget.
        self.lead = self.max_staleness if self.partial is None else min(self.max_staleness, 1)
        self.dispatch_s = 0.0
        self._arrival: concurrent.futures.Future | None = None  # the last transfer's seconds to arrival
        self._waiter: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-rollout")

    def reset(self, meta: dict[str, Any] | None = None) -> None:
        """Forget the buffer (then :meth:`fill` draws it from the trainer's data position;
        with partial rollouts from the frontier, skipping the checkpoint ``meta``'s groups
        trained ahead)."""
        self.buffer.clear()
        self.next_step = None
        self.version = -1
        if self.partial is not None:
            self.partial.reset(frontier=self.trainer.data_position,
                               ahead=(meta or {}).get("partial_trained_ahead", ()))

    def meta(self) -> dict[str, Any]:
        """The checkpoint's share of the pipeline (partial rollouts: the groups trained ahead)."""
        return {} if self.partial is None else self.partial.meta()

    def saved(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The buffer for a checkpoint: its arrays (an Orbax item; empty when nothing is
        buffered) and its JSON description (what :meth:`restore` rebuilds it from). With
        partial rollouts nothing is saved: a resume re-feeds the groups not yet trained
        from the frontier (:meth:`reset`), as it does the rows in flight."""
        arrays: dict[str, Any] = {}
        spec = encode([] if self.partial is not None else list(self.buffer), arrays, {})
        return arrays, {"buffer": spec, "max_staleness": self.max_staleness}

    def restore(self, saved: dict[str, Any] | None, read: Any, meta: dict[str, Any] | None = None) -> None:
        """The checkpoint's buffer back, on the update mesh: ``saved`` the JSON of
        :meth:`saved` (None: a synchronous run's checkpoint, or an older one: the buffered
        steps are re-drawn at the restored weights from the data position); ``read(like)``
        restores the arrays into ``like`` (:func:`like`); ``meta`` the checkpoint's meta
        (partial rollouts' groups trained ahead, :meth:`reset`)."""
        self.reset(meta)
        if not saved or not saved["buffer"]["list"]:
            return
        arrays = read(like(saved["buffer"], self.trainer.mesh))
        entries = decode(saved["buffer"], arrays)
        tr = self.trainer
        for entry in entries:
            if not tr.is_main:  # the logged group is process 0's (see the module docstring)
                entry.rollout.group = None
            self._append(entry)
        first = self.buffer[0]
        if (first.step, first.position) != (tr.step, tr.data_position):
            raise RuntimeError(f"async GRPO: the checkpoint's buffer starts at step {first.step + 1} (data position "
                               f"{first.position}) where its state is at step {tr.step + 1} ({tr.data_position})")

    def sync(self) -> None:
        """The trainer's weights to the rollout mesh: one resharding transfer, dispatched
        and not waited for (the programs reading ``self.params`` wait on the devices; the
        update's donation of the source waits for the transfer's reads)."""
        t = time.perf_counter()
        params = jax.device_put(self.trainer.params, self.param_shardings)
        self.params, self.version = params, self.trainer.step
        self.dispatch_s = time.perf_counter() - t

        def arrival() -> float:
            jax.block_until_ready(params)
            return time.perf_counter() - t

        if self._waiter is None:
            self._waiter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-weight-sync")
        self._arrival = self._waiter.submit(arrival)

    def sync_s(self) -> float:
        """The last transfer's seconds from its dispatch to its arrival on the rollout mesh."""
        return 0.0 if self._arrival is None else self._arrival.result()

    def sampler_params(self) -> Any:
        return self.programs.sampler_state(self.params, self.frozen)

    def collect(self) -> Buffered:
        """Draw the next step's rollout on the rollout mesh at the synced weights and move
        it to the update mesh (not yet buffered: the main thread appends it)."""
        tr, step, position, version = self.trainer, self.next_step, self.next_position, self.version
        sample_group = tr.is_main and step % tr.config.logging.every_n_steps == 0
        token_versions = positions = None
        try:
            if self.partial is not None:
                rollout, token_versions, positions = self.partial.draw(
                    step=step, params=self.sampler_params(), version=version, sample_group=sample_group)
            else:
                rollout = tr.collector.collect(step=step, position=position, params=self.sampler_params,
                                               sample_group=sample_group)
        except Exception as err:
            raise RolloutFailed(
                f"async GRPO: the rollout of step {step + 1} (data position {position}, policy version {version}) "
                f"failed on the rollout mesh: {type(err).__name__}: {err}"
            ) from err
        up = tr.programs
        rollout = _moved(rollout, rows=up.train_sharding, replicated=up.replicated)
        if positions is not None:
            return Buffered(step=step, position=min(positions), versions=oldest_versions(token_versions),
                            rollout=rollout, token_versions=token_versions, positions=positions)
        versions = np.full(rollout.rewards.shape[0], version, np.int64)
        return Buffered(step=step, position=position, versions=versions, rollout=rollout)

    def _append(self, entry: Buffered) -> None:
        self.buffer.append(entry)
        self.next_step = entry.step + 1
        self.next_position = entry.position + entry.rollout.prompts_drawn

    def fill(self) -> None:
        """Draw (in line) until the buffer holds steps ``s .. s + max(m, 1) - 1``."""
        tr = self.trainer
        if self.next_step is None:
            self.next_step, self.next_position = tr.step, tr.data_position
        if self.version != tr.step:
            self.sync()
        while self.next_step < tr.step + max(self.lead, 1):
            self._append(self.collect())

    def ahead(self) -> concurrent.futures.Future | None:
        """Start drawing step ``s + lead`` in the worker (None when ``lead = 0``)."""
        if self.lead == 0:
            return None
        return self._pool.submit(self.collect)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
            self._waiter = None


def train_entry(tr: Any, entry: Buffered, *, max_staleness: int, group_size: int) -> tuple:
    """Train the buffered ``entry`` (the step due) as both loops do (one process or two):
    groups staler than ``max_staleness`` refused (zero advantage), then the optimizer
    step. Returns ``(accepted [G], selection scalars, epochs' metrics, the trainer's
    log-probs per row, the update's seconds)``."""
    rollout, k = entry.rollout, group_size
    accepted = accepted_groups(step=tr.step, versions=entry.versions, max_staleness=max_staleness, group_size=k)
    advantages = refuse(tr.advantages(rollout), accepted, group_size=k)
    selection = tr.selection_scalars(rollout, advantages)
    t1 = time.perf_counter()
    epochs, trainer_logprobs = tr.optimize(tr.update_batch(rollout, advantages))
    trainer_logprobs = tr.row_logprobs(trainer_logprobs, rollout.output.tokens.shape)
    return accepted, selection, epochs, trainer_logprobs, time.perf_counter() - t1


def step_row(tr: Any, rollout: Any, epochs: Any, trainer_logprobs: Any, times: dict[str, float], selection: Any, *,
             entry: Buffered, accepted: np.ndarray, buffered: int) -> dict[str, Any]:
    """A trained step's metrics row with the async figures both loops log (one process or
    two): the staleness of the entry's rows against the step just trained, the refused
    groups, the steps still buffered and the entry's data position."""
    stale = staleness(step=tr.step - 1, versions=entry.versions)
    row = tr.metrics_row(rollout, epochs, trainer_logprobs, times, selection)
    row.update({
        "async/staleness_mean": float(stale.mean()),
        "async/staleness_max": int(stale.max()),
        "async/refused_groups": int((~accepted).sum()),
        "async/buffered_steps": buffered,
        "async/data_position": entry.position,
    })
    return row


def train_step(pipeline: Pipeline) -> dict[str, Any]:
    """One asynchronous GRPO step (see the module docstring); the trainer's
    :meth:`~grpo.engine.trainer.Trainer.train_step` under ``train.async.enabled``."""
    tr, m, k = pipeline.trainer, pipeline.max_staleness, pipeline.group_size
    t0 = time.perf_counter()
    pipeline.fill()
    entry = pipeline.buffer.popleft()
    if pipeline.partial is None and (entry.step, entry.position) != (tr.step, tr.data_position):
        raise RuntimeError(f"async GRPO: the buffer holds step {entry.step + 1} at data position {entry.position} "
                           f"where step {tr.step + 1} at {tr.data_position} is due")
    rollout = entry.rollout
    future = pipeline.ahead()  # the rollout side works while the update trains
    try:
        if rollout.group is not None:
            tr._write_samples(rollout.group)
        accepted, selection, epochs, trainer_logprobs, t_update = train_entry(tr, entry, max_staleness=m, group_size=k)
    finally:
        ahead = None if future is None else future.result()  # re-raises the rollout's failure
    if ahead is not None:
        pipeline._append(ahead)
    if pipeline.partial is None:
        tr.data_position = entry.position + rollout.prompts_drawn
    else:  # the frontier of the trained groups (they finish out of data order)
        tr.data_position = pipeline.partial.trained(entry.positions)
    tr.step += 1
    # The transfer this step's rollout side drew with (dispatched after the previous
    # update, or before the first draw): arrived, since that rollout is complete.
    sync_s = pipeline.sync_s()
    pipeline.sync()
    times = {"rollout": rollout.rollout_s, "update": t_update, "step": time.perf_counter() - t0}
    row = step_row(tr, rollout, epochs, trainer_logprobs, times, selection, entry=entry, accepted=accepted,
                   buffered=len(pipeline.buffer))
    row.update({"time/train/weight_sync_s": sync_s, "time/train/weight_sync_dispatch_s": pipeline.dispatch_s})
    if entry.token_versions is not None:
        row.update(token_staleness(step=tr.step - 1, versions=entry.token_versions))
    return row


__all__ = ["Buffered", "Pipeline", "RolloutFailed", "accepted_groups", "decode", "encode", "leaves", "like", "refuse",
           "staleness", "step_row", "train_entry", "train_step"]
