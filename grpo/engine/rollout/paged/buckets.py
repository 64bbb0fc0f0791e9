"""The continuous engine's part of the run's shape schedule (:mod:`grpo.engine.schedule`):
its decode compiles once per bucket of live slots and page-table width, and
:func:`compile_decode_buckets` compiles every bucket ahead, in parallel, on a session's own
arguments (``train.compile.ahead: all``), so a rollout whose rows drain differently from
the first compiles no decode. :func:`engine_shapes` lists the engine's programs at one
prompt width before a run's step 1 (the run's schedule compiles them ahead at every width
its prompts reach): ``start``, ``prefill`` at each admission size and the decode
buckets."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
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


def admissions(*, slots: int, rows: int, prompts: int) -> list[tuple[int, int]]:
    """Every ``(n, u)`` the engine's prefill can run at for ``rows`` rows of ``prompts``
    prompts over ``slots`` slots, widest first: ``n`` admitted rows padded to a power of
    two (at most ``slots``), ``u`` distinct prompts among them, padded to a power of two
    (at most ``n``): :meth:`~grpo.engine.rollout.continuous.ContinuousSampler.prefill_rows`'s
    shapes."""
    from grpo.engine.rollout.paged.scheduler import pow2

    out = {(min(pow2(a), slots), min(pow2(f), min(pow2(a), slots)))
           for a in range(1, min(slots, rows) + 1) for f in range(1, min(a, prompts) + 1)}
    return sorted(out, reverse=True)


def engine_shapes(engine: Any, params: Any, *, prompts: int, prompt_length: int, key: Any,
                  every: bool) -> list[tuple[str, str, Any]]:
    """``(program, shape, lower)`` of ``engine``'s programs (a
    :class:`~grpo.engine.rollout.continuous.ContinuousSampler`) in a rollout of
    ``prompts`` prompts padded to ``prompt_length`` (what its ``generate`` runs), lowered
    on the abstract ``params`` and ``key``'s kind with the very arguments its runner passes
    (the state: ``start``'s outputs): ``start``, and with ``every`` ``prefill`` at each of
    :func:`admissions` and ``decode`` at each of :func:`decode_buckets`; without, only the
    first admission's prefill (every row admitted that fits, each group's prompt once:
    what every rollout runs first), the decode buckets compiling when a chunk first
    reaches them (``train.compile.ahead: auto`` on the CPU)."""
    from grpo.engine.rollout.paged.scheduler import pow2

    rows = prompts * engine.sampling.num_generations
    S = engine.slots_for(rows, prompt_length)
    alloc = engine._allocator(prompt_length, S)
    raw, impl = engine._abstract_key(key)
    lock, held = threading.Lock(), {}

    def start() -> Any:
        return engine.start_jit.lower(params, rows=rows, pages=alloc.pages, slots=S)

    def state() -> Any:  # start's outputs, compiled once (the pool's other shapes wait for it)
        with lock:
            if "state" not in held:
                compiled = start().compile()  # its outputs, abstract, in the shardings it gives them
                held["state"] = jax.tree.map(lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s),
                                             compiled.out_info, compiled.output_shardings)
            return held["state"]

    def arr(*shape: int, names: tuple = ("batch",)) -> Any:
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=engine.sharding(shape, names))

    def prefill(n: int, u: int) -> Any:
        tok = arr(u, prompt_length, names=("batch", "length"))
        return engine.prefill_jit.lower(params, state(), tok, tok, arr(n), arr(n), arr(n),
                                        arr(n, alloc.max_pages, names=("batch", None)), raw, None, key_impl=impl)

    def decode(n: int, w: int) -> Any:
        return engine.decode_jit.lower(params, state(), arr(n, w, names=("batch", None)), arr(n), arr(n), raw, None,
                                       key_impl=impl)

    at = f"prompt={prompt_length}"
    first = min(pow2(min(S, rows)), S)
    admit = admissions(slots=S, rows=rows, prompts=prompts) if every else [(first, min(pow2(prompts), first))]
    out = [("start", at, start)]
    out += [("prefill", f"{at} rows={n} prompts={u}", functools.partial(prefill, n, u)) for n, u in admit]
    if every:
        out += [("decode", f"{at} slots={n} pages={w}", functools.partial(decode, n, w))
                for n, w in decode_buckets(slots=alloc.slots, shards=alloc.shards, max_pages=alloc.max_pages)]
    return out


__all__ = ["admissions", "compile_decode_buckets", "decode_buckets", "engine_shapes"]
