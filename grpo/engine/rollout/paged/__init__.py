"""The continuous engine's core, in the parts serving engines split it into (vLLM v1's
scheduler, KV-cache manager and engine core):

- ``pages``: the paged KV cache's host side, which pool pages each decode slot holds
  (:class:`PageAllocator`);
- ``scheduler``: the queue, the slots, refill at chunk boundaries and eviction
  (:class:`Scheduler`; :class:`TurnScheduler` for multi-turn rows that park their pages
  between turns);
- ``slots``: ``rollout.continuous.slots: auto``, the slot count of a rollout
  (:func:`~grpo.engine.rollout.paged.slots.auto_slots`);
- ``buckets``: the decode's buckets (live slots x page-table width), listed and compiled
  ahead in parallel (the engine's part of :mod:`grpo.engine.schedule`);
- ``core``: the one loop, schedule -> run -> read the boundary (:class:`EngineCore`),
  over a runner: the engine's jitted programs (:class:`DeviceRunner`) or a cost model
  (:class:`SimulatedRunner`, what ``grpo plan --lengths`` runs).

Only the engine's own room imports these (``grpo.engine.rollout.continuous`` and its
multi-turn rows); every feeder talks to the engine through the contract
(:class:`grpo.core.contracts.engine.RolloutEngine`).
"""

from grpo.engine.rollout.paged.pages import PageAllocator, PoolExhausted

__all__ = ["PageAllocator", "PoolExhausted"]
