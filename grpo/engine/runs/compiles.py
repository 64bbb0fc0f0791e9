"""The compiles a run makes, counted from JAX's own monitoring events, and JAX's
persistent compilation cache.

JAX (0.10.2) reports every program it compiles through :mod:`jax.monitoring`:

- ``/jax/core/compile/backend_compile_duration``: one XLA compile, or one load from the
  persistent cache (a program missing from the in-memory cache), with the program's name
  (``fun_name``, e.g. ``jit(update)``); its scalar twin is recorded when it starts;
- ``/jax/core/compile/jaxpr_trace_duration`` and ``.../jaxpr_to_mlir_module_duration``:
  tracing and lowering, which the persistent cache does not save;
- ``/jax/compilation_cache/compile_requests_use_cache`` and ``.../cache_hits``: lookups in
  the persistent cache and the ones it answered.

A :class:`CompileCounter` listens to them from its creation to :meth:`~CompileCounter.close`:
:meth:`~CompileCounter.read` gives what happened since the last read (a step's
``compile/count`` and ``time/compile_s``), :meth:`~CompileCounter.total` since creation.
Compiles on other threads (a thread pool compiling ahead of time, a background rollout)
count too; overlapping compiles count once in the wall time (``seconds``) and each in
``compile_s`` (compiler time).

:func:`use_cache` points JAX's persistent compilation cache at a run's directory (or a
bucket: ``gs://`` works as JAX supports it), with thresholds that keep every program.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from typing import Any, Callable

log = logging.getLogger(__name__)

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HITS = "/jax/compilation_cache/cache_hits"
_SPANS = (TRACE, LOWER, BACKEND_COMPILE)


@dataclasses.dataclass(frozen=True)
class Compiles:
    """Compiles over some interval.

    ``count``: programs compiled by XLA or loaded from the persistent cache (each a program
    the process had not compiled before: a new function or a new shape);
    ``seconds``: wall time spent tracing, lowering and compiling (overlapping work once);
    ``compile_s``: the compiler's time, summed over programs (parallel compiles add up);
    ``cache_requests`` / ``cache_hits``: persistent-cache lookups and the ones it answered;
    ``programs``: the compiled programs' names, in the order they finished."""

    count: int = 0
    seconds: float = 0.0
    compile_s: float = 0.0
    cache_requests: int = 0
    cache_hits: int = 0
    programs: tuple[str, ...] = ()

    def __add__(self, other: Compiles) -> Compiles:
        return Compiles(self.count + other.count, self.seconds + other.seconds, self.compile_s + other.compile_s,
                        self.cache_requests + other.cache_requests, self.cache_hits + other.cache_hits,
                        self.programs + other.programs)

    def metrics(self) -> dict[str, float]:
        """A metrics row's keys: ``compile/count`` and ``time/compile_s`` (0 on a warm step)."""
        return {"compile/count": self.count, "time/compile_s": self.seconds}

    def summary(self) -> dict[str, Any]:
        """What ``summary.json`` records (names aside)."""
        return {"count": self.count, "seconds": round(self.seconds, 3), "compile_s": round(self.compile_s, 3),
                "cache_hits": self.cache_hits, "cache_misses": self.cache_requests - self.cache_hits}


class _Interval:
    """The events of one counter since its last read."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self.count = 0
        self.compile_s = 0.0
        self.requests = 0
        self.hits = 0
        self.programs: list[str] = []

    def close(self) -> Compiles:
        return Compiles(self.count, _union(self.spans), self.compile_s, self.requests, self.hits, tuple(self.programs))


def _union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by ``spans`` (nested traces and parallel compiles counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class CompileCounter:
    """Counts the compiles of this process (every thread) from its creation until
    :meth:`close`. ``on_start(name)``, if given, is called when XLA starts compiling (or
    loading) a program: what a progress bar shows while a step waits for the compiler."""

    def __init__(self, on_start: Callable[[str], None] | None = None):
        self.on_start = on_start
        self._lock = threading.Lock()
        self._since_read = _Interval()
        self._total = Compiles()
        _Hub.get().add(self)

    def read(self) -> Compiles:
        """The compiles since the last :meth:`read` (or since creation)."""
        with self._lock:
            out, self._since_read = self._since_read.close(), _Interval()
            self._total = self._total + out
        return out

    def total(self) -> Compiles:
        """Every compile since creation (what has not been read yet included)."""
        with self._lock:
            return self._total + self._since_read.close()

    def close(self) -> None:
        _Hub.get().remove(self)

    def __enter__(self) -> CompileCounter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ events (any thread)

    def _span(self, event: str, start: float, end: float, name: str | None) -> None:
        with self._lock:
            iv = self._since_read
            iv.spans.append((start, end))
            if event == BACKEND_COMPILE:
                iv.count += 1
                iv.compile_s += end - start
                iv.programs.append(str(name))

    def _event(self, event: str) -> None:
        with self._lock:
            if event == CACHE_REQUESTS:
                self._since_read.requests += 1
            elif event == CACHE_HITS:
                self._since_read.hits += 1


class _Hub:
    """JAX's listeners, registered once per process, fanned out to the live counters."""

    _instance: _Hub | None = None
    _guard = threading.Lock()

    def __init__(self) -> None:
        from jax import monitoring

        self.counters: weakref.WeakSet[CompileCounter] = weakref.WeakSet()
        self._lock = threading.Lock()
        monitoring.register_event_time_span_listener(self._on_span)
        monitoring.register_event_listener(self._on_event)
        monitoring.register_scalar_listener(self._on_scalar)

    @classmethod
    def get(cls) -> _Hub:
        with cls._guard:
            if cls._instance is None:
                cls._instance = _Hub()
            return cls._instance

    def add(self, counter: CompileCounter) -> None:
        with self._lock:
            self.counters.add(counter)

    def remove(self, counter: CompileCounter) -> None:
        with self._lock:
            self.counters.discard(counter)

    def _live(self) -> list[CompileCounter]:
        with self._lock:
            return list(self.counters)

    def _on_span(self, event: str, start_time: float, end_time: float, **kwargs: Any) -> None:
        if event in _SPANS:
            for c in self._live():
                c._span(event, start_time, end_time, kwargs.get("fun_name"))

    def _on_event(self, event: str, **kwargs: Any) -> None:  # noqa: ARG002
        if event in (CACHE_REQUESTS, CACHE_HITS):
            for c in self._live():
                c._event(event)

    def _on_scalar(self, event: str, value: float, **kwargs: Any) -> None:  # noqa: ARG002
        # JAX records the start of a compile as a scalar (its start time) under the
        # compile's own event name.
        if event != BACKEND_COMPILE:
            return
        for c in self._live():
            if c.on_start is not None:
                try:
                    c.on_start(str(kwargs.get("fun_name")))
                except Exception:  # noqa: BLE001 - a display must never fail a compile
                    log.debug("compile start callback failed", exc_info=True)


# --------------------------------------------------------------------------- the persistent cache

CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
CACHE_NAME = ".jax_cache"


def cache_dir(setting: str | bool | None, run_dir: Any) -> str | None:
    """Where a run's persistent compilation cache lives, from ``train.compile.cache_dir``:
    ``"auto"``: JAX's own ``JAX_COMPILATION_CACHE_DIR`` when set, else ``.jax_cache`` beside
    the run directory (``runs/.jax_cache`` for ``runs/NAME-STAMP``; in the bucket for a
    ``gs://`` run directory); a path or URL: that; ``None``/``False``: no cache."""
    from grpo.engine.runs import rundir

    if setting is None or setting is False:
        return None
    if setting == "auto":
        env = os.environ.get(CACHE_ENV)
        if env:
            return env
        return os.fspath(rundir.path(run_dir).parent / CACHE_NAME)
    return os.fspath(rundir.path(setting))


def use_cache(directory: str | None) -> str | None:
    """Point JAX's persistent compilation cache at ``directory`` (``None``: off) for the
    compiles that follow in this process; returns the directory in use (``None`` when off,
    or when it cannot be created: the run then compiles everything, with a warning).

    Every program is kept (``jax_persistent_cache_min_compile_time_secs`` 0 on a local
    disk: a read costs about a millisecond, less than compiling even the smallest glue
    program; 1 s in a bucket, where each entry is one object read at start-up), whatever
    its size (``jax_persistent_cache_min_entry_size_bytes`` -1)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    from grpo.engine.runs import rundir

    if directory is not None:
        try:
            rundir.path(directory).mkdir(parents=True, exist_ok=True)
        except Exception as err:  # noqa: BLE001 - the cache saves time; a run does not need it
            log.warning("the persistent compilation cache is off: %s cannot be created (%s); set "
                        "train.compile.cache_dir to a writable directory, or null to turn it off", directory, err)
            directory = None
    if directory is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0 if rundir.is_remote(directory) else 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    on = directory is not None
    if (directory, on) != (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache):
        # Off is off: no cache keys hashed, no lookups. JAX opens its cache once per process,
        # at the first compile: a new place needs a reset.
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_enable_compilation_cache", on)
        compilation_cache.reset_cache()
    return directory


__all__ = ["CACHE_NAME", "CompileCounter", "Compiles", "cache_dir", "use_cache"]
