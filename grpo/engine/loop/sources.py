"""Rollout sources: where the loop's buffered rollouts come from.

Every source yields the same record (:class:`~grpo.engine.loop.buffer.Buffered`: the
rollout, its data positions and each row's policy version), drawn at the step and data
position the loop's cursor names, with the weights the loop's
:class:`~grpo.engine.loop.sync.WeightSync` last gave the rollout engine
(``update_weights``). Three of them:

- :class:`InlineSource` (synchronous GRPO): the step's rollout drawn when it is due, on
  the update's own devices (:meth:`~grpo.engine.rollout.step.StepCollector.collect`).
- :class:`BackgroundSource` (asynchronous GRPO in one process): drawn on the rollout
  mesh by one worker thread while the main thread runs the update, up to
  ``max_staleness`` steps ahead, and moved to the update mesh. That is safe because the
  run is one process: the two sides' programs run on disjoint devices and share no
  collective, so no cross-process ordering exists to break. Only the main thread touches
  the trainer's state, the logs and the weights.
  :class:`PartialSource` is its partial-rollouts form
  (:mod:`grpo.engine.rollout.partial`): one stream that lives across steps, at most one
  step ahead; a step's batch is the first groups to finish, rows in flight at a weight
  change go on under the new weights, each token records its version, and a row is as
  stale as its oldest token.
- another process: :class:`~grpo.engine.loop.processes.ProcessLink`.

A source does not own the data position: the loop's ledger
(:class:`~grpo.engine.rollout.partial.Ledger`) does, and a source only reports which
positions a trained entry consumed (:meth:`RolloutSource.trained`).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import numpy as np

from grpo.engine.loop.buffer import Buffered, RolloutFailed, moved, stored
from grpo.engine.rollout.partial import Ledger, PartialRollouts, oldest_versions


def _collected(collector: Any, *, step: int, position: int, version: int, sample_group: bool) -> Buffered:
    """A whole step's rollout (:meth:`~grpo.engine.rollout.step.StepCollector.collect`),
    every row at ``version``."""
    rollout = collector.collect(step=step, position=position, sample_group=sample_group)
    return Buffered(step=step, position=position, versions=np.full(rollout.rewards.shape[0], version, np.int64),
                    rollout=rollout)


def partial_entry(partial: PartialRollouts, *, step: int, version: int, sample_group: bool) -> Buffered:
    """Step ``step``'s batch of partial rollouts at policy ``version`` (the stream feeds
    the groups not yet trained, from the ledger): its groups' data positions, each row's
    oldest token version and every token's."""
    rollout, token_versions, positions = partial.draw(step=step, version=version, sample_group=sample_group)
    return Buffered(step=step, position=min(positions), versions=oldest_versions(token_versions), rollout=rollout,
                    token_versions=token_versions, positions=positions)


class RolloutSource:
    """The interface, with the defaults of a source drawn in this process, in data order."""

    # Steps drawn ahead of the update: the buffer holds steps s .. s + max(lead, 1) - 1
    # before step s trains, and step s + lead is drawn while it trains (0: none).
    lead = 0
    # Whether a checkpoint keeps the buffered entries (else a resume draws them again,
    # from the ledger).
    checkpoints_buffer = False
    # Whether batches come in data order (each starts where the ledger's frontier is).
    in_order = True

    def evaluate(self, evaluator: Any, step: int, params: Any) -> dict[str, Any]:
        """The evaluation of the trainer's weights ``params`` at ``step``: here."""
        return evaluator(step, params)

    def reset(self, ledger: Ledger) -> None:
        """Forget what is in flight (after a resume), drawing from ``ledger`` next."""

    def draw(self, *, step: int, position: int, version: int, sample_group: bool) -> Buffered:
        """Step ``step``'s rollout from data ``position`` at policy ``version`` (the
        weights the sync gave the rollout engine), in line."""
        raise NotImplementedError

    def fill(self, loop: Any, count: int) -> None:
        """Draw the next ``count`` steps in line into ``loop``'s buffer."""
        for _ in range(count):
            loop.append(self.draw(**loop.cursor()))

    def ahead(self, loop: Any) -> Any:
        """Start drawing the step after the buffer's last while the update trains (a
        handle for :meth:`arrived`), or None."""
        return None

    def arrived(self, pending: Any) -> list[Buffered]:
        """What :meth:`ahead` drew (waiting for it; re-raises its failure)."""
        return []

    def settle(self, loop: Any, row: dict[str, Any]) -> list[Buffered]:
        """The step's end, once its row is built: the entries that arrive with it."""
        return []

    def trained(self, entry: Buffered, ledger: Ledger) -> int:
        """Record ``entry``'s data positions trained in ``ledger`` (its groups' own under
        partial rollouts, else the run from its position): the new frontier."""
        if entry.positions is not None:
            return ledger.record(entry.positions)
        return ledger.record(range(entry.position, entry.position + entry.rollout.prompts_drawn))

    def stored(self, entry: Buffered) -> tuple[Any, dict[str, np.ndarray]]:
        """``entry`` in the checkpoint format (:func:`~grpo.engine.loop.buffer.stored`)."""
        return stored(entry)

    def keep(self, spec: Any, arrays: dict[str, np.ndarray]) -> None:
        """A checkpoint's entry, as stored, restored into the buffer."""

    def inflight(self) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """The rows in flight for a checkpoint (JSON, host arrays), or None: nothing is
        in flight between steps (whole batches), or it is drawn again after a resume."""
        return None

    def resume_inflight(self, saved: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        """A checkpoint's :meth:`inflight`, to go on from (after :meth:`reset`)."""

    def failed(self, err: BaseException) -> None:
        """The step failed on this side with ``err`` (a source with a far end tells it)."""

    # The trainer's state (params, optimizer) as a checkpoint holds it: as it is, here.
    def held(self, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def held_like(self, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def placed(self, restored: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        return restored

    def close(self) -> None:
        pass


class InlineSource(RolloutSource):
    """The synchronous collect, on the update's devices, when the step is due."""

    def __init__(self, collector: Any):
        self.collector = collector

    def draw(self, *, step: int, position: int, version: int, sample_group: bool) -> Buffered:
        return _collected(self.collector, step=step, position=position, version=version, sample_group=sample_group)


class BackgroundSource(RolloutSource):
    """Whole batches drawn on the rollout mesh (``collector``: built on its programs) by a
    worker thread, ``max_staleness`` steps ahead, moved to the update mesh
    (``update``: the update's programs)."""

    checkpoints_buffer = True

    def __init__(self, collector: Any, *, update: Any, max_staleness: int):
        self.collector = collector
        self.lead = max_staleness
        self.rows, self.replicated = update.train_sharding, update.replicated
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-rollout")

    def _drawn(self, *, step: int, position: int, version: int, sample_group: bool) -> Buffered:
        return _collected(self.collector, step=step, position=position, version=version, sample_group=sample_group)

    def draw(self, *, step: int, position: int, version: int, sample_group: bool) -> Buffered:
        """Drawn on the rollout mesh and moved to the update mesh (a failure says where)."""
        try:
            entry = self._drawn(step=step, position=position, version=version, sample_group=sample_group)
        except Exception as err:
            raise RolloutFailed(
                f"async GRPO: the rollout of step {step + 1} (data position {position}, policy version {version}) "
                f"failed on the rollout mesh: {type(err).__name__}: {err}"
            ) from err
        entry.rollout = moved(entry.rollout, rows=self.rows, replicated=self.replicated)
        return entry

    def ahead(self, loop: Any) -> Any:
        if self.lead == 0:
            return None
        return self._pool.submit(self.draw, **loop.cursor())

    def arrived(self, pending: Any) -> list[Buffered]:
        return [] if pending is None else [pending.result()]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class PartialSource(BackgroundSource):
    """Partial rollouts: one stream across steps (:class:`PartialRollouts`), at most one
    step ahead (so that rows may go on across weight changes within the staleness
    budget). A checkpoint keeps the buffered batch and the stream's rows in flight
    (:meth:`~grpo.engine.rollout.partial.PartialStream.snapshot`), so a resume neither
    loses a token nor draws one twice; with an engine that cannot checkpoint its rows, a
    resume re-feeds the groups not yet trained from the ledger's frontier, skipping its
    groups trained ahead."""

    in_order = False

    def __init__(self, collector: Any, *, update: Any, max_staleness: int):
        super().__init__(collector, update=update, max_staleness=max_staleness)
        self.partial = PartialRollouts(collector, max_staleness=max_staleness)
        self.lead = min(max_staleness, 1)
        self.checkpoints_buffer = self.partial.keeps_rows

    def inflight(self) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        return self.partial.snapshot()

    def resume_inflight(self, saved: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        self.partial.saved = saved

    def reset(self, ledger: Ledger) -> None:
        self.partial.reset(frontier=ledger.frontier, ahead=sorted(ledger.ahead))
        self.partial.ledger = ledger  # the loop's: the stream feeds from it, trained() records in it

    def _drawn(self, *, step: int, position: int, version: int, sample_group: bool) -> Buffered:
        del position  # the stream feeds the groups not yet trained, from the ledger
        return partial_entry(self.partial, step=step, version=version, sample_group=sample_group)

    def trained(self, entry: Buffered, ledger: Ledger) -> int:
        # The frontier of the trained groups (they finish out of data order).
        return self.partial.trained(entry.positions)


__all__ = ["BackgroundSource", "InlineSource", "PartialSource", "RolloutSource", "partial_entry"]
