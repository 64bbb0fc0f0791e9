"""``rollout.continuous.slots: auto``: how many decode slots a rollout of ``rows`` rows gets.

The rule (measured with ``grpo bench rollout --lengths``, see :func:`auto_slots`): every
row at once while the page pool holds them, else as many rows as the pool holds at half
the length cap. Pure host arithmetic, so the plan, the bench and a run agree on it.
"""

from __future__ import annotations

import math


def auto_slots(rows: int, *, shards: int = 1, pool_pages: int = 0, prompt_length: int = 0, cap: int = 1,
               page_size: int = 16) -> int:
    """Decode slots for a rollout of ``rows`` rows under ``slots: auto``.

    - ``pool_pages`` 0 (a pool sized for every slot at the cap, the static cache's bytes):
      ``rows``, every row at once. A synchronous rollout cannot end before its longest row,
      so every row at once decodes the fewest steps and chunks (host boundaries), prefills
      every prompt once in one batch, and each chunk still computes only its live slots
      (padded to a power of two) over their live pages; fewer slots add chunks and refill
      prefills for slot-steps that the live-slot decode already saves (the bench at the
      built-in GSM8K profile: see the README's rollout-engine section).
    - ``pool_pages`` > 0 (pages per part of the pool, one part per of ``shards`` devices
      along the rows' axes): the rows the pool holds at ``prompt_length`` + half the
      ``cap`` (rounded up to pages), ``shards`` times that per part, at least one row a
      part and at most ``rows``: a row longer than that grows into pages the shorter ones
      left free, and a row that cannot grow is evicted and restarts (same tokens).
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1 (got {rows})")
    if pool_pages <= 0:
        return rows
    per_row = max(1, math.ceil((prompt_length + math.ceil(cap / 2)) / page_size))
    return max(1, min(rows, max(shards, 1) * max(pool_pages // per_row, 1)))


__all__ = ["auto_slots"]
