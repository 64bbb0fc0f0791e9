"""The continuous engine's part of the run's shape schedule (:mod:`grpo.engine.schedule`):
its decode compiles once per bucket of live slots and page-table width, and
:func:`compile_decode_buckets` compiles every bucket ahead, in parallel, on a session's own
arguments (``train.compile.ahead: all``), so a rollout whose rows drain differently from
the first compiles no decode."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)


def decode_buckets(*, slots: int, shards: int, max_pages: int) -> list[tuple[int, int]]:
    """Every ``(n, W)`` the continuous engine's decode can run at, widest first: ``n``
    slots (a power of two per part of the pool, at most its ``slots / shards``, times the
    ``shards`` parts) over page tables ``W`` wide (a power of two, at most ``max_pages``):
    what :meth:`~grpo.engine.rollout.paged.scheduler.Scheduler.selection` can choose, so
    about ``log2(slots) x log2(max_pages)`` programs."""
    part = max(slots // max(shards, 1), 1)
    ns = sorted({min(1 << i, part) for i in range(part.bit_length() + 1)}, reverse=True)
    ws = sorted({min(1 << i, max_pages) for i in range(max(max_pages - 1, 0).bit_length() + 1)}, reverse=True)
    return [(n * shards, w) for n in ns for w in ws]


def compile_decode_buckets(engine: Any, *, params: Any, state: Any, keys: Any, stop_at: Any, impl: Any,
                           buckets: list[tuple[int, int]], workers: int | None = None) -> dict[str, float]:
    """``engine``'s decode (a :class:`~grpo.engine.rollout.continuous.ContinuousSampler`)
    at every one of ``buckets``, lowered on the session's own arguments (the concrete
    weights, state and keys it will call with; the slot arrays abstract at each bucket,
    placed as the runner places them) and compiled on a thread pool (XLA compiles in
    parallel across cores), so a chunk at any bucket hits jit's cache. Returns
    ``{"programs", "failed", "compile_s"}``; a bucket that fails to compile ahead is
    logged and compiles when a chunk takes it."""

    def compile_one(n: int, w: int) -> Any:
        def rows(*shape: int) -> Any:
            names = ("batch",) + (None,) * (len(shape) - 1)
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=engine.sharding(shape, names))

        return engine.decode_jit.lower(params, state, rows(n, w), rows(n), rows(n), keys, stop_at,
                                       key_impl=impl).compile()

    t0 = time.perf_counter()
    failed = 0
    workers = max(1, min(len(buckets), workers or os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpo-decode") as pool:
        futures = {pool.submit(compile_one, n, w): (n, w) for n, w in buckets}
        for future in concurrent.futures.as_completed(futures):
            if future.exception() is not None:
                failed += 1
                log.warning("compiling the decode at %s slots x %s pages ahead failed, it compiles when a chunk "
                            "takes it: %s", *futures[future], future.exception())
    return {"programs": len(buckets), "failed": failed, "compile_s": time.perf_counter() - t0}


__all__ = ["compile_decode_buckets", "decode_buckets"]
