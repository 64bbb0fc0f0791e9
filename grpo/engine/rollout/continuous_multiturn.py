"""Multi-turn rollouts on the continuous-batching engine (``rollout.engine: continuous``
with a task that has tools or an environment).

The rows are those of :class:`~grpo.engine.rollout.multiturn.MultiTurnSampler` (the
static engine's multi-turn sampler), and so is the host side: each row's environment,
transcript and budgets live in the same :class:`~grpo.engine.rollout.multiturn._Talk`,
and the output is the same compaction (:func:`~grpo.engine.rollout.multiturn.compact`).
Only the device side differs: the rows run through the continuous engine's slots and
page pool (:class:`~grpo.engine.rollout.continuous.ContinuousSampler`).

How a row runs
--------------

1. **Turn decode**: in a decode slot, the row draws its turn as a single-turn row draws
   its completion, stopping at an end-of-sequence or turn-stop token (a tool call's end)
   or at its turn's budget: ``N - tokens used`` (model and inserted), and
   ``max_turn_tokens``. Turn ``t``'s step ``i`` is drawn from
   ``fold_in(fold_in(fold_in(rng, row), t), i)``: the static multi-turn sampler's key.
2. **Leaving the slot** (host, at a chunk boundary): the finished row's turn is read
   (one gather of the finished rows), recorded in its transcript, and its environment
   steps (concurrently over the rows that finished at this boundary). The row's pages are
   *parked* under it (:meth:`~grpo.engine.rollout.paged.pages.PageAllocator.park`): its slot is
   free for any row. An episode that ends frees its pages.
3. **Append-prefill**: a continuing row goes back through the queue, ahead of rows that
   hold no pages. At its admission it takes a free slot of its pages' part of the pool
   and the tokens the static sampler appends (its turn's last token, never fed, then the
   reply the chat template adds) are written *after its real tokens* in its own pages,
   RoPE positions continuing its count of real tokens (one forward over the chunk,
   attending to the row's pages gathered densely and, causally, to the chunk). Its next
   turn's step 0 is drawn from the chunk's last position; it then decodes in that slot.
   Fresh rows are admitted the same way, with their prompt as the chunk and no pages.

The host takes part only at chunk boundaries; there is no per-token host sync.

Over several processes (a multi-process run, or the rollout side of an asynchronous run
split by processes), every process runs the same schedule (its programs are collectives
of the mesh's devices), so each holds every row's tokens (:class:`_Transcripts`): a
turn's output is read whole on every process, each process steps its own rows'
environments (its local rows, as the static sampler's), and one gather over the mesh's
processes at each boundary where rows finished a turn hands every process the rows'
reply tokens (or that the episode ended, and whether truncated). Each process's
:class:`~grpo.engine.rollout.multiturn.Episodes` are its own rows', as the static
sampler's.

Eviction: a multi-turn row may be evicted like a single-turn one (its part of the pool
short; the latest admitted row of that part first, parked rows included). It is
**re-prefilled from what the host recorded**, not re-run from scratch: its pages are freed
and, when admitted again, the chunk written into empty pages is the whole conversation so
far (prompt, turns and replies, exactly the tokens its pages held); then it redraws its
current turn from step 0 with the same keys. The environment is never stepped again (a
tool's effects happen once, and the replies are already in the transcript), and no page
is ever held by a row that cannot run: the oldest row of a part of the pool is never
evicted and the part holds one row at the cap, so every row finishes.

Differences from the static sampler: none in the samples (tokens equal, log-probs to
float rounding: attention sums the same keys in another order). The static sampler also
ends a row whose next turn or reply would not fit its shared cache slots (a write index
shared by every row); here a row's pages hold exactly its real tokens, so only the
budgets bind. Environments step synchronously at the boundary where their rows finish
(the decode waits for the slowest tool of that boundary).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo.core.contracts import Environment
from grpo.engine.parallel.mesh import mesh_processes
from grpo.engine.parallel.rows import gather_processes
from grpo.engine.rollout._sampling import step_keys
from grpo.engine.rollout.continuous import ContinuousSampler, SlotState
from grpo.engine.rollout.multiturn import Episodes, MultiTurnSampler, Render, _Talk, append_bucket, compact, set_turns
from grpo.engine.rollout.paged.core import EngineCore, on_host
from grpo.engine.rollout.paged.scheduler import TurnScheduler, pow2
from grpo.engine.rollout.decoding import draw, left_align_rows, row_key_data
from grpo.engine.rollout.sampler import RolloutOutput
from grpo.models.decoder import KVCache
from grpo.models.layers.paged import dense_dtype, pool_gather, pool_set


class ContinuousMultiTurnSampler(ContinuousSampler):
    """The continuous engine's multi-turn sampler: :class:`MultiTurnSampler`'s rows and
    :meth:`sample` (``max_turns``, ``turn_stop_ids``, ``max_turn_tokens``,
    ``conversations`` as its), over :class:`ContinuousSampler`'s slots and pages (its
    other args)."""

    loss_mask = True
    records_routing = False  # its appended turns are not routed through the decode step (issue 54: refused)
    sample = MultiTurnSampler.sample

    def __init__(self, graphdef: Any, *, max_turns: int, turn_stop_ids: Sequence[int] | None = None,
                 max_turn_tokens: int | None = None, conversations: Any = None, **kwargs: Any):
        super().__init__(graphdef, **kwargs)
        set_turns(self, max_turns=max_turns, turn_stop_ids=turn_stop_ids, max_turn_tokens=max_turn_tokens,
                  conversations=conversations)
        self.extend_jit = jax.jit(self._extend_impl, static_argnames=("key_impl",), donate_argnums=(1,))
        self.read_jit = jax.jit(self._read_impl)

    def generate(self, *args: Any, **kwargs: Any) -> RolloutOutput:
        raise TypeError("a multi-turn rollout needs its environments: call sample() or converse()")

    def _stop_ids(self) -> tuple[int, ...]:
        return tuple(self.sampling.eos_ids) + self.turn_stop_ids

    # The plan's cost model (grpo.engine.planning.costs) models this engine as the static
    # one, whose multi-turn decode it sizes by these: a row's turns sample at most N tokens
    # over at most prompt + N cached tokens (its pages at the cap).
    def width(self) -> int:
        return self.sampling.max_new_tokens

    def allocated(self, prompt_length: int) -> int:
        return self.cache_slots(prompt_length)

    def jitted(self) -> dict[str, list[Any]]:
        quantize = {} if self.quantize_jit is None else {"quantize": [self.quantize_jit]}
        return {**quantize, "start": [self.start_jit], "append": [self.extend_jit], "decode": [self.decode_jit],
                "read": [self.read_jit]}

    shape_lowerings = None  # its programs at every width: its contract's lowerings (the widest variants)

    def lowerings(self, params: Any, *, prompts: int, prompt_length: int, key: jax.Array) -> dict[str, Any]:
        rows, maxp = prompts * self.sampling.num_generations, self.max_pages(prompt_length)
        S = self.slots_for(rows, prompt_length)
        pages = self.shards(S) * self.pool_size(prompt_length, S // self.shards(S))
        L = append_bucket(prompt_length + self.sampling.max_new_tokens)  # the widest chunk: a re-prefill

        def state():
            return jax.eval_shape(lambda p: self._start_impl(p, rows=rows, pages=pages, slots=S), params)

        def append():
            raw, impl = self._abstract_key(key)
            vec = self._rows(S)
            return self.extend_jit.lower(params, state(), self._rows(S, L), self._rows(S, L), vec, vec,
                                         vec, self._rows(S, maxp), vec, vec, raw, key_impl=impl)

        def decode():
            raw, impl = self._abstract_key(key)
            vec = self._rows(S)
            return self.decode_jit.lower(params, state(), self._rows(S, maxp), vec, vec, raw, None, vec, vec,
                                         key_impl=impl)

        def read():
            st = state()
            return self.read_jit.lower(st.tokens, st.logprobs, st.behaviour, st.out_len, st.truncated, self._rows(S))

        return {"start": lambda: self.start_jit.lower(params, rows=rows, pages=pages, slots=S), "append": append,
                "decode": decode, "read": read}

    # ------------------------------------------------------------------ the host loop

    def converse(self, params: Any, prompt_tokens: Any, prompt_mask: Any, rng: jax.Array, *,
                 envs: Sequence[Environment], openings: Sequence[list[dict[str, Any]]], render: Render,
                 tokenizer: Any, workers: int = 32) -> tuple[RolloutOutput, Episodes]:
        """:meth:`MultiTurnSampler.converse`'s rollout (same arguments, same output) through
        the slots and pages (see the module docstring). Over several processes (the mesh's:
        every process, or a rollout side's) ``envs``/``openings`` are this process's rows',
        as the static sampler's; every process runs the same schedule over every row's
        tokens (:class:`_Transcripts`), stepping its own rows' environments and gathering
        the replies' tokens of the rows that finished a turn at each boundary
        (:meth:`_shared_appends`)."""
        rank, processes = mesh_processes(self.mesh)  # a rollout side's, split by processes
        tokens, mask = left_align_rows(*on_host(prompt_tokens, prompt_mask))
        K, N = self.sampling.num_generations, self.sampling.max_new_tokens
        tokens, mask = np.repeat(tokens, K, axis=0), np.repeat(mask, K, axis=0)  # row b*K + j
        B, Lp = tokens.shape
        if len(envs) * processes != B:
            raise ValueError(f"{len(envs)} environments on each of {processes} processes for {B} rows")
        alloc = self._allocator(Lp, self.slots_for(B, Lp))
        talk = _Talk.open(envs, openings, render, tokenizer, eos=set(self.sampling.eos_ids))
        every = _Transcripts.of(talk) if processes == 1 else _Transcripts.blank(B, first=rank * len(envs))
        sched = TurnScheduler(alloc, prompt_len=mask.sum(axis=1), cap=N, chunk=self.chunk_steps)
        runner = _TurnRunner(self, sched, talk, every, prompts=[tokens[r][mask[r] == 1] for r in range(B)], key=rng,
                             rows=B, params=params)
        core = EngineCore(sched, runner, rows=B)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(envs))))
        try:
            while not (progress := core.step()).idle:
                if progress.finished:  # in slot order, as they left their slots
                    self._end_turns(runner.state, list(progress.finished), talk, every, sched, pool)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        assert not sched.queue and not sched.returning and alloc.held_pages == 0, "a row was left behind"
        self.last_stats = core.stats()
        c, place = compact(every.pieces, sampling=self.sampling), self._put

        def rows(x):
            return place(x, ("batch", "length"))

        out = RolloutOutput(
            prompt_tokens=rows(tokens), prompt_mask=rows(mask), tokens=rows(c["tokens"]), mask=rows(c["mask"]),
            lengths=place(c["mask"].sum(axis=1).astype(np.int32), ("batch",)),
            truncated=place(every.truncated, ("batch",)), logprobs=rows(c["logprobs"]),
            loss_mask=rows(c["loss_mask"]), behaviour_logprobs=None if c["behaviour"] is None else rows(c["behaviour"]),
        )
        return out, talk.episodes

    def _put(self, x: np.ndarray, names: Sequence[str]) -> jax.Array:
        """A host array on the mesh in its rollout sharding, its dtype kept."""
        data = np.asarray(x)
        return jax.make_array_from_callback(data.shape, self.sharding(data.shape, names), lambda idx: data[idx])

    def _turn_caps(self, every: "_Transcripts", rows: np.ndarray) -> np.ndarray:
        """Most tokens of each row's current turn (the static sampler's budget: what is
        left of N, at most ``max_turn_tokens``)."""
        caps = self.sampling.max_new_tokens - every.used[rows]
        if self.max_turn_tokens is not None:
            caps = np.minimum(caps, self.max_turn_tokens)
        return caps.astype(np.int32)

    def _end_turns(self, state: SlotState, finished: list[int], talk: _Talk, every: "_Transcripts",
                   sched: TurnScheduler, pool: concurrent.futures.Executor) -> None:
        """The ``finished`` rows' turns read and recorded, their environments stepped (this
        process's rows') and their replies added; each continuing row goes back to the
        queue with its pages, each ended one frees them."""
        padded = np.zeros(sched.alloc.slots, np.int32)  # at most one row a slot: one program
        padded[: len(finished)] = finished
        read = self.read_jit(state.tokens, state.logprobs, state.behaviour, state.out_len, state.truncated,
                             self._place(padded, ("batch",)))
        got = iter(on_host(*(x for x in read if x is not None)))  # whole on every process
        tok, lp, blp, count, trunc = (None if x is None else next(got) for x in read)
        lo, b = every.first, len(talk.envs)
        stepping = []
        for i, r in enumerate(finished):
            n = int(count[i])
            last = int(every.num_turns[r]) == self.max_turns - 1
            turn = (np.asarray(tok[i, :n]), np.asarray(lp[i, :n]), None if blp is None else blp[i, :n])
            if lo <= r < lo + b and talk.record(r - lo, *turn, ended=not bool(trunc[i]), last=last):
                stepping.append(r - lo)
            if every.shared:  # the other processes' rows too (this process's talk holds its own)
                every.pieces[r].append(turn + (True,))
                every.used[r] += n
                every.num_turns[r] += 1
        steps = talk.step(pool, stepping)
        N = self.sampling.max_new_tokens
        appends = talk.add_replies(stepping, steps, room=N, slots_left=N, inserted=MultiTurnSampler._inserted)
        appends = {lo + r: v for r, v in appends.items()}
        if every.shared:
            appends = self._shared_appends(finished, appends, talk, every, slots=sched.alloc.slots)
        for r in finished:
            if r in appends:
                sched.resume(r, int(sched.base[r]) + len(appends[r]))
            else:
                sched.close(r)

    def _shared_appends(self, finished: list[int], mine: dict[int, list[int]], talk: _Talk, every: "_Transcripts",
                        *, slots: int) -> dict[int, list[int]]:
        """Every finished row's tokens to append (its last sampled token, then its reply's;
        none: its episode ended), gathered from the process that owns the row over the
        mesh's processes (one ``[slots, 2 + N]`` gather: the rows that finished at this
        boundary, at most one a slot), and recorded in ``every``: the replies' tokens, and
        whether an ended row was truncated."""
        N = self.sampling.max_new_tokens
        lo, b = every.first, len(talk.envs)
        table = np.zeros((slots, 2 + N), np.int32)  # append length (-1: ended), truncated, tokens
        for i, r in enumerate(finished):
            if lo <= r < lo + b:
                ids = mine.get(r)
                table[i, 0] = -1 if ids is None else len(ids)
                table[i, 1] = int(talk.truncated[r - lo])
                if ids is not None:
                    table[i, 2 : 2 + len(ids)] = ids
        everyone = gather_processes(table, self.mesh)  # [processes, slots, 2 + N]
        appends = {}
        for i, r in enumerate(finished):
            n, truncated = (int(x) for x in everyone[r // b, i, :2])
            if n < 0:
                every.truncated[r] = bool(truncated)
                continue
            appends[r] = [int(t) for t in everyone[r // b, i, 2 : 2 + n]]
            reply = np.asarray(appends[r][1:], np.int32)  # after the turn's last token
            every.pieces[r].append((reply, np.zeros(len(reply), np.float32), None, False))
            every.used[r] += len(reply)
        return appends

    def _extend(self, params: Any, state: SlotState, admitted: list[tuple[int, int]], sched: TurnScheduler,
                every: "_Transcripts", prompts: list[np.ndarray], raw: jax.Array, impl: str | None) -> SlotState:
        """The admitted ``(slot, row)`` pairs' chunks (what the row's pages lack of its
        conversation so far) written in one append program, padded to a power of two of
        rows, at least a quarter of the slots (padding: row -1, slot ``slots``, writing
        nowhere; at most three row counts, each costing under a decode chunk's rows) and an
        :func:`append_bucket` of tokens. It reads every row's whole page table (a row at
        the cap): one program per (rows, tokens), where the decode's varies with the pages
        too; the append's forward is over its chunk, its attention over the pages."""
        alloc = sched.alloc
        S = alloc.slots
        chunks = []
        for _, row in admitted:
            conversation = np.concatenate([prompts[row]] + [p[0] for p in every.pieces[row]]).astype(np.int32)
            assert len(conversation) == sched.hist_len[row], (row, len(conversation), sched.hist_len[row])
            chunks.append(conversation[int(sched.base[row]):])
        k, n = len(admitted), min(pow2(max(len(admitted), S // 4)), S)
        L = append_bucket(max(map(len, chunks)))
        tok = np.full((n, L), self.sampling.pad_id, np.int32)
        real = np.zeros((n, L), np.int32)
        real[k:, 0] = 1  # a padding row's query sees one key (never NaN)
        base = np.zeros(n, np.int32)
        rows = np.full(n, -1, np.int32)
        slots = np.full(n, S, np.int32)
        for i, ((slot, row), ch) in enumerate(zip(admitted, chunks)):
            tok[i, : len(ch)], real[i, : len(ch)] = ch, 1
            base[i], rows[i], slots[i] = sched.base[row], row, slot
        r = np.maximum(rows, 0)
        turns, caps = every.num_turns[r].astype(np.int32), self._turn_caps(every, r)
        table = np.zeros((n, alloc.max_pages), np.int32)
        table[:k] = alloc.table()[slots[:k]]
        place = self._place
        vec = [place(x, ("batch",)) for x in (base, rows, slots)]
        return self.extend_jit(params, state, place(tok, ("batch", "length")), place(real, ("batch", "length")),
                               *vec, place(table, ("batch", None)), place(turns, ("batch",)),
                               place(caps, ("batch",)), raw, key_impl=impl)

    # ------------------------------------------------------------------ programs

    @staticmethod
    def _read_impl(tokens, logprobs, behaviour, out_len, truncated, rows):
        """The turn outputs of ``rows`` [n] (the rows that finished a turn)."""
        return (tokens[rows], logprobs[rows], None if behaviour is None else behaviour[rows], out_len[rows],
                truncated[rows])

    def _extend_impl(self, params: Any, state: SlotState, tokens: jax.Array, real: jax.Array, base: jax.Array,
                     rows: jax.Array, slots: jax.Array, table: jax.Array, turns: jax.Array, caps: jax.Array,
                     raw_key: jax.Array, *, key_impl: str | None) -> SlotState:
        """The append-prefill: each of n rows' ``tokens`` [n, L] (``real`` ones first,
        then padding) written after the ``base`` [n] tokens already in its pages (page table
        ``table`` [n, W], covering the tokens written), at RoPE positions ``base + i``; one
        forward attends to the row's W pages (gathered densely, masked by ``base``) and
        causally to the chunk. The row is seated in ``slots`` [n] with its turn ``turns``'s
        step 0 drawn from the chunk's last real position (the turn at most ``caps`` [n])."""
        model = self._model(params)
        real = real != 0
        n, L = tokens.shape
        P, ps = state.k.shape[2], state.k.shape[3]
        W = table.shape[1]
        D = W * ps  # the gathered pages' tokens: dense slots [0, D); the chunk at [D, D + L)

        dt = dense_dtype(state.k, model.dtype)

        def gather(pool):  # pool [Ly, KH, P, ps, E] -> dense [Ly, n, D, KH, E]
            g = pool_gather(pool, table, dt)  # Ly KH n W ps E
            return g.transpose(0, 2, 3, 4, 1, 5).reshape(g.shape[0], n, D, g.shape[1], g.shape[-1])

        empty = model.init_cache(n, D + L, dtype=dt)
        cache = KVCache(k=empty.k.at[:, :, :D].set(gather(state.k)), v=empty.v.at[:, :, :D].set(gather(state.v)))
        m = real.sum(axis=1).astype(jnp.int32)  # n
        kv = jnp.concatenate([jnp.arange(D)[None, :] < base[:, None], real], axis=1)  # n D+L
        positions = base[:, None] + jnp.cumsum(real, axis=1).astype(jnp.int32) - 1  # n L
        hidden, cache = model(tokens, positions, kv, cache=cache, write_index=D)
        h = jnp.take_along_axis(hidden, jnp.maximum(m - 1, 0)[:, None, None], axis=1)  # n 1 H
        logits = model.logits(h)[:, 0, :]  # n V
        live = rows >= 0
        # Chunk token i of a row is its token base + i: page table[(base + i) // ps], offset (base + i) % ps.
        at = base[:, None] + jnp.arange(L, dtype=jnp.int32)[None, :]  # n L
        page = jnp.take_along_axis(table, jnp.minimum(at // ps, W - 1), axis=1)
        page = jnp.where(live[:, None] & real, page, P)  # out of range: dropped

        def scatter(pool, dense):  # dense [Ly, n, D+L, KH, E] -> the chunk into pool [Ly, KH, P, ps, E]
            return pool_set(pool, (slice(None), slice(None), page, at % ps), dense[:, :, D:].transpose(0, 3, 1, 2, 4),
                            mode="drop")

        stops = jnp.asarray(self._stop_ids(), jnp.int32)
        keys = step_keys(row_key_data(raw_key, key_impl, rows), turns)
        drawn = draw(logits, keys, jnp.int32(0), live, sampling=self.sampling, stops=stops)
        st = state._replace(k=scatter(state.k, cache.k), v=scatter(state.v, cache.v))
        return self._seat(st, slots=slots, rows=rows, lengths=base + m, drawn=drawn, done=drawn[3] | (caps <= 1))


class _Transcripts:
    """Every row's conversation as tokens (``pieces``: :attr:`_Talk.pieces`' form), its
    completion tokens so far, model turns and whether it ended truncated: what the turn
    scheduler and the device programs read, the same on every process of the mesh. On
    one process it is the rows' :class:`_Talk` itself (:meth:`of`); over several each
    process's talk holds only its own rows (``first`` the first of them) and this the
    rows of every process (:meth:`blank`, ``shared``), kept from what the boundaries
    gather."""

    def __init__(self, pieces: list, used: np.ndarray, num_turns: np.ndarray, truncated: np.ndarray, *,
                 first: int, shared: bool):
        self.pieces, self.used, self.num_turns, self.truncated = pieces, used, num_turns, truncated
        self.first, self.shared = first, shared

    @classmethod
    def of(cls, talk: _Talk) -> "_Transcripts":
        return cls(talk.pieces, talk.used, talk.episodes.num_turns, talk.truncated, first=0, shared=False)

    @classmethod
    def blank(cls, rows: int, *, first: int) -> "_Transcripts":
        return cls([[] for _ in range(rows)], np.zeros(rows, np.int64), np.zeros(rows, np.int32),
                   np.zeros(rows, bool), first=first, shared=True)


class _TurnRunner:
    """The multi-turn rows' runner for :class:`~grpo.engine.rollout.paged.core.EngineCore`:
    an admitted row's conversation so far is appended into its pages (a first turn's
    prompt, or what a returning row's pages lack), and each slot decodes its current
    turn (its turn's keys, at most what is left of its budget)."""

    def __init__(self, engine: ContinuousMultiTurnSampler, sched: TurnScheduler, talk: _Talk, every: _Transcripts, *,
                 prompts: list[np.ndarray], key: jax.Array, rows: int, params: Any):
        self.engine, self.sched, self.talk, self.every = engine, sched, talk, every
        self.prompts, self.params = prompts, params
        self.raw, self.impl = engine.place_key(key)
        self.state = engine.start_jit(params, rows=rows, pages=sched.alloc.pages, slots=sched.alloc.slots)

    def admit(self, admitted: list[tuple[int, int]]) -> None:
        t0 = time.perf_counter()
        e = self.engine
        self.state = e._extend(self.params, self.state, admitted, self.sched, self.every, self.prompts, self.raw,
                               self.impl)
        self.talk.episodes.append_s += time.perf_counter() - t0

    def decode(self, idx: np.ndarray, table: np.ndarray, slot_rows: np.ndarray) -> None:
        e, place = self.engine, self.engine._place
        r = np.maximum(slot_rows, 0)
        turns, caps = self.every.num_turns[r].astype(np.int32), e._turn_caps(self.every, r)
        self.state = e.decode_jit(self.params, self.state, place(table, ("batch", None)), place(idx, ("batch",)),
                                  place(slot_rows, ("batch",)), self.raw, None, place(turns, ("batch",)),
                                  place(caps, ("batch",)), key_impl=self.impl)

    def boundary(self) -> tuple[np.ndarray, np.ndarray]:
        return tuple(on_host(self.state.done, self.state.lengths))  # whole on every process


__all__ = ["ContinuousMultiTurnSampler"]
