"""Where reward calls run: on the calling thread, on daemon threads, or in child processes,
each call bounded by ``task.reward_timeout_s``.

:class:`RewardPool` runs each reward function's calls in a *lane* of its own: at most
``threads`` calls of one function at once (1 by default: a function written for TRL,
which calls it in series, need not be thread-safe), different functions side by side.
The functions named in ``task.process_rewards`` run in child processes instead, at most
``processes`` at once each: CPU-heavy Python (a symbolic verifier) then runs beside the
decode and the other rewards instead of holding the interpreter's lock. A child process
calls the function on its main thread, so a function that uses ``signal`` (math-verify's
own timeouts) works there, and not on a thread.

Timeouts. A call's clock starts when a worker picks it up (time queued behind another
call of the same function does not count). A watchdog thread fails a call still running
at its deadline with :class:`RewardTimeout`, and hands its lane's slot to a fresh worker:
Python cannot kill a thread, so a hung call keeps its (daemon) thread until it returns and
its result is dropped; a hung child process is killed. A hung call never blocks a later
one, nor the process's exit.

Without a timeout, threads or processes (:meth:`RewardPool.inline`), every call runs at
once on the calling thread: the scoring of a run that asks for none of this is what it
always was.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import heapq
import inspect
import itertools
import multiprocessing
import threading
import time
from typing import Any, Callable, Mapping

from grpo.core.contracts.task import reward_values

Call = Callable[[], Any]


class RewardTimeout(Exception):
    """A reward call still running at its deadline (``task.reward_timeout_s``)."""


class RemoteError(Exception):
    """A reward call that raised in a child process; ``str()`` is ``"Type: message"``."""


class _Job:
    __slots__ = ("future", "call", "remote", "lane", "deadline", "abandoned", "done", "worker")

    def __init__(self, call: Call, remote: tuple | None, lane: "_Lane"):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.call, self.remote, self.lane = call, remote, lane
        self.deadline = 0.0
        self.abandoned = self.done = False
        self.worker: Any = None


class _Lane:
    def __init__(self, name: str, width: int, process: bool):
        self.name, self.width, self.process = name, width, process
        self.queue: collections.deque[_Job] = collections.deque()
        self.running = 0
        self.children: list[Any] = []  # idle child processes (process lanes)


class RewardPool:
    """Reward calls on workers (see the module docstring). ``timeout_s``: each call's
    limit (None: none); ``threads``: calls of one function at once on threads;
    ``processes``: at once in child processes, for the lanes named in ``process_lanes``;
    ``spec``: what a child needs to rebuild those functions (``(task name, options)``)."""

    def __init__(self, *, timeout_s: float | None, threads: int = 1, processes: int = 0,
                 process_lanes: tuple[str, ...] = (), spec: tuple[str, dict] | None = None):
        self.timeout_s = timeout_s
        self.threads, self.processes = max(1, int(threads)), int(processes)
        self.process_lanes = set(process_lanes)
        self.spec = spec
        self._lock = threading.Condition()
        self._lanes: dict[str, _Lane] = {}
        self._deadlines: list[tuple[float, int, _Job]] = []
        self._ids = itertools.count()
        self._watchdog: threading.Thread | None = None
        self.timeouts = 0  # calls failed at their deadline, over the pool's life

    @staticmethod
    def inline() -> "RewardPool | None":
        """No pool: calls run at once on the caller's thread (see :func:`run_call`)."""
        return None

    # ------------------------------------------------------------------ submitting

    def submit(self, lane: str, call: Call, *, remote: tuple | None = None) -> concurrent.futures.Future:
        """Run ``call`` in ``lane`` (a reward's name); a process lane sends ``remote``
        (``(name, kind, args)``, see :func:`grpo.engine.rollout.scoring.invoke`) to a child."""
        with self._lock:
            ln = self._lanes.get(lane)
            if ln is None:
                process = lane in self.process_lanes and self.processes > 0
                ln = self._lanes[lane] = _Lane(lane, self.processes if process else self.threads, process)
            job = _Job(call, remote, ln)
            ln.queue.append(job)
            self._spawn(ln)
        return job.future

    def _spawn(self, ln: _Lane) -> None:  # under the lock
        """A worker for ``ln``'s queue while it has fewer than its width (each worker
        takes queued calls until none is left, then ends)."""
        if ln.queue and ln.running < ln.width:
            ln.running += 1
            threading.Thread(target=self._work, args=(ln,), name=f"grpo-reward-{ln.name}", daemon=True).start()

    def _work(self, ln: _Lane) -> None:
        child = None
        while True:
            with self._lock:
                if not ln.queue:
                    ln.running -= 1
                    if child is not None:
                        ln.children.append(child)
                    return
                job = ln.queue.popleft()
                if ln.process and child is None and ln.children:
                    child = ln.children.pop()
            try:
                if ln.process and (child is None or not child.alive()):
                    child = _Child(self.spec)  # its start-up is not the call's time
                self._started(job, child)
                outcome = (True, child.call(job.remote) if ln.process else job.call())
            except BaseException as err:  # noqa: BLE001 - a reward's failure is its row's, never the run's
                outcome = (False, err)
            with self._lock:
                if job.abandoned:  # the watchdog gave this worker's slot away
                    return
                job.done = True
            if outcome[0]:
                job.future.set_result(outcome[1])
            else:
                job.future.set_exception(outcome[1])

    def _started(self, job: _Job, child: "_Child | None") -> None:
        """The call's clock starts (its deadline, watched)."""
        with self._lock:
            job.worker = child
            if self.timeout_s is not None:
                job.deadline = time.monotonic() + self.timeout_s
                heapq.heappush(self._deadlines, (job.deadline, next(self._ids), job))
                self._ensure_watchdog()
                self._lock.notify_all()

    # ------------------------------------------------------------------ the watchdog

    def _ensure_watchdog(self) -> None:  # under the lock
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="grpo-reward-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while True:
            late: list[_Job] = []
            with self._lock:
                while not self._deadlines:
                    self._lock.wait()
                deadline, _, job = self._deadlines[0]
                if job.done:
                    heapq.heappop(self._deadlines)
                    continue
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
                heapq.heappop(self._deadlines)
                job.abandoned = True
                ln = job.lane
                ln.running -= 1
                self._spawn(ln)
                self.timeouts += 1
                late.append(job)
            for job in late:
                if isinstance(job.worker, _Child):
                    job.worker.kill()
                job.future.set_exception(RewardTimeout(f"the reward did not answer within {self.timeout_s:g} s "
                                                       "(task.reward_timeout_s)"))

    def close(self) -> None:
        """Kill the idle child processes (threads are daemons and end on their own)."""
        with self._lock:
            children = [c for ln in self._lanes.values() for c in ln.children]
            for ln in self._lanes.values():
                ln.children.clear()
        for c in children:
            c.kill()


# --------------------------------------------------------------------------- calling a reward function


@functools.lru_cache(maxsize=256)
def _keywords(fn: Any) -> tuple[frozenset[str], bool]:
    """(the keyword names ``fn`` takes, whether it takes ``**kwargs``); no signature to
    read (a builtin): every keyword."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return frozenset(), True
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = frozenset(n for n, p in sig.parameters.items() if p.kind in kinds)
    return names, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


def call_batched(fn: Any, completions: list[str], prompts: list[Any], columns: Mapping[str, list[Any]]) -> list[Any]:
    """``fn(completions=..., prompts=..., **columns)`` (a function without ``**kwargs`` gets
    the columns it names), its values as a list of ``len(completions)``: any iterable of
    numbers (a list, a tuple, a NumPy array, a tensor through ``tolist()``). TypeError or
    ValueError (a wrong length) when it is not that."""
    try:
        names, var_kw = _keywords(fn)
    except TypeError:  # unhashable callable
        names, var_kw = frozenset(), True
    kwargs = {k: v for k, v in columns.items() if k not in ("completions", "prompts") and (var_kw or k in names)}
    out = fn(completions=completions, prompts=prompts, **kwargs)
    return reward_values(out, field=getattr(fn, "__name__", "the batched reward"), expected=len(completions))

def invoke(fn: Any, kind: str, args: tuple) -> Any:
    """One call of a reward function: ``kind`` ``"one"`` (``args`` = completion, example:
    its value) or ``"batch"`` (``args`` = completions, prompts, columns: the list of
    :func:`call_batched`). What a worker thread and a child process both run."""
    if kind == "one":
        return fn(*args)
    return call_batched(fn, *args)


# --------------------------------------------------------------------------- child processes


class _Child:
    """A child process that rebuilds the task's reward functions once (from ``spec``) and
    then answers calls over a pipe, on its main thread."""

    def __init__(self, spec: tuple[str, dict] | None):
        if spec is None:
            raise RuntimeError("a process lane needs the task's spec (name, options)")
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(theirs, spec), name="grpo-reward", daemon=True)
        self.proc.start()
        theirs.close()
        ok, message = self.conn.recv()  # the child's functions are built (or why not)
        if not ok:
            self.kill()
            raise RemoteError(message)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def call(self, remote: tuple) -> Any:
        self.conn.send(remote)
        ok, value = self.conn.recv()  # EOFError when killed: the job was abandoned
        if not ok:
            raise RemoteError(value)
        return value

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()


def _child_main(conn: Any, spec: tuple[str, dict]) -> None:  # pragma: no cover - runs in a child process
    name, options = spec
    try:
        from grpo.core.plugins import get_plugins

        plugin = get_plugins().get("task", name)
        functions = plugin.reward_functions(options=plugin.parse_options(options))
    except BaseException as err:  # noqa: BLE001 - every call it was to answer fails with this
        conn.send((False, f"the reward process could not build task {name!r}'s rewards: {type(err).__name__}: {err}"))
        return
    conn.send((True, None))
    while True:
        try:
            reward, kind, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = (True, invoke(functions[reward], kind, args))
        except BaseException as err:  # noqa: BLE001 - sent back as the call's failure
            result = (False, f"{type(err).__name__}: {err}")
        conn.send(result)


__all__ = ["RemoteError", "RewardPool", "RewardTimeout", "call_batched", "invoke"]
