"""Weight syncs: how the trainer's weights reach the rollout side, once a version.

:meth:`WeightSync.sync` ``(params, version)`` is the one function through which weights
go to the rollout side (the loop calls it before a draw at a version the rollout side
does not hold yet, and after every update); :meth:`WeightSync.sampler_params` is what
the rollout side's sampler then reads. Three of them:

- :class:`SameDevices` (synchronous GRPO): the sampler reads the update's own weights;
  nothing moves.
- :class:`OtherMesh` (asynchronous GRPO in one process): one resharding ``device_put``
  onto the rollout mesh, dispatched and not waited for: the main thread goes on (logs,
  checkpoint, the next step's batch) and the next rollout's first program waits for the
  weights on the device side (``time/train/weight_sync_s``: that transfer's seconds
  from dispatch to arrival, timed by a thread that waits for it;
  ``time/train/weight_sync_dispatch_s``: what the main thread spent dispatching it).
- two processes: the weights cross in the step's exchange
  (:class:`~grpo.engine.loop.processes.ProcessLink`, which is the run's source and its
  sync at once).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import jax


class WeightSync:
    """The interface. :meth:`sync` is the one place weights enter the rollout side (the
    place for an engine's ``update_weights``); a sync says only how they :meth:`move`
    there."""

    programs: Any = None  # the rollout side's (the program builder's on its mesh)
    frozen: Any = None  # the LoRA base on the rollout side (None: no LoRA)
    params: Any = None  # the last synced weights, on the rollout side

    def sync(self, params: Any, version: int) -> None:
        """The trainer's weights ``params`` (version ``version``: optimizer steps applied)
        to the rollout side."""
        del version
        self.params = self.move(params)

    def move(self, params: Any) -> Any:
        """``params`` where the rollout side reads them."""
        raise NotImplementedError

    def sampler_params(self) -> Any:
        """What the rollout side's sampler reads: the last synced weights, in the whole
        model's state (base and adapters, no copies), or for ``model.lora.sampler:
        merged`` the projections with the adapters merged in."""
        return self.programs.sampler_state(self.params, self.frozen)

    def figures(self) -> dict[str, float]:
        """The step's metrics of the weights' move (read after the step's :meth:`sync`)."""
        return {}

    def close(self) -> None:
        pass


class SameDevices(WeightSync):
    """The rollout reads the update's weights where they are (as
    :meth:`~grpo.engine.trainer.Trainer.policy_params` does). The update donates them, so
    the loop syncs again after every update."""

    def __init__(self, programs: Any, frozen: Any):
        self.programs, self.frozen = programs, frozen

    def move(self, params: Any) -> Any:
        return params


class OtherMesh(WeightSync):
    """The weights resharded onto the rollout mesh (``programs``: the rollout side's, by
    the program builder). The LoRA base never changes: it moves once, here."""

    def __init__(self, programs: Any, params: Any, frozen: Any):
        from grpo.engine.rollout.layout import state_shardings
        from grpo.sharding import PARAM_RULES

        self.programs = programs
        self.shardings = state_shardings(params, programs.mesh, PARAM_RULES)
        self.frozen = None if frozen is None else jax.device_put(
            frozen, state_shardings(frozen, programs.mesh, PARAM_RULES))
        self.dispatch_s = 0.0
        self.previous_s = 0.0
        self._arrival: concurrent.futures.Future | None = None  # the last transfer's seconds to arrival
        self._waiter: concurrent.futures.ThreadPoolExecutor | None = None

    def move(self, params: Any) -> Any:
        """One resharding transfer, dispatched and not waited for (the programs reading
        ``self.params`` wait on the devices; the update's donation of the source waits
        for the transfer's reads)."""
        # The transfer the step's rollout drew with: arrived, since that rollout is complete.
        self.previous_s = 0.0 if self._arrival is None else self._arrival.result()
        t = time.perf_counter()
        moved = jax.device_put(params, self.shardings)
        self.dispatch_s = time.perf_counter() - t

        def arrival() -> float:
            jax.block_until_ready(moved)
            return time.perf_counter() - t

        if self._waiter is None:
            self._waiter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-weight-sync")
        self._arrival = self._waiter.submit(arrival)
        return moved

    def figures(self) -> dict[str, float]:
        # The transfer the step's rollout drew with, and the dispatch of the new one.
        return {"time/train/weight_sync_s": self.previous_s, "time/train/weight_sync_dispatch_s": self.dispatch_s}

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
            self._waiter = None


__all__ = ["OtherMesh", "SameDevices", "WeightSync"]
