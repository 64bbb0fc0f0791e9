"""The one training loop: a rollout source x a weight sync (:mod:`grpo.engine.loop.factory`
picks them), one buffer, one data-position ledger, one checkpoint format.

A step (:meth:`Loop.step`), for ``m = max_staleness`` (``v`` = the weights' version:
optimizer steps applied to them):

- fill: before step ``s``'s update the buffer holds the rollouts of steps
  ``s .. s + max(lead, 1) - 1`` (at the start they are drawn there and then, at the
  start weights; after a resume they come back from the checkpoint, as drawn); the
  rollout side holds the weights of version ``s`` before it draws for step ``s``;
- the entry due leaves the buffer, and its reward failures are read (the trainer's
  :meth:`~grpo.engine.trainer.Trainer.observe_rewards`) before anything trains on it: a
  reward function that failed on every row stops the run here, before any update;
- the source starts drawing step ``s + lead`` (at version ``s``, so it trains at
  staleness exactly ``m``) while the update trains;
- acceptance: groups staler than ``m`` are refused (exactly zero advantage; synchronous
  runs draw every row at the version that trains it, and check nothing);
- advantages -> update batch -> optimizer steps (the trainer's stages);
- the ledger records the entry's data positions trained, the trainer's step and data
  position advance (only here), and the new weights (version ``s + 1``) go to the
  rollout side through the one :meth:`~grpo.engine.loop.sync.WeightSync.sync` (the
  rollout engine's ``update_weights``, in every mode);
- the metrics row, with the asynchronous figures when the run is asynchronous; then the
  source's end of step (split by processes: the step's one exchange).

With ``m = 0`` nothing overlaps: every rollout is drawn at the weights that train on it,
and the run equals the synchronous one (up to the reduction order of a smaller mesh).
Off-policy correction is the loss's ``loss.mismatch`` (defaulted on when ``m > 0``): the
importance weight ``exp(logp_current - logp_behaviour)`` against the sampler's own
(top-k/top-p truncated) log-probs, while the PPO ratio is taken against the trainer's
log-probs at its current weights (decoupled PPO).

A checkpoint holds the rollouts drawn and not yet trained
(:mod:`grpo.engine.loop.buffer`'s format), so a resumed run trains them exactly as the
uninterrupted run would have (same completions, same versions) and goes on drawing step
``s + m`` at version ``s``.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import numpy as np

from grpo.engine.loop.buffer import (Buffered, accepted_groups, host_like, keep_inflight, key, leaves, placed,
                                     read_inflight, refuse, staleness)
from grpo.engine.rollout.partial import Ledger, token_staleness


class Loop:
    """The loop beside a :class:`~grpo.engine.trainer.Trainer` (whose stages it calls, and
    whose step and data position it advances): ``source`` x ``sync``; ``max_staleness``
    None for a synchronous run (no versions checked, no asynchronous figures)."""

    def __init__(self, trainer: Any, source: Any, sync: Any, *, max_staleness: int | None):
        self.trainer, self.source, self.sync = trainer, source, sync
        self.max_staleness = max_staleness
        self.group_size = trainer.config.group_size
        self.buffer: collections.deque[Buffered] = collections.deque()
        self.ledger = Ledger(trainer.data_position)
        self.version = -1  # of the weights the rollout side holds
        self.next_step: int | None = None  # the draw cursor: the next step to draw, from
        self.next_position = 0  # this data position
        self.source.reset(self.ledger)

    # ------------------------------------------------------------------ the buffer

    def cursor(self) -> dict[str, Any]:
        """Where the next draw starts: its step, data position and version (the weights
        the sync gave the rollout engine)."""
        tr = self.trainer
        return {"step": self.next_step, "position": self.next_position, "version": self.version,
                "sample_group": tr.is_main and self.next_step % tr.config.logging.every_n_steps == 0}

    def append(self, entry: Buffered) -> None:
        self.buffer.append(entry)
        self.next_step = entry.step + 1
        self.next_position = entry.position + entry.rollout.prompts_drawn

    def _sync(self) -> None:
        tr = self.trainer
        self.sync.sync(tr.params, tr.step)
        self.version = tr.step

    def _fill(self) -> None:
        """Draw (in line) until the buffer holds steps ``s .. s + max(lead, 1) - 1``."""
        tr = self.trainer
        if self.next_step is None:
            self.next_step, self.next_position = tr.step, tr.data_position
        if self.version != tr.step:
            self._sync()
        self.source.fill(self, tr.step + max(self.source.lead, 1) - self.next_step)

    def _due(self) -> Buffered:
        tr = self.trainer
        entry = self.buffer.popleft()
        if self.source.in_order and (entry.step, entry.position) != (tr.step, tr.data_position):
            raise RuntimeError(f"async GRPO: the buffer holds step {entry.step + 1} at data position {entry.position} "
                               f"where step {tr.step + 1} at {tr.data_position} is due")
        return entry

    # ------------------------------------------------------------------ the step

    def step(self) -> dict[str, Any]:
        """One GRPO step (the module docstring): its metrics row."""
        try:
            return self._step()
        except BaseException as err:  # a KeyboardInterrupt or a library's sys.exit too
            self.source.failed(err)
            raise

    def _step(self) -> dict[str, Any]:
        tr = self.trainer
        t0 = time.perf_counter()
        self._fill()
        entry = self._due()
        if entry.rollout.group is not None:
            tr._write_samples(entry.rollout.group, step=entry.step)
        # Before anything trains on the step: a reward function that failed on every row
        # stops the run here (nothing drawn ahead, no optimizer step on zero rewards).
        not_applicable = tr.observe_rewards(entry.rollout)
        pending = self.source.ahead(self)  # the rollout side works while the update trains
        try:
            accepted, selection, epochs, trainer_logprobs, t_update = self._train(entry)
        finally:
            arrived = self.source.arrived(pending)  # re-raises the rollout's failure
        for ahead in arrived:
            self.append(ahead)
        tr.data_position = self.source.trained(entry, self.ledger)
        tr.step += 1
        self._sync()
        rollout = entry.rollout
        times = {"rollout": rollout.rollout_s, "update": t_update, "step": time.perf_counter() - t0}
        row = tr.metrics_row(rollout, epochs, trainer_logprobs, times, selection, not_applicable)
        if self.max_staleness is not None:
            row.update(self._figures(entry, accepted))
        row.update(self.sync.figures())
        if entry.token_versions is not None:
            row.update(token_staleness(step=tr.step - 1, versions=entry.token_versions))
        for drawn in self.source.settle(self, row):
            self.append(drawn)
        return row

    def _train(self, entry: Buffered) -> tuple:
        """Train ``entry`` (the step due): groups staler than ``max_staleness`` refused
        (zero advantage), then the optimizer steps. Returns ``(accepted [G] or None,
        selection scalars, epochs' metrics, the trainer's log-probs per row, the update's
        seconds)``."""
        tr, rollout, k = self.trainer, entry.rollout, self.group_size
        advantages, accepted = tr.advantages(rollout), None
        if self.max_staleness is not None:
            accepted = accepted_groups(step=tr.step, versions=entry.versions, max_staleness=self.max_staleness,
                                       group_size=k)
            advantages = refuse(advantages, accepted, group_size=k)
        selection = tr.selection_scalars(rollout, advantages)
        t1 = time.perf_counter()
        epochs, trainer_logprobs = tr.optimize(tr.update_batch(rollout, advantages))
        trainer_logprobs = tr.row_logprobs(trainer_logprobs, rollout.output.tokens.shape)
        return accepted, selection, epochs, trainer_logprobs, time.perf_counter() - t1

    def _figures(self, entry: Buffered, accepted: np.ndarray) -> dict[str, Any]:
        """The asynchronous figures of a trained step: the staleness of the entry's rows
        against the step just trained, the refused groups, the steps still buffered and
        the entry's data position."""
        stale = staleness(step=self.trainer.step - 1, versions=entry.versions)
        return {
            "async/staleness_mean": float(stale.mean()),
            "async/staleness_max": int(stale.max()),
            "async/refused_groups": int((~accepted).sum()),
            "async/buffered_steps": len(self.buffer),
            "async/data_position": entry.position,
        }

    # ------------------------------------------------------------------ checkpoint

    def saved(self, state: dict[str, Any], meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The checkpoint's items and metadata: the trainer's ``state`` as the source holds
        it, and the buffer in the one format (:mod:`grpo.engine.loop.buffer`)."""
        items = dict(self.source.held(state))
        if self.max_staleness is None:
            return items, meta
        specs, arrays = [], {}
        for entry in self.buffer if self.source.checkpoints_buffer else ():
            spec, host = self.source.stored(entry)
            specs.append(spec)
            arrays.update({key(spec, name): x for name, x in host.items()})
        if arrays:
            items["buffer"] = arrays
        meta = {**meta, "partial_trained_ahead": sorted(self.ledger.ahead),
                "async": {"entries": specs, "max_staleness": self.max_staleness}}
        # The rows in flight: in the same step as the params.
        keep_inflight(items, meta, self.source.inflight() if self.source.checkpoints_buffer else None)
        return items, meta

    def held_like(self, state: dict[str, Any]) -> dict[str, Any]:
        """What the checkpoint's trainer state restores into."""
        return self.source.held_like(state)

    def placed(self, restored: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        """The restored trainer state where ``state`` lives."""
        return self.source.placed(restored, state)

    def restore(self, meta: dict[str, Any], read: Any) -> None:
        """After the trainer restored its state: the ledger and the buffer back (``meta``
        the checkpoint's; ``read(name, like)`` restores the item ``name`` into ``like``),
        and the rows in flight (``inflight``) to the source. A checkpoint without a buffer
        (a synchronous run's, or one whose source re-draws): the buffered steps are drawn
        again at the restored weights from the data position."""
        tr = self.trainer
        self.buffer.clear()
        self.next_step, self.version = None, -1
        self.ledger = Ledger(tr.data_position, meta.get("partial_trained_ahead", ()))
        self.source.reset(self.ledger)
        saved = read_inflight(meta, read) if self.source.checkpoints_buffer else None
        if saved is not None:
            self.source.resume_inflight(saved)
        specs = (meta.get("async") or {}).get("entries")
        if not specs or not self.source.checkpoints_buffer:
            return
        arrays = read("buffer", host_like(specs))
        up = tr.programs
        for spec in specs:
            host = {leaf["name"]: arrays[key(spec, leaf["name"])] for leaf in leaves(spec)}
            self.source.keep(spec, host)
            entry = placed(spec, host, rows=up.train_sharding, replicated=up.replicated)
            if not tr.is_main:  # the logged group is process 0's
                entry.rollout = dataclasses.replace(entry.rollout, group=None)
            self.append(entry)
        first = self.buffer[0]
        if first.step != tr.step or (self.source.in_order and first.position != tr.data_position):
            raise RuntimeError(f"async GRPO: the checkpoint's buffer starts at step {first.step + 1} (data position "
                               f"{first.position}) where its state is at step {tr.step + 1} ({tr.data_position})")

    def evaluate(self, evaluator: Any, step: int, params: Any) -> dict[str, Any]:
        """The evaluation row of the policy at ``step`` (``params``), where the source
        says it runs (split by processes: on the rollout side)."""
        return self.source.evaluate(evaluator, step, params)

    def close(self) -> None:
        self.source.close()
        self.sync.close()


__all__ = ["Loop"]
