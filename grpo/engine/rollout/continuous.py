"""The continuous-batching sampler over a paged KV cache (``rollout.engine:
continuous``); its multi-turn rows are
:mod:`grpo.engine.rollout.continuous_multiturn`'s.

The static :class:`~grpo.engine.rollout.sampler.Sampler` decodes all B = P*K rows of a
step as one batch: each row keeps its decode slot and its ``prompt + max_new_tokens``
cache slots until the longest row stops. Here the rows wait in a queue and a fixed
number of decode slots (``slots``) runs in chunks of ``chunk`` decode steps:

1. **Admit** (host, at a chunk boundary): finished rows give back their slot and pages
   (:class:`~grpo.engine.rollout.paged.PageAllocator`); each live row is given the pages
   the next chunk can write; queued rows take free slots while pages last, in queue
   (row) order. When a live row cannot grow, the most recently admitted row is evicted:
   its pages are freed and it goes back to the head of the queue. A row's draws depend
   only on its key and step, so when it runs again it samples the very same tokens.
2. **Prefill** (one jit per admission-batch size, a power of two up to ``slots``): the
   admitted rows' prompts run through the model's dense prefill (left-aligned as the
   static sampler does), their keys/values are scattered into the rows' pages with the
   prompt's first real token at token 0, and step 0 is drawn from the last position's
   logits.
3. **Decode** (one jit, the state donated): ``chunk`` steps in a ``lax.fori_loop``, no
   host sync inside; each live slot feeds its previous token at position = its cached
   length, writes its key/value into its pages and attends over them alone
   (:mod:`grpo.models.layers.paged`; the Pallas kernel on TPU/GPU).

The host reads three [slots] arrays per chunk (row, done, length). The step ends when the
queue is empty and every slot is free. Row ``r`` draws step ``t`` from
``fold_in(fold_in(rng, r), t)`` exactly as the static sampler, whatever slot it ran in,
so the two give the same tokens (and log-probs to float rounding: attention sums the
same keys in another order).

Limits of this first version (issue 39): prefill runs once per row (no
sharing of a prompt's pages between its K samples); the pool's pages are not split per
device (each device holds the pool of its KV heads; rows are sharded over the batch
axes as in the static sampler); the plan's costs of this engine are the static ones.
"""

from __future__ import annotations

import collections
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo.engine.rollout._sampling import step_keys
from grpo.engine.rollout.paged import PageAllocator, PoolExhausted
from grpo.engine.rollout.sampler import BaseSampler, RolloutOutput, draw
from grpo.models.decoder import positions_from_mask
from grpo.models.layers.paged import BACKENDS, PagedKVCache, PagedSpec
from grpo.sharding import fit_sharding


class SlotState(NamedTuple):
    """The device state between chunks (donated through prefill and decode)."""

    k: jax.Array  # [L, KH, pages, page_size, E] the page pool
    v: jax.Array
    row: jax.Array  # [S] int32 global row in the slot, -1 free
    lengths: jax.Array  # [S] int32 tokens of the row in its pages
    steps: jax.Array  # [S] int32 sampling steps drawn (the next step's index)
    prev: jax.Array  # [S] int32 the token fed at the next step
    done: jax.Array  # [S] bool stop token drawn or the cap reached
    tokens: jax.Array  # [B, N] int32 every row's completion (pad_id after its stop)
    logprobs: jax.Array  # [B, N] float32
    mask: jax.Array  # [B, N] int32
    out_len: jax.Array  # [B] int32
    truncated: jax.Array  # [B] bool no stop token (yet)
    # [B, N] float32 the behaviour policy's (top-k/top-p truncated) log-probs; None without
    # a filter, where they are ``logprobs`` themselves (see :func:`draw`)
    behaviour: jax.Array | None = None


class ContinuousSampler(BaseSampler):
    """Continuous batching over a paged cache; :meth:`sample` as the static sampler's.

    Args (beside :class:`BaseSampler`'s): ``slots`` decode slots (0: every row of the
    rollout at once), ``page_size`` tokens a
    page, ``pool_pages`` pages in the pool (0: enough for every slot at the cap, so no row
    is ever evicted), ``chunk`` decode steps between host boundaries, ``backend`` the
    paged attention (:data:`grpo.kernels.paged_attention.BACKENDS`), ``detokenize`` as
    the static sampler's."""

    def __init__(self, graphdef: Any, *, slots: int, page_size: int = 16, pool_pages: int = 0, chunk: int = 16,
                 backend: str = "auto", detokenize: Any = None, **kwargs: Any):
        super().__init__(graphdef, **kwargs)
        for name, value, low in (("slots", slots, 0), ("page_size", page_size, 1), ("pool_pages", pool_pages, 0),
                                 ("chunk", chunk, 1)):
            if not (isinstance(value, int) and value >= low):
                raise ValueError(f"{name} must be an integer >= {low} (got {value!r})")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)} (got {backend!r})")
        # A row decodes at most max_new_tokens steps in all, so a longer chunk would only run
        # steps in which every slot is done (the quickstart's 2-token answers under chunk 16).
        chunk = min(chunk, self.sampling.max_new_tokens)
        self.slots, self.page_size, self.pool_pages, self.chunk_steps = slots, page_size, pool_pages, chunk
        self.backend = backend
        self.detokenize = detokenize
        self.start_jit = jax.jit(self._start_impl, static_argnames=("rows", "pages"))
        self.prefill_jit = jax.jit(self._prefill_impl, static_argnames=("key_impl",), donate_argnums=(1,))
        self.decode_jit = jax.jit(self._decode_impl, static_argnames=("key_impl",), donate_argnums=(1,))
        self.last_stats: dict[str, Any] = {}

    # ------------------------------------------------------------------ the interface

    def generate(self, params: Any, prompt_tokens: Any, prompt_mask: Any, rng: jax.Array,
                 stop_at: Any = None) -> RolloutOutput:
        """All P*K rows through the queue; the rollout's global arrays (as the static
        sampler's). Per-call figures land in :attr:`last_stats`. ``stop_at`` [P*K]
        (benchmarks only): each row stops once it has that many tokens. Under several
        processes every one runs the same host schedule on gathered prompts and chunk
        boundaries (:func:`_on_host`), so each launches the same programs."""
        tokens, mask = _left_aligned(*_on_host(prompt_tokens, prompt_mask))
        K, N = self.sampling.num_generations, self.sampling.max_new_tokens
        tokens, mask = np.repeat(tokens, K, axis=0), np.repeat(mask, K, axis=0)  # row b*K + j
        B, Lp = tokens.shape
        max_pages, S = self.max_pages(Lp), self.slots_for(B)
        shards = self.shards(S)
        alloc = PageAllocator(pages=shards * self.pool_size(Lp, S // shards), page_size=self.page_size, slots=S,
                              max_pages=max_pages, shards=shards)
        raw, impl = self.place_key(rng)
        if stop_at is not None:
            stop_at = self._place(_on_host(stop_at)[0].astype(np.int32), (None,))
        state = self.start_jit(params, rows=B, pages=alloc.pages)
        sched = _Schedule(alloc, prompt_len=mask.sum(axis=1), cap=N, chunk=self.chunk_steps)
        chunks = slot_steps = 0
        while True:
            if sched.live():
                sched.sync(*_on_host(state.done, state.lengths))  # the chunk boundary's one sync
            admitted = sched.admit()
            if admitted:
                state = self._prefill(params, state, admitted, tokens, mask, raw, impl, alloc, stop_at)
            if not sched.live():
                break
            idx, table = sched.selection()
            slot_rows = np.asarray(sched.slot_row, np.int32)[idx]
            place = self._place
            state = self.decode_jit(params, state, place(table, ("batch", None)), place(idx, ("batch",)),
                                    place(slot_rows, ("batch",)), raw, stop_at, key_impl=impl)
            chunks += 1
            slot_steps += len(idx) * self.chunk_steps
        self.last_stats = {"slots": S, "chunk": self.chunk_steps, "page_size": self.page_size, "chunks": chunks,
                           "peak_pages": alloc.peak, "pool_pages": alloc.pages, "evictions": sched.evictions,
                           "prefills": sched.prefills, "slot_steps": slot_steps}
        return RolloutOutput(
            prompt_tokens=self._place(tokens, ("batch", "length")), prompt_mask=self._place(mask, ("batch", "length")),
            tokens=state.tokens, mask=state.mask, lengths=state.out_len, truncated=state.truncated,
            logprobs=state.logprobs, behaviour_logprobs=state.behaviour,
        )

    def stream(self, params: Any, feeder: "StreamFeeder", rng: jax.Array, *, rows: int, prompt_length: int,
               round_rows: int) -> RolloutOutput:
        """Rows fed while the rollout runs: dynamic sampling's stream (issue 39).

        At every chunk boundary the engine hands ``feeder`` the rows that finished since
        the last one (:meth:`StreamFeeder.finished`, ascending: tokens and masks read to
        the host) and stops as soon as it answers True; it then asks
        :meth:`StreamFeeder.feed` for more prompts ([n, ``prompt_length``] left-padded),
        queued after the rows already fed, K rows each, and ends when nothing runs, is
        queued or is fed. Rows still queued or decoding when the feeder stops are dropped
        (their tokens so far stay in the output: what was rolled out).

        ``rows``: the most rows a step may feed (the output's row count); row ``r`` is
        sample ``r % K`` of the ``r // K``-th prompt fed. Its key is row ``r % round_rows``
        of round ``q = r // round_rows``: ``fold_in(rng_q, r % round_rows)`` with ``rng_0 =
        rng`` and ``rng_q = fold_in(rng, q)``, the keys of the rounds the static step makes,
        so a prompt draws the same tokens whether streamed or rolled out in its round.
        Figures land in :attr:`last_stats` (``fed_rows``, ``finished_rows``,
        ``dropped_rows``: fed and not finished)."""
        K, N = self.sampling.num_generations, self.sampling.max_new_tokens
        B, Lp = rows, prompt_length
        tokens, mask = np.zeros((B, Lp), np.int32), np.zeros((B, Lp), np.int32)
        S = self.slots_for(B)
        shards = self.shards(S)
        alloc = PageAllocator(pages=shards * self.pool_size(Lp, S // shards), page_size=self.page_size, slots=S,
                              max_pages=self.max_pages(Lp), shards=shards)
        keys, impl = self.place_key(_round_keys(rng, rows=B, round_rows=round_rows))
        state = self.start_jit(params, rows=B, pages=alloc.pages)
        sched = _Schedule(alloc, prompt_len=np.zeros(B, np.int64), cap=N, chunk=self.chunk_steps)
        sched.queue.clear()
        fed = finished = chunks = slot_steps = 0
        while True:
            if sched.live():
                done, lengths = (np.asarray(x) for x in jax.device_get((state.done, state.lengths)))
                ended = np.sort([r for s, r in enumerate(sched.slot_row) if r >= 0 and done[s]]).astype(np.int64)
                sched.sync(done, lengths)
                if ended.size:
                    finished += ended.size
                    out_tokens, out_mask = jax.device_get((state.tokens, state.mask))
                    if feeder.finished(ended, np.asarray(out_tokens)[ended], np.asarray(out_mask)[ended]):
                        break
            more = feeder.feed()
            if more is not None and len(more[0]):
                t, m = _left_aligned(np.asarray(more[0]), np.asarray(more[1]))
                new = np.arange(fed, fed + len(t) * K)
                if new.size and new[-1] >= B:
                    raise ValueError(f"the feeder fed more than rows={B} rows")
                tokens[new], mask[new] = np.repeat(t, K, axis=0), np.repeat(m, K, axis=0)
                sched.prompt_len[new] = mask[new].sum(axis=1)
                sched.queue.extend(int(r) for r in new)
                fed += new.size
            admitted = sched.admit()
            if admitted:
                state = self._prefill(params, state, admitted, tokens, mask, keys, impl, alloc)
            if not sched.live():
                break
            idx, table = sched.selection()
            slot_rows = np.asarray(sched.slot_row, np.int32)[idx]
            state = self.decode_jit(params, state, self._place(table, ("batch", None)), self._place(idx, ("batch",)),
                                    self._place(slot_rows, ("batch",)), keys, None, key_impl=impl)
            chunks += 1
            slot_steps += len(idx) * self.chunk_steps
        self.last_stats = {"slots": S, "chunk": self.chunk_steps, "page_size": self.page_size, "chunks": chunks,
                           "peak_pages": alloc.peak, "pool_pages": alloc.pages, "evictions": sched.evictions,
                           "prefills": sched.prefills, "slot_steps": slot_steps, "fed_rows": fed,
                           "finished_rows": finished, "dropped_rows": fed - finished}
        return RolloutOutput(
            prompt_tokens=self._place(tokens, ("batch", "length")), prompt_mask=self._place(mask, ("batch", "length")),
            tokens=state.tokens, mask=state.mask, lengths=state.out_len, truncated=state.truncated,
            logprobs=state.logprobs, behaviour_logprobs=state.behaviour,
        )

    def simulate(self, *, prompt_lengths: Any, completions: Any, prompt_length: int,
                 trace: list | None = None) -> dict[str, int]:
        """What :meth:`generate` would do with rows of known lengths (``prompt_lengths``,
        ``completions`` [rows], each at most the cap), without a model: the same host
        scheduler (:class:`_Schedule`) and allocator, each live slot advancing up to a
        chunk of steps a chunk, a row done once it holds its completion. Returns the
        figures of :attr:`last_stats` (chunks, slot_steps, peak_pages, evictions, ...);
        ``grpo plan --lengths`` reports them. A stop token ends a row exactly as a known
        length does, so on the rows a rollout produced it reproduces that rollout's.

        ``trace`` (a list; ``grpo plan`` costs the schedule from it) receives one entry per
        prefill batch, ``{"prefill": rows admitted}``, and per decode chunk, ``{"idx"`` [n]
        the slots decoded (part by part of the pool), ``"width"`` their page-table width,
        ``"lengths"`` [n] their cached tokens at the chunk's start, ``"advance"`` [n] the
        steps each is live in the chunk``}``."""
        plen = np.asarray(prompt_lengths, np.int64)
        comp = np.asarray(completions, np.int64)
        B, C = len(comp), self.chunk_steps
        S = self.slots_for(B)
        shards = self.shards(S)
        alloc = PageAllocator(pages=shards * self.pool_size(prompt_length, S // shards), page_size=self.page_size,
                              slots=S, max_pages=self.max_pages(prompt_length), shards=shards)
        sched = _Schedule(alloc, prompt_len=plen, cap=self.sampling.max_new_tokens, chunk=C)
        drawn = np.zeros(S, np.int64)  # tokens the slot's row has drawn (its step count)
        lengths = np.zeros(S, np.int64)  # tokens of the row in its pages
        chunks = slot_steps = 0
        while True:
            if sched.live():
                rows = np.asarray(sched.slot_row)
                sched.sync((rows >= 0) & (drawn >= comp[np.maximum(rows, 0)]), lengths)
            admitted = sched.admit()
            for slot, row in admitted:  # the prefill draws step 0
                drawn[slot], lengths[slot] = 1, plen[row]
            if admitted and trace is not None:
                trace.append({"prefill": len(admitted)})
            if not sched.live():
                break
            idx, table = sched.selection()
            rows = np.asarray(sched.slot_row)
            live = rows >= 0
            steps = np.where(live, np.clip(comp[np.maximum(rows, 0)] - drawn, 0, C), 0)
            if trace is not None:
                trace.append({"idx": idx, "width": table.shape[1], "lengths": lengths[idx].copy(),
                              "advance": steps[idx].copy()})
            drawn, lengths = drawn + steps, lengths + steps
            chunks += 1
            slot_steps += len(idx) * C
        return {"slots": S, "chunk": C, "page_size": self.page_size, "chunks": chunks, "peak_pages": alloc.peak,
                "pool_pages": alloc.pages, "evictions": sched.evictions, "prefills": sched.prefills,
                "slot_steps": slot_steps}

    def max_pages(self, prompt_length: int) -> int:
        """Pages of a row at the cap (prompt + every token fed back)."""
        return math.ceil((prompt_length + self.sampling.max_new_tokens) / self.page_size)

    def slots_for(self, rows: int) -> int:
        """Decode slots of a rollout of ``rows`` rows."""
        return self.slots or rows

    def pool_size(self, prompt_length: int, slots: int) -> int:
        """Pages of one shard of the pool, for its ``slots`` slots (``pool_pages``, or enough
        for every slot at the cap)."""
        need = self.max_pages(prompt_length)
        pages = self.pool_pages or slots * need
        if pages < need:
            raise ValueError(f"pool_pages={pages} cannot hold one row of prompt {prompt_length} + "
                             f"{self.sampling.max_new_tokens} tokens ({need} pages of {self.page_size})")
        return pages

    def spec(self, slots: int, kv_heads: int) -> PagedSpec:
        """Where the pool lives: its pages over the slots' mesh axes (the rollout's batch
        axes that divide ``slots``), its KV heads over the cache rules' other axes."""
        slot_axes = _axes(self.sharding((slots,), ("batch",)).spec[0])
        kv = _axes(fit_sharding((kv_heads,), ("kv_heads",), self.mesh, self.cache_rules).spec[0])
        return PagedSpec(backend=self.backend, slot_axes=slot_axes, kv_axes=tuple(a for a in kv if a not in slot_axes))

    def shards(self, slots: int) -> int:
        """Parts of the pool (devices along the slots' axes)."""
        return math.prod(self.mesh.shape[a] for a in self.spec(slots, 1).slot_axes)

    def cache_slots(self, prompt_length: int) -> int:
        """A row's cache length at the cap (what the plan's static cost model reads)."""
        return prompt_length + self.sampling.max_new_tokens

    def cache_bytes(self, params: Any, *, rows: int, prompt_length: int) -> int:
        """Per-device bytes of the page pool (keys and values)."""
        S = self.slots_for(rows)
        pool = self._abstract_pool(params, self.shards(S) * self.pool_size(prompt_length, S // self.shards(S)), S)
        return 2 * math.prod(pool.sharding.shard_shape(pool.shape)) * jnp.dtype(pool.dtype).itemsize

    def jitted(self) -> dict[str, list[Any]]:
        return {"start": [self.start_jit], "prefill": [self.prefill_jit], "decode": [self.decode_jit]}

    def lowerings(self, params: Any, *, prompts: int, prompt_length: int, key: jax.Array) -> dict[str, Any]:
        rows, maxp = prompts * self.sampling.num_generations, self.max_pages(prompt_length)
        S = self.slots_for(rows)
        pages = self.shards(S) * self.pool_size(prompt_length, S // self.shards(S))

        def state():
            return jax.eval_shape(lambda p: self._start_impl(p, rows=rows, pages=pages), params)

        def prefill():
            raw, impl = self._abstract_key(key)
            tok = self._rows(S, prompt_length)
            return self.prefill_jit.lower(params, state(), tok, tok, self._rows(S), self._rows(S),
                                          self._rows(S, maxp), raw, key_impl=impl)

        def decode():
            raw, impl = self._abstract_key(key)
            # The widest variant: every slot, every page of a row at the cap.
            return self.decode_jit.lower(params, state(), self._rows(S, maxp), self._rows(S), self._rows(S), raw,
                                         key_impl=impl)

        return {"start": lambda: self.start_jit.lower(params, rows=rows, pages=pages), "prefill": prefill,
                "decode": decode}

    # ------------------------------------------------------------------ host pieces

    def _prefill(self, params, state, admitted, tokens, mask, raw, impl, alloc, stop_at=None) -> SlotState:
        """The admitted ``(slot, row)`` pairs prefilled as one batch, padded to a power of
        two (padding rows write nowhere: row -1, slot ``slots``)."""
        S = alloc.slots
        n = min(1 << (len(admitted) - 1).bit_length(), S)
        slots = np.full(n, S, np.int32)
        rows = np.full(n, -1, np.int32)
        slots[: len(admitted)], rows[: len(admitted)] = zip(*admitted)
        live = rows >= 0
        table = np.zeros((n, alloc.max_pages), np.int32)
        table[: len(admitted)] = alloc.table()[slots[: len(admitted)]]
        ptok = np.where(live[:, None], tokens[np.maximum(rows, 0)], 0)
        pmask = np.where(live[:, None], mask[np.maximum(rows, 0)], 1)
        place = self._place
        return self.prefill_jit(params, state, place(ptok, ("batch", "length")), place(pmask, ("batch", "length")),
                                place(rows, ("batch",)), place(slots, ("batch",)), place(table, ("batch", None)), raw,
                                stop_at, key_impl=impl)

    # ------------------------------------------------------------------ programs

    def _stop_ids(self) -> tuple[int, ...]:
        """The tokens that end a row's decoding (a multi-turn sampler's turn stops too)."""
        return tuple(self.sampling.eos_ids)

    def _keys(self, raw_key: jax.Array, key_impl: str | None, rows: jax.Array) -> jax.Array:
        """Each row's key ``fold_in(rng, row)`` (:func:`~grpo.engine.rollout._sampling.row_keys`),
        or with a key per row ([rows, key data]: :meth:`stream`) the row's own."""
        if raw_key.ndim == 2:
            data = raw_key[jnp.maximum(rows, 0)]
            return data if key_impl is None else jax.random.wrap_key_data(data, impl=key_impl)
        rng = raw_key if key_impl is None else jax.random.wrap_key_data(raw_key, impl=key_impl)
        return jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.maximum(rows, 0).astype(jnp.uint32))

    def _abstract_pool(self, params: Any, pages: int, slots: int) -> jax.ShapeDtypeStruct:
        """The pool [layers, kv_heads, pages, page_size, head_dim] in its sharding."""
        model = nnx.merge(self.graphdef, params)
        c = model.config
        shape = (c.num_hidden_layers, c.num_key_value_heads, pages, self.page_size, c.head_dim)
        spec = self.spec(slots, c.num_key_value_heads).pool_spec()
        return jax.ShapeDtypeStruct(shape, self._cache_dtype(model), sharding=NamedSharding(self.mesh, spec))

    def _start_impl(self, params: Any, *, rows: int, pages: int) -> SlotState:
        """The empty state: a zero pool of ``pages`` pages, free slots, every row's outputs blank."""
        s, S, N = self.sampling, self.slots_for(rows), self.sampling.max_new_tokens
        pool = self._abstract_pool(params, pages, S)
        zeros = jax.lax.with_sharding_constraint(jnp.zeros(pool.shape, pool.dtype), pool.sharding)

        def batch(x, *names):
            return self._constrain(x, ("batch",) + names)

        return SlotState(
            k=zeros, v=zeros, row=batch(jnp.full((S,), -1, jnp.int32)), lengths=batch(jnp.zeros((S,), jnp.int32)),
            steps=batch(jnp.zeros((S,), jnp.int32)), prev=batch(jnp.full((S,), s.pad_id, jnp.int32)),
            done=batch(jnp.ones((S,), bool)), tokens=batch(jnp.full((rows, N), s.pad_id, jnp.int32), "length"),
            logprobs=batch(jnp.zeros((rows, N), jnp.float32), "length"),
            mask=batch(jnp.zeros((rows, N), jnp.int32), "length"), out_len=batch(jnp.zeros((rows,), jnp.int32)),
            truncated=batch(jnp.zeros((rows,), bool)),
            behaviour=batch(jnp.zeros((rows, N), jnp.float32), "length") if s.truncates else None,
        )

    def _prefill_impl(self, params: Any, state: SlotState, tokens: jax.Array, mask: jax.Array, rows: jax.Array,
                      slots: jax.Array, table: jax.Array, raw_key: jax.Array, stop_at: jax.Array | None = None, *,
                      key_impl: str | None) -> SlotState:
        """Prefill n rows [n, Lp] (left-aligned) into their pages and draw their step 0."""
        s, model = self.sampling, self._model(params)
        n, Lp = tokens.shape
        B, N = state.tokens.shape
        P, ps = state.k.shape[2], state.k.shape[3]
        cache = model.init_cache(n, Lp, dtype=state.k.dtype)
        hidden, cache = model(tokens, positions_from_mask(mask), mask.astype(bool), cache=cache, write_index=0)
        logits = model.logits(hidden[:, -1:, :])[:, 0, :]  # n V
        live = rows >= 0
        plen = mask.sum(axis=1).astype(jnp.int32)  # n
        # Token j of a row (j < its length) is dense slot Lp - len + j -> page table[j // ps], offset j % ps.
        j = jnp.arange(Lp, dtype=jnp.int32)[None, :]  # 1 Lp
        src = jnp.clip(Lp - plen[:, None] + j, 0, Lp - 1)  # n Lp
        valid = live[:, None] & (j < plen[:, None])
        page = jnp.take_along_axis(table, jnp.minimum(j // ps, table.shape[1] - 1).repeat(n, axis=0), axis=1)
        page = jnp.where(valid, page, P)  # out of range: dropped
        offset = jnp.broadcast_to(j % ps, (n, Lp))

        def scatter(pool, dense):  # dense [L, n, Lp, KH, E] -> pool [L, KH, P, ps, E]
            vals = jnp.take_along_axis(dense, src[None, :, :, None, None], axis=2).transpose(0, 3, 1, 2, 4)
            return pool.at[:, :, page, offset].set(vals.astype(pool.dtype), mode="drop")

        eos = jnp.asarray(s.eos_ids, jnp.int32) if s.eos_ids else None
        tok, lp, blp, stopped = draw(logits, self._keys(raw_key, key_impl, rows), jnp.int32(0), live, sampling=s,
                                     stops=eos, stop_at=_per_row(stop_at, rows))
        st = state._replace(k=scatter(state.k, cache.k), v=scatter(state.v, cache.v))
        return self._seat(st, slots=slots, rows=rows, lengths=plen, drawn=(tok, lp, blp, stopped),
                          done=stopped | (N <= 1))

    def _seat(self, st: SlotState, *, slots: jax.Array, rows: jax.Array, lengths: jax.Array, drawn: tuple,
              done: jax.Array) -> SlotState:
        """``rows`` [n] (-1: padding, written nowhere) seated in ``slots`` [n] holding
        ``lengths`` [n] tokens, with their step 0 ``drawn`` (:func:`draw`'s tokens, log-probs,
        behaviour log-probs, stopped) as the first column of their (reset) outputs."""
        s = self.sampling
        tok, lp, blp, stopped = drawn
        n = rows.shape[0]
        B, N = st.tokens.shape
        out_rows = jnp.where(rows >= 0, rows, B)  # padding rows write nowhere
        first = jnp.arange(N)[None, :] == 0
        return st._replace(
            row=st.row.at[slots].set(rows, mode="drop"), lengths=st.lengths.at[slots].set(lengths, mode="drop"),
            steps=st.steps.at[slots].set(1, mode="drop"), prev=st.prev.at[slots].set(tok, mode="drop"),
            done=st.done.at[slots].set(done, mode="drop"),
            tokens=st.tokens.at[out_rows].set(jnp.where(first, tok[:, None], s.pad_id), mode="drop"),
            logprobs=st.logprobs.at[out_rows].set(jnp.where(first, lp[:, None], 0.0), mode="drop"),
            mask=st.mask.at[out_rows].set(first.astype(jnp.int32).repeat(n, axis=0), mode="drop"),
            out_len=st.out_len.at[out_rows].set(1, mode="drop"),
            truncated=st.truncated.at[out_rows].set(~stopped, mode="drop"),
            behaviour=None if blp is None else st.behaviour.at[out_rows].set(jnp.where(first, blp[:, None], 0.0),
                                                                             mode="drop"),
        )

    def _decode_impl(self, params: Any, state: SlotState, table: jax.Array, idx: jax.Array, slot_rows: jax.Array,
                     raw_key: jax.Array, stop_at: jax.Array | None = None, turns: jax.Array | None = None,
                     caps: jax.Array | None = None, *, key_impl: str | None) -> SlotState:
        """``chunk`` decode steps of the n slots ``idx`` [n] (the host's
        :meth:`_Schedule.selection`: the live ones, padded with free ones of the same part
        of the pool; ``slot_rows`` [n] their rows, -1 free or evicted) over their page
        tables [n, W] (the W pages that cover them). Compiled per (n, W): a step costs
        what the live rows and their live pages cost, not every slot at the cap.
        Multi-turn rows (:mod:`grpo.engine.rollout.continuous_multiturn`): ``turns`` [n]
        each slot's turn (its keys), ``caps`` [n] the most tokens of its turn (None: N)."""
        S = state.row.shape[0]
        spec = self.spec(S, state.k.shape[1])
        rows_sharding = NamedSharding(self.mesh, PartitionSpec(spec.slot_axes or None))

        def sub(x):  # [S] -> [n], each device keeps its own slots
            return jax.lax.with_sharding_constraint(x[idx], rows_sharding)

        inner = state._replace(row=jax.lax.with_sharding_constraint(slot_rows, rows_sharding), lengths=sub(state.lengths), steps=sub(state.steps),
                               prev=sub(state.prev), done=sub(state.done) | (slot_rows < 0))
        inner = self._decode_chunk(params, inner, table, raw_key, stop_at, key_impl=key_impl, spec=spec, turns=turns,
                                   caps=caps)

        def back(full, part):
            return jax.lax.with_sharding_constraint(full.at[idx].set(part), rows_sharding)

        return inner._replace(row=back(state.row, inner.row), lengths=back(state.lengths, inner.lengths),
                              steps=back(state.steps, inner.steps), prev=back(state.prev, inner.prev),
                              done=back(state.done, inner.done))

    def _decode_chunk(self, params: Any, state: SlotState, table: jax.Array, raw_key: jax.Array,
                      stop_at: jax.Array | None, *, key_impl: str | None, spec: PagedSpec, turns: jax.Array | None = None,
                      caps: jax.Array | None = None) -> SlotState:
        """``chunk`` decode steps of the slots of ``state`` (per-slot fields [n]; ``turns``,
        ``caps`` as :meth:`_decode_impl`'s)."""
        s, model = self.sampling, self._model(params)
        B, N = state.tokens.shape
        stop_ids = self._stop_ids()
        eos = jnp.asarray(stop_ids, jnp.int32) if stop_ids else None
        keys = self._keys(raw_key, key_impl, state.row)
        if turns is not None:  # a multi-turn row draws turn t's steps from fold_in(its key, t)
            keys = step_keys(keys, turns)
        cap = N if caps is None else caps
        slot_stop = _per_row(stop_at, state.row)

        def step(_, st: SlotState) -> SlotState:
            live = (st.row >= 0) & ~st.done
            cache = PagedKVCache(k=st.k, v=st.v, page_table=table, lengths=st.lengths, live=live)
            hidden, cache = model(st.prev[:, None], st.lengths[:, None], cache=cache, paged=spec)
            t = st.steps
            tok, lp, blp, stopped = draw(model.logits(hidden)[:, 0, :], keys, t, live, sampling=s, stops=eos,
                                         stop_at=slot_stop)
            r = jnp.where(live, st.row, B)  # rows written (others dropped)
            tc = jnp.minimum(t, N - 1)
            return st._replace(
                k=cache.k, v=cache.v, lengths=st.lengths + live, steps=t + live, prev=jnp.where(live, tok, st.prev),
                done=st.done | stopped | (live & (t + 1 >= cap)),
                tokens=st.tokens.at[r, tc].set(tok, mode="drop"), logprobs=st.logprobs.at[r, tc].set(lp, mode="drop"),
                mask=st.mask.at[r, tc].set(1, mode="drop"), out_len=st.out_len.at[r].add(1, mode="drop"),
                truncated=st.truncated.at[r].set(~stopped, mode="drop"),
                behaviour=None if blp is None else st.behaviour.at[r, tc].set(blp, mode="drop"),
            )

        return jax.lax.fori_loop(0, self.chunk_steps, step, state)


class _Schedule:
    """The host's view of the slots at chunk boundaries: the queue, which row each slot
    holds, and the pages each needs (through the allocator)."""

    def __init__(self, alloc: PageAllocator, *, prompt_len: np.ndarray, cap: int, chunk: int):
        self.alloc, self.prompt_len, self.cap, self.chunk = alloc, prompt_len.astype(int), cap, chunk
        self.queue = collections.deque(range(len(prompt_len)))
        self.slot_row = [-1] * alloc.slots
        self.admitted_at: dict[int, int] = {}  # slot -> admission counter (eviction picks the latest)
        self.counter = self.evictions = self.prefills = 0

    def live(self) -> bool:
        return any(r >= 0 for r in self.slot_row)

    def _need(self, slot: int, length: int) -> int:
        """Tokens ``slot`` may hold by the end of the next chunk (never past the cap)."""
        row = self.slot_row[slot]
        return min(length + self.chunk, self.prompt_len[row] + self.cap - 1)

    def sync(self, done: np.ndarray, lengths: np.ndarray) -> None:
        """Free finished rows; grow live ones by the next chunk, evicting the latest
        admitted row of the same part of the pool while it is short."""
        self.release_done(done, lengths)
        self.grow_live(lengths)

    def release_done(self, done: np.ndarray, lengths: np.ndarray) -> list[int]:
        """The rows of the slots that are ``done`` leave them (:meth:`_finish`); returns them."""
        finished = []
        for s, row in enumerate(self.slot_row):
            if row >= 0 and done[s]:
                finished.append(row)
                self._finish(s, int(lengths[s]))
        return finished

    def grow_live(self, lengths: np.ndarray) -> None:
        """Every live slot given the pages of its next chunk, oldest first, evicting while
        its part of the pool is short (:meth:`_evict_one`)."""
        for s in sorted((s for s, r in enumerate(self.slot_row) if r >= 0), key=self.admitted_at.get):
            while self.slot_row[s] >= 0:
                try:
                    self.alloc.grow(s, self._need(s, int(lengths[s])))
                    break
                except PoolExhausted:
                    self._evict_one(self.alloc.shard(s))

    def _finish(self, slot: int, length: int) -> None:
        """A finished row leaves ``slot`` (holding ``length`` tokens): its pages are freed."""
        self._release(slot)

    def _evict_one(self, shard: int) -> None:
        """Evict the latest admitted row of the ``shard``'s part of the pool back to the
        head of the queue (the oldest row there always goes on: the part holds a row at
        the cap)."""
        victim = max((v for v, r in enumerate(self.slot_row) if r >= 0 and self.alloc.shard(v) == shard),
                     key=self.admitted_at.get)
        self.queue.appendleft(self.slot_row[victim])
        self._release(victim)
        self.evictions += 1

    def _admit_length(self, row: int) -> int:
        """Tokens ``row`` holds once prefilled (its prompt)."""
        return int(self.prompt_len[row])

    def selection(self) -> tuple[np.ndarray, np.ndarray]:
        """The slots the next chunk decodes and their page tables: ``idx`` [n] (each part
        of the pool's live slots padded with its free ones to the same power of two, part
        by part, so a device's rows stay its own) and ``table`` [n, W] (W: a power of two
        of pages covering every selected slot's pages, at most ``max_pages``). Powers of
        two bound the decode's compilations to about log2(slots) x log2(max_pages)."""
        a = self.alloc
        parts = [range(d * a.shard_slots, (d + 1) * a.shard_slots) for d in range(a.shards)]
        live = [[s for s in part if self.slot_row[s] >= 0] for part in parts]
        n = min(_pow2(max(len(x) for x in live)), a.shard_slots)
        idx = np.asarray([s for part, lv in zip(parts, live)
                          for s in lv + [s for s in part if self.slot_row[s] < 0][: n - len(lv)]], np.int32)
        held = max(len(a.held(int(s))) for s in idx)
        width = min(_pow2(held), a.max_pages)
        return idx, a.table()[idx, :width]

    def admit(self) -> list[tuple[int, int]]:
        """Queued rows, in queue order, into free slots whose part of the pool fits their
        prompt and first chunk."""
        admitted = []
        for s in range(self.alloc.slots):
            if not self.queue:
                break
            if self.slot_row[s] >= 0:
                continue
            row = self.queue[0]
            self.slot_row[s] = row
            try:
                self.alloc.grow(s, self._need(s, self._admit_length(row)))
            except PoolExhausted:  # another shard's slot may still fit it
                self.slot_row[s] = -1
                continue
            self.queue.popleft()
            self.admitted_at[s] = self.counter
            self.counter += 1
            admitted.append((s, row))
        if admitted:
            self.prefills += 1
        return admitted

    def _release(self, slot: int) -> None:
        self.alloc.free(slot)
        self.slot_row[slot] = -1
        self.admitted_at.pop(slot, None)


class StreamFeeder:
    """What :meth:`ContinuousSampler.stream` consults at chunk boundaries (the step's
    collector implements it; see :mod:`grpo.engine.rollout.step`)."""

    def feed(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Prompts to queue now ([n, prompt_length] tokens and mask, left-padded), or None."""
        raise NotImplementedError

    def finished(self, rows: np.ndarray, tokens: np.ndarray, mask: np.ndarray) -> bool:
        """Rows [m] that finished since the last call (ascending) with their completions
        [m, N]; True ends the stream (what is still in flight is dropped)."""
        raise NotImplementedError


def _round_keys(rng: jax.Array, *, rows: int, round_rows: int) -> jax.Array:
    """Row r's key [rows]: ``fold_in(rng_q, r % round_rows)`` for round ``q = r //
    round_rows`` (``rng_0 = rng``, ``rng_q = fold_in(rng, q)``: the static step's rounds)."""
    within = jnp.arange(round_rows, dtype=jnp.uint32)
    keys = []
    for q in range(-(-rows // round_rows)):
        base = rng if q == 0 else jax.random.fold_in(rng, q)
        keys.append(jax.vmap(lambda i, b=base: jax.random.fold_in(b, i))(within))
    return jnp.concatenate(keys)[:rows]


def _on_host(*arrays: Any) -> list[np.ndarray]:
    """Each of ``arrays`` whole, as numpy, on every process: the host scheduler reads the
    prompts and each chunk's done/lengths, and every process must run the very same
    schedule (the programs it launches are collectives over every process's devices).
    A global array whose shards span several processes is gathered from all of them
    (``process_allgather``: a collective, so every process calls this at the same
    point); numpy inputs are already every process's whole copy (evaluation's batches)."""
    spans = [isinstance(x, jax.Array) and not x.is_fully_addressable for x in arrays]
    gathered = iter([])
    if any(spans):
        from jax.experimental import multihost_utils

        gathered = iter(multihost_utils.process_allgather([x for x, s in zip(arrays, spans) if s], tiled=True))
    return [np.asarray(next(gathered) if s else jax.device_get(x)) for x, s in zip(arrays, spans)]


def _pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def _per_row(stop_at: jax.Array | None, rows: jax.Array) -> jax.Array | None:
    """The forced stop lengths [B] (None: none) of ``rows`` [n] (-1: any)."""
    return None if stop_at is None else stop_at[jnp.maximum(rows, 0)]


def _axes(entry: Any) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axes."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _left_aligned(tokens: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every row's real tokens moved to its end, in order (the static prefill's stable sort)."""
    order = np.argsort(mask != 0, axis=1, kind="stable")
    return np.take_along_axis(tokens, order, axis=1).astype(np.int32), (
        np.take_along_axis(mask, order, axis=1) != 0).astype(np.int32)


__all__ = ["ContinuousSampler", "SlotState", "StreamFeeder"]
