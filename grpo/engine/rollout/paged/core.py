"""The continuous engine's one loop: schedule -> run -> read the boundary.

:class:`EngineCore` drives a :class:`~grpo.engine.rollout.paged.scheduler.Scheduler` (the
queue, the slots, refill and eviction over the page allocator) and a runner:

- :class:`DeviceRunner`: the engine's jitted programs (prefill, decode) over the device
  state, reading three [slots] arrays at each chunk boundary;
- the multi-turn rows' runner (:mod:`grpo.engine.rollout.continuous_multiturn`): the
  same, appending a returning row's next turn into its pages instead of prefilling it;
- :class:`SimulatedRunner`: no model, rows of known lengths (what ``grpo plan
  --lengths`` costs).

One :meth:`EngineCore.step` is one chunk: the live rows are given the pages of the chunk
(evicting while the pool is short), queued rows are admitted into free slots and
prefilled, every live slot decodes ``chunk`` steps, and the boundary is read: the rows
that finished leave their slots (:class:`~grpo.core.contracts.engine.Progress`). Between two
steps a caller may submit rows, read finished ones, continue a multi-turn row or hand the
engine new weights: whatever runs next reads them.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np

from grpo.core.contracts.engine import Progress
from grpo.engine.rollout.paged.scheduler import Scheduler, pow2


class Runner(Protocol):
    """What executes a schedule (the device programs or a cost model)."""

    def admit(self, admitted: list[tuple[int, int]]) -> None:
        """Prefill the admitted ``(slot, row)`` pairs."""

    def decode(self, idx: np.ndarray, table: np.ndarray, slot_rows: np.ndarray) -> None:
        """One chunk of the slots ``idx`` over their page tables."""

    def boundary(self) -> tuple[np.ndarray, np.ndarray]:
        """Each slot's ``done`` and ``lengths`` [slots] on the host."""


def mark_versions(versions: np.ndarray, marks: np.ndarray, *, rows: np.ndarray, drawn: np.ndarray,
                  version: int) -> None:
    """Record that ``rows`` [n] have drawn ``drawn`` [n] tokens by now, those past their
    ``marks`` (tokens already versioned) under ``version`` (in place: ``versions`` [R, N],
    ``marks`` [R])."""
    for r, d in zip(rows, drawn):
        versions[r, marks[r]:d] = version
        marks[r] = max(marks[r], d)


class EngineCore:
    """The one continuous-batching loop over ``scheduler`` and ``runner``.

    ``versions``: keep every token's policy version (``[rows, cap]`` on the host, -1
    undrawn), stamped at each boundary with :attr:`version` (what
    :meth:`~grpo.core.contracts.engine.RolloutEngine.update_weights` set)."""

    def __init__(self, scheduler: Scheduler, runner: Runner, *, rows: int, versions: bool = False):
        self.sched, self.runner = scheduler, runner
        self.version = 0
        self.versions = np.full((rows, scheduler.cap), -1, np.int64) if versions else None
        self.marks = np.zeros(rows, np.int64)
        self.chunks = self.slot_steps = 0
        self._grow: np.ndarray | None = None  # the last boundary's lengths: live rows grow at the next step
        # on_weight_change: reprefill: at a new version, the rows in flight rebuild their pages
        # under the new weights before the next chunk (runner.refresh).
        self.reprefill = self.refresh_pending = False
        self.refreshed_rows = self.refreshed_tokens = 0
        # Tokens drawn a second time: a row evicted and admitted again restarts from its
        # first token (its earlier draws are counted here, from its version marks).
        self.regenerated_tokens = 0

    # ------------------------------------------------------------------ rows

    def submit(self, ids: np.ndarray, prompt_len: np.ndarray) -> None:
        """Queue rows ``ids`` (after those already queued) whose prompts hold ``prompt_len`` tokens."""
        self.sched.prompt_len[ids] = prompt_len
        self.sched.queue.extend(int(r) for r in ids)
        self.marks[ids] = 0  # a new row under these ids: nothing drawn yet

    def in_flight(self) -> int:
        """Rows decoding or queued."""
        return sum(1 for r in self.sched.slot_row if r >= 0) + len(self.sched.queue)

    # ------------------------------------------------------------------ the loop

    def step(self) -> Progress:
        """One chunk (see the module docstring); ``idle`` when nothing was left to run."""
        sched = self.sched
        if self._grow is not None:
            sched.grow_live(self._grow)
            self._grow = None
        if self.refresh_pending:
            self.refresh_pending = False
            held = [(s, r) for s, r in enumerate(sched.slot_row) if r >= 0]
            if held:
                self.refreshed_rows += len(held)
                self.refreshed_tokens += self.runner.refresh(held)
        admitted = sched.admit()
        if admitted:
            if self.versions is not None:  # a row (re)starts from its first token
                for _, r in admitted:
                    self.regenerated_tokens += int(self.marks[r])
                    self.versions[r], self.marks[r] = -1, 0
            self.runner.admit(admitted)
        if not sched.live():
            return Progress(idle=True)
        idx, table = sched.selection()
        self.runner.decode(idx, table, np.asarray(sched.slot_row, np.int32)[idx])
        self.chunks += 1
        self.slot_steps += len(idx) * sched.chunk
        done, lengths = self.runner.boundary()
        if self.versions is not None:
            slots = [s for s, r in enumerate(sched.slot_row) if r >= 0]
            rows = np.asarray([sched.slot_row[s] for s in slots], np.int64)
            drawn = np.asarray([lengths[s] for s in slots], np.int64) - sched.prompt_len[rows] + 1
            mark_versions(self.versions, self.marks, rows=rows, drawn=drawn, version=self.version)
        finished = sched.release_done(done, lengths)
        self._grow = lengths
        return Progress(finished=tuple(finished))

    # ------------------------------------------------------------------ checkpoint

    def snapshot(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The session between two steps as JSON and host arrays (what a checkpoint keeps
        of the rows in flight): the queue, which row each slot holds and in what order
        they were admitted, the allocator's pages, the last boundary's lengths, the token
        versions and the runner's rows (:meth:`DeviceRunner.snapshot`). The KV cache is
        not kept: :meth:`restore` rebuilds it."""
        s, a = self.sched, self.sched.alloc
        if a._parked:
            raise NotImplementedError("a session with parked multi-turn rows cannot be checkpointed")
        order = sorted((slot for slot, r in enumerate(s.slot_row) if r >= 0), key=s.admitted_at.get)
        meta = {"cap": int(s.cap), "slot_row": [int(r) for r in s.slot_row], "order": order, "queue": [int(r) for r in s.queue],
                "version": int(self.version), "free": a._free, "held": a._held, "peak": int(a.peak),
                "grow": self._grow is not None, "regenerated_tokens": int(self.regenerated_tokens)}
        arrays = {"prompt_len": np.asarray(s.prompt_len, np.int64), "marks": self.marks.copy()}
        if self.versions is not None:
            arrays["versions"] = self.versions.copy()
        if self._grow is not None:
            arrays["grow"] = np.asarray(self._grow, np.int64)
        runner_meta, runner_arrays = self.runner.snapshot()
        meta["runner"] = runner_meta
        arrays.update({f"runner_{k}": v for k, v in runner_arrays.items()})
        return meta, arrays

    def restore(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> int:
        """A fresh session (same rows, slots and pool) put back where :meth:`snapshot`
        left it: every row in the slot it held, with the pages it held, its tokens so
        far and their versions, the queue in its order. The rows in slots rebuild their
        pages under the session's weights before the next chunk (the re-prefill of
        ``on_weight_change: reprefill``), then decode on from their next token. Returns
        the rows seated."""
        s, a = self.sched, self.sched.alloc
        saved = (len(meta["slot_row"]), len(sum(meta["free"] + meta["held"], [])), meta["cap"], len(arrays["marks"]))
        if saved != (a.slots, a.pages, s.cap, len(self.marks)):
            raise ValueError("the saved session has {} slots over {} pages, {} new tokens a row and {} rows; this one "
                             "{} slots over {} pages, {} and {}".format(*saved, a.slots, a.pages, s.cap, len(self.marks)))
        s.prompt_len[:] = arrays["prompt_len"]
        self.marks[:] = arrays["marks"]
        if self.versions is not None:
            self.versions[:] = arrays["versions"]
        a._free, a._held = [list(map(int, f)) for f in meta["free"]], [list(map(int, h)) for h in meta["held"]]
        a.peak = int(meta["peak"])
        s.queue.clear()
        s.queue.extend(meta["queue"])
        for slot in meta["order"]:  # admission order: eviction picks the latest
            s.slot_row[slot] = int(meta["slot_row"][slot])
            s.admitted_at[slot] = s.counter
            s.counter += 1
        self._grow = arrays["grow"] if meta["grow"] else None
        self.version = int(meta["version"])
        self.regenerated_tokens = int(meta.get("regenerated_tokens", 0))
        self.runner.restore(meta["runner"], {k[len("runner_"):]: v for k, v in arrays.items()
                                             if k.startswith("runner_")})
        self.refresh_pending = bool(meta["order"])  # the cache is rebuilt, not stored
        return len(meta["order"])

    def run(self) -> None:
        """Step until nothing is queued or running."""
        while not self.step().idle:
            pass

    def stats(self) -> dict[str, Any]:
        """The schedule's figures so far (``last_stats``)."""
        s, a = self.sched, self.sched.alloc
        return {"slots": a.slots, "chunk": s.chunk, "page_size": a.page_size, "chunks": self.chunks,
                "peak_pages": a.peak, "pool_pages": a.pages, "evictions": s.evictions, "prefills": s.prefills,
                "slot_steps": self.slot_steps, "refreshed_rows": self.refreshed_rows,
                "refreshed_tokens": self.refreshed_tokens}


class DeviceRunner:
    """The engine's programs over its device state (:class:`~grpo.engine.rollout.continuous.SlotState`).

    ``tokens``/``mask`` [rows, Lp] hold every row's prompt (left-aligned), ``widths``
    [rows] the prompt width each row's prefill pads to (rows admitted together pad to
    the widest: the static step's bucket), ``keys`` the rollout key (row ``r`` draws from
    ``fold_in(key, r)``) or each row's key [rows, ...] and ``impl`` its PRNG impl,
    ``stop_at`` [rows] (benchmarks) forced stop lengths. ``params`` is read at every
    program: a caller that swaps it between steps (partial rollouts) decodes the next
    chunk under the new weights."""

    def __init__(self, engine: Any, alloc: Any, *, tokens: np.ndarray, mask: np.ndarray, keys: Any, impl: str | None,
                 params: Any = None, widths: np.ndarray | None = None, stop_at: Any = None):
        self.engine, self.alloc = engine, alloc
        self.tokens, self.mask = tokens, mask
        self.widths = np.full(len(tokens), tokens.shape[1], np.int64) if widths is None else widths
        self.keys, self.impl, self.stop_at, self.params = keys, impl, stop_at, params
        self.key_data: np.ndarray | None = None  # rows' own keys on the host (submitted with their rows)
        self.state = None
        self._restored: dict[str, np.ndarray] | None = None  # a checkpoint's state, put back at start()

    def start(self) -> None:
        if self.state is None:
            self.state = self.engine.start_jit(self.params, rows=len(self.tokens), pages=self.alloc.pages,
                                               slots=self.alloc.slots)
            self.engine.compile_buckets(self)
            if self._restored is not None:  # every field but the (zero) page pool, as saved
                st, saved = self.state, self._restored
                self.state = st._replace(**{
                    f: None if getattr(st, f) is None else jax.device_put(saved[f], getattr(st, f).sharding)
                    for f in st._fields if f not in ("k", "v")})
                self._restored = None

    def snapshot(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The rows' prompts, widths and keys, and the device state but its page pool
        (each slot's row, length, step and next token; every row's tokens, log-probs and
        mask so far), on the host."""
        arrays = {"tokens": self.tokens.copy(), "mask": self.mask.copy(), "widths": np.asarray(self.widths, np.int64)}
        if self.key_data is not None:
            arrays["key_data"] = self.key_data.copy()
        st = self.state
        if st is None and self._restored is not None:
            arrays.update({f"state_{k}": v for k, v in self._restored.items()})
        elif st is not None:
            names = [f for f in st._fields if f not in ("k", "v") and getattr(st, f) is not None]
            arrays.update({f"state_{f}": x for f, x in zip(names, on_host(*(getattr(st, f) for f in names)))})
        return {"impl": self.impl, "keys": self.key_data is not None, "state": st is not None or
                self._restored is not None}, arrays

    def restore(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """:meth:`snapshot`'s rows back; the device state is put back at :meth:`start`
        (the weights are read there)."""
        self.tokens[:], self.mask[:], self.widths[:] = arrays["tokens"], arrays["mask"], arrays["widths"]
        if meta["keys"]:
            self.key_data, self.impl = np.asarray(arrays["key_data"]), meta["impl"]
            self.keys, _ = self.engine.place_key(self.key_data)
        if meta["state"]:
            self._restored = {k[len("state_"):]: v for k, v in arrays.items() if k.startswith("state_")}

    def admit(self, admitted: list[tuple[int, int]]) -> None:
        self.start()
        w = int(max(self.widths[r] for _, r in admitted))
        self.state = self.engine.prefill_rows(self.params, self.state, admitted, self.tokens[:, -w:],
                                              self.mask[:, -w:], self.keys, self.impl, self.alloc, self.stop_at)

    def decode(self, idx: np.ndarray, table: np.ndarray, slot_rows: np.ndarray) -> None:
        place = self.engine._place
        self.state = self.engine.decode_jit(self.params, self.state, place(table, ("batch", None)),
                                            place(idx, ("batch",)), place(slot_rows, ("batch",)), self.keys,
                                            self.stop_at, key_impl=self.impl)

    def boundary(self) -> tuple[np.ndarray, np.ndarray]:
        return tuple(on_host(self.state.done, self.state.lengths))

    def refresh(self, held: list[tuple[int, int]]) -> int:
        """The pages of the rows in flight (``(slot, row)`` pairs) rebuilt under
        :attr:`params`: each row's prompt and its drawn tokens but the last (the one the
        next step feeds) run through the model again, padded to a power of two of rows
        and of tokens. Returns the tokens recomputed."""
        self.start()
        e, alloc, place = self.engine, self.alloc, self.engine._place
        slots, rows = (np.asarray(x, np.int64) for x in zip(*held))
        gen, drawn = on_host(self.state.tokens, self.state.out_len)
        seqs = [np.concatenate([self.tokens[r][self.mask[r] != 0], gen[r, :max(int(drawn[r]) - 1, 0)]]) for r in rows]
        width = min(pow2(max(len(q) for q in seqs)), self.tokens.shape[1] + gen.shape[1])
        n = min(pow2(len(held)), alloc.slots)
        tokens, mask = np.zeros((n, width), np.int32), np.ones((n, width), np.int32)  # padding rows: all real
        live = np.full(n, -1, np.int32)
        table = np.zeros((n, alloc.max_pages), np.int32)
        for i, (q, s, r) in enumerate(zip(seqs, slots, rows)):
            tokens[i], mask[i] = 0, 0
            tokens[i, width - len(q):], mask[i, width - len(q):] = q, 1
            live[i], table[i] = r, alloc.table()[s]
        self.state = e.refresh_jit(self.params, self.state, place(tokens, ("batch", "length")),
                                   place(mask, ("batch", "length")), place(live, ("batch",)),
                                   place(table, ("batch", None)))
        return int(sum(len(q) for q in seqs))

    def read(self, ids: list[int]) -> tuple[np.ndarray | None, ...]:
        """Rows ``ids``' outputs on the host: tokens, mask, logprobs, out_len, truncated,
        behaviour (None without a filter), routed experts (None unless recorded). Whole on
        every process (:func:`on_host`: over several processes a collective of the mesh's,
        which run the same schedule)."""
        st = self.state
        fields = (st.tokens, st.mask, st.logprobs, st.out_len, st.truncated, st.behaviour, st.routed)
        got = iter(on_host(*(a for a in fields if a is not None)))
        return tuple(None if a is None else next(got)[ids] for a in fields)


class SimulatedRunner:
    """Rows of known lengths (``completions`` [rows], ``prompt_len`` [rows]) and no model:
    each live slot advances up to a chunk of steps a chunk, and a row is done once it
    holds its completion. ``trace`` (a list) receives one entry per prefill batch
    (``{"prefill": rows, "prompts": distinct prompts}``, rows of one ``groups`` id [rows]
    sharing a prompt, as the engine's shared prefill) and per chunk (``{"idx", "width", "lengths", "advance"}``:
    the slots decoded, their page-table width, cached tokens at the chunk's start and
    the steps each is live)."""

    def __init__(self, sched: Scheduler, *, prompt_len: np.ndarray, completions: np.ndarray,
                 trace: list | None = None, groups: np.ndarray | None = None):
        self.sched, self.plen, self.comp, self.trace = sched, prompt_len, completions, trace
        self.groups = groups  # each row's prompt (rows of one prompt share its prefill); None: its own
        S = sched.alloc.slots
        self.drawn = np.zeros(S, np.int64)  # tokens the slot's row has drawn (its step count)
        self.lengths = np.zeros(S, np.int64)  # tokens of the row in its pages

    def admit(self, admitted: list[tuple[int, int]]) -> None:
        for slot, row in admitted:  # the prefill draws step 0
            self.drawn[slot], self.lengths[slot] = 1, self.plen[row]
        if self.trace is not None:
            rows = [r for _, r in admitted]
            prompts = len(rows) if self.groups is None else len({int(self.groups[r]) for r in rows})
            self.trace.append({"prefill": len(admitted), "prompts": prompts})

    def decode(self, idx: np.ndarray, table: np.ndarray, slot_rows: np.ndarray) -> None:
        rows = np.asarray(self.sched.slot_row)
        live = rows >= 0
        steps = np.where(live, np.clip(self.comp[np.maximum(rows, 0)] - self.drawn, 0, self.sched.chunk), 0)
        if self.trace is not None:
            self.trace.append({"idx": idx, "width": table.shape[1], "lengths": self.lengths[idx].copy(),
                               "advance": steps[idx].copy()})
        self.drawn, self.lengths = self.drawn + steps, self.lengths + steps

    def boundary(self) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(self.sched.slot_row)
        return (rows >= 0) & (self.drawn >= self.comp[np.maximum(rows, 0)]), self.lengths


def on_host(*arrays: Any) -> list[np.ndarray]:
    """Each of ``arrays`` whole, as numpy, on every process: the host scheduler reads the
    prompts and each chunk's done/lengths, and every process must run the very same
    schedule (the programs it launches are collectives over every process's devices).
    A global array whose shards span several processes is gathered from all of them
    (``process_allgather``: a collective, so every process calls this at the same
    point); numpy inputs are already every process's whole copy (evaluation's batches)."""
    spans = [isinstance(x, jax.Array) and not x.is_fully_addressable for x in arrays]
    gathered = iter([])
    if any(spans):
        everyone = all(len({d.process_index for d in x.sharding.device_set}) == jax.process_count()
                       for x, s in zip(arrays, spans) if s)
        if not everyone:  # the rollout side of a multi-process async run: its own processes gather
            from grpo.engine.parallel.rows import host_value

            return [host_value(x) if s else np.asarray(jax.device_get(x)) for x, s in zip(arrays, spans)]
        from jax.experimental import multihost_utils

        gathered = iter(multihost_utils.process_allgather([x for x, s in zip(arrays, spans) if s], tiled=True))
    return [np.asarray(next(gathered) if s else jax.device_get(x)) for x, s in zip(arrays, spans)]


__all__ = ["DeviceRunner", "EngineCore", "Runner", "SimulatedRunner", "mark_versions", "on_host"]
