"""Asynchronous GRPO (``train.async``): the rollout runs on its own mesh, up to
``max_staleness`` steps ahead of the update.

The schedule, for ``m = max_staleness`` (``v`` = the weights' version: optimizer steps
applied to them):

- before step ``s``'s update the buffer holds the rollouts of steps ``s .. s + m - 1``
  (at the start, or after a resume, they are drawn there and then, at the current
  weights: a resumed run re-draws the steps that were buffered, from the same data
  positions with the same per-step keys);
- step ``s``: the update trains on the rollout of step ``s`` on the update mesh while the
  rollout of step ``s + m`` is drawn on the rollout mesh with the weights of version
  ``s`` (so it trains at staleness exactly ``m``); then the new weights (version
  ``s + 1``) move to the rollout mesh in one resharding ``device_put``
  (``time/train/weight_sync_s``);
- with ``m = 0`` nothing overlaps: every rollout is drawn at the weights that train on
  it, and the run equals the synchronous one (up to the reduction order of a smaller
  mesh).

The two sides overlap through one worker thread that draws the next rollout while the
main thread runs the update. That is safe here because the run is one process (the
split refuses several, :mod:`grpo.engine.parallel.split`): the two sides' programs run
on disjoint devices and share no collective, so no cross-process ordering exists to
break. Only the main thread touches the trainer's state, the logs and the weights.

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
        self.sync_s = 0.0
        cfg = trainer.config.train.async_
        self.partial = PartialRollouts(trainer.collector, max_staleness=self.max_staleness) \
            if cfg.partial_rollouts else None
        # Steps the rollout runs ahead: m whole batches; with partial rollouts at most one,
        # so that rows may go on across weight changes within the staleness budget.
        self.lead = self.max_staleness if self.partial is None else min(self.max_staleness, 1)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-rollout")

    def reset(self, meta: dict[str, Any] | None = None) -> None:
        """Forget the buffer (a resume re-draws it from the trainer's data position; with
        partial rollouts from the frontier, skipping the checkpoint ``meta``'s groups
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

    def sync(self) -> None:
        """The trainer's weights to the rollout mesh: one resharding transfer."""
        t = time.perf_counter()
        self.params = jax.block_until_ready(jax.device_put(self.trainer.params, self.param_shardings))
        self.version = self.trainer.step
        self.sync_s = time.perf_counter() - t

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
        accepted = accepted_groups(step=tr.step, versions=entry.versions, max_staleness=m, group_size=k)
        advantages = refuse(tr.advantages(rollout), accepted, group_size=k)
        selection = tr.selection_scalars(rollout, advantages)
        t1 = time.perf_counter()
        epochs, trainer_logprobs = tr.optimize(tr.update_batch(rollout, advantages))
        trainer_logprobs = tr.row_logprobs(trainer_logprobs, rollout.output.tokens.shape)
        t_update = time.perf_counter() - t1
    finally:
        ahead = None if future is None else future.result()  # re-raises the rollout's failure
    if ahead is not None:
        pipeline._append(ahead)
    if pipeline.partial is None:
        tr.data_position = entry.position + rollout.prompts_drawn
    else:  # the frontier of the trained groups (they finish out of data order)
        tr.data_position = pipeline.partial.trained(entry.positions)
    tr.step += 1
    pipeline.sync()
    stale = staleness(step=tr.step - 1, versions=entry.versions)
    times = {"rollout": rollout.rollout_s, "update": t_update, "step": time.perf_counter() - t0}
    row = tr.metrics_row(rollout, epochs, trainer_logprobs, times, selection)
    row.update({
        "async/staleness_mean": float(stale.mean()),
        "async/staleness_max": int(stale.max()),
        "async/refused_groups": int((~accepted).sum()),
        "async/buffered_steps": len(pipeline.buffer),
        "async/data_position": entry.position,
        "time/train/weight_sync_s": pipeline.sync_s,
    })
    if entry.token_versions is not None:
        row.update(token_staleness(step=tr.step - 1, versions=entry.token_versions))
    return row


__all__ = ["Buffered", "Pipeline", "RolloutFailed", "accepted_groups", "refuse", "staleness", "train_step"]
