"""The continuous-batching engine over a paged KV cache (``rollout.engine:
continuous``); its multi-turn rows are
:mod:`grpo.engine.rollout.continuous_multiturn`'s.

It implements the rollout-engine contract (:class:`grpo.RolloutEngine`): one batch
(:meth:`ContinuousSampler.sample`), and rows streamed through a session
(``update_weights``, ``begin``, ``submit``, ``step``, ``read``, ``outputs``) that the
feeders use: streaming dynamic sampling (:mod:`grpo.engine.rollout.feeders`) and partial
rollouts (:mod:`grpo.engine.rollout.partial`). Every path, the plan's simulation
included, runs the one loop of :mod:`grpo.engine.rollout.paged` (scheduler, page
allocator, runner); this module holds the jitted programs the runner calls.

The static :class:`~grpo.engine.rollout.sampler.Sampler` decodes all B = P*K rows of a
step as one batch: each row keeps its decode slot and its ``prompt + max_new_tokens``
cache slots until the longest row stops. Here the rows wait in a queue and a fixed
number of decode slots (``slots``) runs in chunks of ``chunk`` decode steps:

1. **Admit** (host, at a chunk boundary): finished rows give back their slot and pages
   (:class:`~grpo.engine.rollout.paged.pages.PageAllocator`); each live row is given the pages
   the next chunk can write; queued rows take free slots while pages last, in queue
   (row) order. When a live row cannot grow, the most recently admitted row is evicted:
   its pages are freed and it goes back to the head of the queue. A row's draws depend
   only on its key and step, so when it runs again it samples the very same tokens.
2. **Prefill** (one jit per admission-batch size and distinct-prompt count, powers of two
   up to ``slots``): the admitted rows' distinct prompts (a group's K samples share one)
   run once through the model's dense prefill (left-aligned as the static sampler does),
   their keys/values are scattered into each row's pages with the prompt's first real
   token at token 0, and each row draws step 0 from its prompt's last logits.
3. **Decode** (one jit, the state donated): ``chunk`` steps in a ``lax.fori_loop``, no
   host sync inside; each live slot feeds its previous token at position = its cached
   length, writes its key/value into its pages and attends over them alone
   (:mod:`grpo.models.layers.paged`; the Pallas kernel on TPU/GPU).

The host reads three [slots] arrays per chunk (row, done, length). The step ends when the
queue is empty and every slot is free. Row ``r`` draws step ``t`` from
``fold_in(fold_in(rng, r), t)`` exactly as the static sampler, whatever slot it ran in,
so the two give the same tokens (and log-probs to float rounding: attention sums the
same keys in another order).

Limits of this first version (issue 39): a prompt admitted in one batch with its group
is prefilled once, but its pages are copied into each row (not shared between its K
samples); the pool's pages are not split per
device (each device holds the pool of its KV heads; rows are sharded over the batch
axes as in the static sampler); the plan's costs of this engine are the static ones.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo.engine.rollout._sampling import step_keys
from grpo.core.contracts.engine import FinishedRows, Progress, Rows
from grpo.engine.rollout.paged.core import DeviceRunner, EngineCore, SimulatedRunner, on_host
from grpo.engine.rollout.paged.pages import PageAllocator
from grpo.engine.rollout.paged.scheduler import Scheduler, pow2
from grpo.engine.rollout.paged.slots import auto_slots
from grpo.engine.rollout.decoding import Outputs, draw, left_align_rows, prefill_forward, row_key_data
from grpo.engine.rollout.sampler import BaseSampler, RolloutOutput
from grpo.models.layers.paged import (
    BACKENDS,
    PagedKVCache,
    PagedSpec,
    QuantizedPages,
    bitwise_scatter,
    dense_dtype,
    pool_set,
)
from grpo.models.layers.moe import EXPERT_ID_DTYPE, MoeCall
from grpo.models.rollout_quant import CODE_DTYPES, merge_rollout
from grpo.sharding import fit_sharding


class SlotState(NamedTuple):
    """The device state between chunks (donated through prefill and decode)."""

    k: Any  # [L, KH, pages, page_size, E] the page pool (a QuantizedPages with kv_format int8/fp8)
    v: Any
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
    # [B, N, layers, k] int16 (MoE, ``record_routing``): each completion token's experts in
    # every layer, written by the decode step that fed it (-1: not fed, as the static sampler's)
    routed: jax.Array | None = None


class ContinuousSampler(BaseSampler):
    records_routing = True  # each completion token's routed experts (MoE, ``record_routing``)
    quantized_kv = True  # its page pool may hold int8/fp8 codes with scales (``kv_format``)
    streams = True  # rows submitted and stepped (:class:`~grpo.core.contracts.engine.RolloutEngine`)
    simulates = True  # its schedule replayed without a model (:meth:`simulate`)

    """Continuous batching over a paged cache; :meth:`sample` as the static sampler's.

    Args (beside :class:`BaseSampler`'s): ``slots`` decode slots (0: every row of the
    rollout at once; ``auto``: :func:`~grpo.engine.rollout.paged.slots.auto_slots`), ``page_size`` tokens a
    page, ``pool_pages`` pages in the pool (0: enough for every slot at the cap, so no row
    is ever evicted), ``chunk`` decode steps between host boundaries, ``backend`` the
    paged attention (:data:`grpo.kernels.paged_attention.BACKENDS`), ``detokenize`` as
    the static sampler's."""

    def __init__(self, graphdef: Any, *, slots: int | str, page_size: int = 16, pool_pages: int = 0, chunk: int = 16,
                 backend: str = "auto", detokenize: Any = None, compile_ahead: bool = False, **kwargs: Any):
        super().__init__(graphdef, **kwargs)
        checks = (("page_size", page_size, 1), ("pool_pages", pool_pages, 0), ("chunk", chunk, 1))
        for name, value, low in checks + ((("slots", slots, 0),) if slots != "auto" else ()):
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
        self.start_jit = jax.jit(self._start_impl, static_argnames=("rows", "pages", "slots"))
        self.prefill_jit = jax.jit(self._prefill_impl, static_argnames=("key_impl",), donate_argnums=(1,))
        self.decode_jit = jax.jit(self._decode_impl, static_argnames=("key_impl",), donate_argnums=(1,))
        self.refresh_jit = jax.jit(self._refresh_impl, donate_argnums=(1,))
        self.last_stats: dict[str, Any] = {}
        self._core: EngineCore | None = None
        # train.compile.ahead: all: a session's first start compiles every decode bucket in
        # parallel (grpo.engine.rollout.paged.buckets).
        self.compile_ahead = compile_ahead
        self._compiled_buckets: set[tuple[Any, ...]] = set()

    # ------------------------------------------------------------------ the contract

    def begin(self, *, rows: int, prompt_length: int, key: Any = None, versions: bool = False,
              slots: int | None = None, on_weight_change: str = "continue", stop_at: Any = None) -> None:
        """A new session of ``rows`` row ids [0, rows) with prompts of at most
        ``prompt_length`` tokens (whatever the last one held is dropped), read by the
        weights of :meth:`update_weights`. ``key``: the rollout key (row ``r`` draws from
        ``fold_in(key, r)``), each row's key [rows] (typed keys), or None (every
        :class:`~grpo.core.contracts.engine.Rows` brings its own). ``versions``: stamp
        each token with its policy version. ``slots``: decode slots (None:
        :meth:`slots_for` ``rows``). ``stop_at`` [rows] (benchmarks only): each row stops
        once it has that many tokens. ``on_weight_change``: ``continue`` (rows in flight
        go on over the cache the old weights wrote) or ``reprefill`` (before their next
        token, their cached tokens run through the new weights again, rewriting their
        pages). A session is the engine's own state: :meth:`sample` runs beside it without
        touching it."""
        if on_weight_change not in ("continue", "reprefill"):
            raise ValueError(f"on_weight_change must be 'continue' or 'reprefill'; got {on_weight_change!r}")
        # The session's weights are read at its first step (:meth:`step`), prepared then.
        self._core = self._new_core(rows=rows, prompt_length=prompt_length, key=key, versions=versions, slots=slots,
                                    stop_at=stop_at, params=None)
        self._core.version = self.version
        self._core.reprefill = on_weight_change == "reprefill"

    def _new_core(self, *, rows: int, prompt_length: int, key: Any, versions: bool, slots: int | None, stop_at: Any,
                  params: Any) -> EngineCore:
        """An engine core of ``rows`` rows over the device programs (see :meth:`begin`)."""
        S = self.slots_for(rows, prompt_length) if slots is None else slots
        alloc = self._allocator(prompt_length, S)
        sched = Scheduler(alloc, prompt_len=np.zeros(rows, np.int64), cap=self.sampling.max_new_tokens,
                          chunk=self.chunk_steps)
        sched.queue.clear()  # rows enter by submit()
        keys, impl = self.place_key(key) if key is not None else (None, None)
        runner = DeviceRunner(self, alloc, tokens=np.zeros((rows, prompt_length), np.int32),
                              mask=np.zeros((rows, prompt_length), np.int32), keys=keys, impl=impl, params=params,
                              stop_at=stop_at)
        return EngineCore(sched, runner, rows=rows, versions=versions)

    def update_weights(self, params: Any, version: int = 0) -> None:
        super().update_weights(params, version)
        core = getattr(self, "_core", None)
        if core is not None:  # the next chunk reads them (rows in flight go on under them)
            if core.reprefill and int(version) != core.version:
                core.refresh_pending = True  # rows in flight rebuild their pages first
            core.runner.params, core.version = None, int(version)

    def submit(self, rows: Rows) -> None:
        self._submit(self._session(), rows)

    def _submit(self, core: EngineCore, rows: Rows) -> None:
        runner = core.runner
        ids = np.asarray(rows.ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(runner.tokens)):
            raise ValueError(f"row ids must lie in [0, {len(runner.tokens)}) (this session's rows); got "
                             f"{ids.min()}..{ids.max()}")
        t, m = left_align_rows(np.asarray(rows.prompt_tokens), np.asarray(rows.prompt_mask))
        w = t.shape[1]
        runner.tokens[ids, -w:], runner.mask[ids, -w:] = t, m
        if rows.widths is not None:
            runner.widths[ids] = rows.widths
        if rows.keys is not None:  # each row's own key, on the mesh (replicated)
            runner.impl = jax.random.key_impl(rows.keys)
            data = np.asarray(jax.random.key_data(rows.keys))
            if runner.key_data is None:
                runner.key_data = np.zeros((len(runner.tokens),) + data.shape[1:], data.dtype)
            runner.key_data[ids] = data
            runner.keys, _ = self.place_key(runner.key_data)
        core.submit(ids, m.sum(axis=1))

    def step(self) -> Progress:
        core = self._session()
        if core.runner.params is None:  # the first chunk at this version: the weights, prepared
            core.runner.params = self.weights
        return core.step()

    def read(self, ids: Sequence[int]) -> FinishedRows:
        core = self._session()
        ids = list(ids)
        tokens, mask, logprobs, out_len, truncated, behaviour, routed = core.runner.read(ids)
        versions = None if core.versions is None else core.versions[ids].copy()
        return FinishedRows(ids=np.asarray(ids, np.int64), tokens=tokens, mask=mask, logprobs=logprobs,
                            behaviour_logprobs=behaviour, lengths=out_len, truncated=truncated, versions=versions,
                            routed_experts=routed)

    def abort(self, ids: Sequence[int]) -> None:
        sched = self._session().sched
        for r in ids:
            if r in sched.queue:
                sched.queue.remove(r)
            if r in sched.slot_row:
                sched._release(sched.slot_row.index(r))

    def in_flight(self) -> int:
        """Rows of the session decoding or queued."""
        return self._session().in_flight()

    def snapshot(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The session's rows in flight, queued and seated, as JSON and host arrays
        (:meth:`~grpo.engine.rollout.paged.core.EngineCore.snapshot`: the KV cache is not
        kept)."""
        return self._session().snapshot()

    def restore(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> int:
        """A session just begun (same rows, prompt length, slots) put back where
        :meth:`snapshot` left one; its seated rows rebuild their pages under the weights
        of the next :meth:`step` and decode on from their next token. Returns the rows
        seated."""
        return self._session().restore(meta, arrays)

    def regenerated_tokens(self) -> int:
        """Tokens the session has drawn a second time (rows evicted and admitted again)."""
        return self._session().regenerated_tokens

    def outputs(self) -> RolloutOutput:
        """Every row of the session as the rollout's global arrays (row ``r`` at index
        ``r``; rows never submitted are blank)."""
        return self._outputs(self._session())

    def _outputs(self, core: EngineCore) -> RolloutOutput:
        runner = core.runner
        st, place = runner.state, self._place
        return RolloutOutput(
            prompt_tokens=place(runner.tokens, ("batch", "length")), prompt_mask=place(runner.mask, ("batch", "length")),
            tokens=st.tokens, mask=st.mask, lengths=st.out_len, truncated=st.truncated,
            logprobs=st.logprobs, behaviour_logprobs=st.behaviour, routed_experts=st.routed,
        )

    def stats(self) -> dict[str, Any]:
        """The session's schedule figures (chunks, slot steps, peak pages, evictions, ...)."""
        return self._session().stats()

    def end(self) -> None:
        self._core = None
        self.release()

    def _session(self) -> EngineCore:
        core = getattr(self, "_core", None)
        if core is None:
            raise RuntimeError(f"{type(self).__name__}: begin() a session before submitting rows")
        return core

    def _allocator(self, prompt_length: int, slots: int) -> PageAllocator:
        shards = self.shards(slots)
        return PageAllocator(pages=shards * self.pool_size(prompt_length, slots // shards), page_size=self.page_size,
                             slots=slots, max_pages=self.max_pages(prompt_length), shards=shards)

    # ------------------------------------------------------------------ feeders

    def generate(self, params: Any, prompt_tokens: Any, prompt_mask: Any, rng: jax.Array,
                 stop_at: Any = None) -> RolloutOutput:
        """All P*K rows through the queue; the rollout's global arrays (as the static
        sampler's). Per-call figures land in :attr:`last_stats`. ``stop_at`` [P*K]
        (benchmarks only): each row stops once it has that many tokens. Under several
        processes every one runs the same host schedule on gathered prompts and chunk
        boundaries (:func:`~grpo.engine.rollout.paged.core.on_host`), so each launches
        the same programs."""
        tokens, mask = left_align_rows(*on_host(prompt_tokens, prompt_mask))
        K = self.sampling.num_generations
        tokens, mask = np.repeat(tokens, K, axis=0), np.repeat(mask, K, axis=0)  # row b*K + j
        B, Lp = tokens.shape
        if stop_at is not None:
            stop_at = self._place(on_host(stop_at)[0].astype(np.int32), (None,))
        # One batch on a core of its own, with its own weights: a session (partial
        # rollouts) on this engine is left as it is.
        core = self._new_core(rows=B, prompt_length=Lp, key=rng, versions=False, slots=None, stop_at=stop_at,
                              params=params)
        self._submit(core, Rows(ids=np.arange(B), prompt_tokens=tokens, prompt_mask=mask, keys=None))
        core.run()
        self.last_stats = core.stats()
        return self._outputs(core)

    def simulate(self, *, prompt_lengths: Any, completions: Any, prompt_length: int,
                 trace: list | None = None, groups: Any = None) -> dict[str, int]:
        """What :meth:`generate` would do with rows of known lengths (``prompt_lengths``,
        ``completions`` [rows], each at most the cap), without a model: the same engine
        core (:class:`~grpo.engine.rollout.paged.core.EngineCore`: scheduler and
        allocator) over a :class:`~grpo.engine.rollout.paged.core.SimulatedRunner`.
        Returns the figures of :attr:`last_stats` (chunks, slot_steps, peak_pages,
        evictions, ...); ``grpo plan --lengths`` reports them. A stop token ends a row
        exactly as a known length does, so on the rows a rollout produced it reproduces
        that rollout's. ``trace``, ``groups`` (each row's prompt): see
        :class:`~grpo.engine.rollout.paged.core.SimulatedRunner`."""
        plen = np.asarray(prompt_lengths, np.int64)
        comp = np.asarray(completions, np.int64)
        alloc = self._allocator(prompt_length, self.slots_for(len(comp), prompt_length))
        sched = Scheduler(alloc, prompt_len=plen, cap=self.sampling.max_new_tokens, chunk=self.chunk_steps)
        runner = SimulatedRunner(sched, prompt_len=plen, completions=comp, trace=trace,
                                 groups=None if groups is None else np.asarray(groups))
        core = EngineCore(sched, runner, rows=len(comp))
        core.run()
        return core.stats()

    def max_pages(self, prompt_length: int) -> int:
        """Pages of a row at the cap (prompt + every token fed back)."""
        return math.ceil((prompt_length + self.sampling.max_new_tokens) / self.page_size)

    def slots_for(self, rows: int, prompt_length: int = 0) -> int:
        """Decode slots of a rollout of ``rows`` rows (prompts padded to ``prompt_length``:
        what ``auto`` fits into a given ``pool_pages``)."""
        if self.slots == "auto":
            return auto_slots(rows, shards=self.shards(rows), pool_pages=self.pool_pages, prompt_length=prompt_length,
                              cap=self.sampling.max_new_tokens, page_size=self.page_size)
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
        S = self.slots_for(rows, prompt_length)
        pool = self._abstract_pool(params, self.shards(S) * self.pool_size(prompt_length, S // self.shards(S)), S)
        return 2 * sum(math.prod(a.sharding.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize
                       for a in jax.tree.leaves(pool))

    def jitted(self) -> dict[str, list[Any]]:
        quantize = {} if self.quantize_jit is None else {"quantize": [self.quantize_jit]}
        return {**quantize, "start": [self.start_jit], "prefill": [self.prefill_jit], "decode": [self.decode_jit],
                "refresh": [self.refresh_jit]}

    def lowerings(self, params: Any, *, prompts: int, prompt_length: int, key: jax.Array) -> dict[str, Any]:
        rows, maxp = prompts * self.sampling.num_generations, self.max_pages(prompt_length)
        S = self.slots_for(rows, prompt_length)
        pages = self.shards(S) * self.pool_size(prompt_length, S // self.shards(S))

        def state():
            return jax.eval_shape(lambda p: self._start_impl(p, rows=rows, pages=pages, slots=S), params)

        def prefill():
            raw, impl = self._abstract_key(key)
            tok = self._rows(S, prompt_length)  # the widest variant: every slot, every prompt distinct
            return self.prefill_jit.lower(params, state(), tok, tok, self._rows(S), self._rows(S), self._rows(S),
                                          self._rows(S, maxp), raw, key_impl=impl)

        def decode():
            raw, impl = self._abstract_key(key)
            # The widest variant: every slot, every page of a row at the cap.
            return self.decode_jit.lower(params, state(), self._rows(S, maxp), self._rows(S), self._rows(S), raw,
                                         key_impl=impl)

        return {"start": lambda: self.start_jit.lower(params, rows=rows, pages=pages, slots=S), "prefill": prefill,
                "decode": decode}

    def shape_lowerings(self, params: Any, *, prompts: int, prompt_length: int, key: jax.Array) -> list:
        """Every shape of this engine's programs at one prompt width, for a run's schedule
        (:func:`~grpo.engine.rollout.paged.buckets.engine_shapes`; every admission and decode bucket with
        :attr:`compile_ahead`)."""
        from grpo.engine.rollout.paged.buckets import engine_shapes

        return engine_shapes(self, params, prompts=prompts, prompt_length=prompt_length, key=key,
                             every=self.compile_ahead)

    # ------------------------------------------------------------------ host pieces

    def compile_buckets(self, runner: DeviceRunner) -> None:
        """With :attr:`compile_ahead`, compile the decode at every bucket of ``runner``'s
        pool (once per pool, weights layout and key kind) before its first chunk."""
        if not self.compile_ahead or runner.params is None:
            return
        from grpo.engine.rollout.paged.buckets import compile_decode_buckets, decode_buckets

        a = runner.alloc
        key = (a.slots, a.pages, a.max_pages, runner.impl, runner.stop_at is None, runner.keys is None)
        if key in self._compiled_buckets:
            return
        self._compiled_buckets.add(key)
        buckets = decode_buckets(slots=a.slots, shards=a.shards, max_pages=a.max_pages)
        compile_decode_buckets(self, params=runner.params, state=runner.state, keys=runner.keys,
                               stop_at=runner.stop_at, impl=runner.impl, buckets=buckets)

    def prefill_rows(self, params, state, admitted, tokens, mask, raw, impl, alloc, stop_at=None) -> SlotState:
        """The admitted ``(slot, row)`` pairs prefilled as one batch, padded to a power of
        two (padding rows write nowhere: row -1, slot ``slots``). Rows with the same prompt
        (a group's K samples) share one forward pass (:func:`shared_prompts`), as the
        static sampler's prefill of each prompt once; every row still draws its own step 0."""
        S = alloc.slots
        n = min(pow2(len(admitted)), S)
        slots = np.full(n, S, np.int32)
        rows = np.full(n, -1, np.int32)
        slots[: len(admitted)], rows[: len(admitted)] = zip(*admitted)
        table = np.zeros((n, alloc.max_pages), np.int32)
        table[: len(admitted)] = alloc.table()[slots[: len(admitted)]]
        firsts, src = shared_prompts(tokens, mask, rows[: len(admitted)])
        u = min(pow2(len(firsts)), n)
        src = np.concatenate([src, np.zeros(n - len(src), np.int32)])  # padding rows read prompt 0
        ptok, pmask = np.zeros((u, tokens.shape[1]), np.int32), np.ones((u, tokens.shape[1]), np.int32)
        ptok[: len(firsts)], pmask[: len(firsts)] = tokens[firsts], mask[firsts]
        place = self._place
        return self.prefill_jit(params, state, place(ptok, ("batch", "length")), place(pmask, ("batch", "length")),
                                place(src, ("batch",)), place(rows, ("batch",)), place(slots, ("batch",)),
                                place(table, ("batch", None)), raw, stop_at, key_impl=impl)

    # ------------------------------------------------------------------ programs

    def _stop_ids(self) -> tuple[int, ...]:
        """The tokens that end a row's decoding (a multi-turn sampler's turn stops too)."""
        return tuple(self.sampling.eos_ids)

    def _abstract_pool(self, params: Any, pages: int, slots: int) -> Any:
        """The pool [layers, kv_heads, pages, page_size, head_dim] in its sharding (with
        ``kv_format`` int8/fp8: a :class:`QuantizedPages` of codes and their per-token,
        per-head float32 scales)."""
        model = merge_rollout(self.graphdef, params)
        c = model.config
        shape = (c.num_hidden_layers, c.num_key_value_heads, pages, self.page_size, c.head_dim)
        spec = self.spec(slots, c.num_key_value_heads).pool_spec()
        if self.kv_format == "none":
            return jax.ShapeDtypeStruct(shape, self._cache_dtype(model), sharding=NamedSharding(self.mesh, spec))
        return QuantizedPages(
            codes=jax.ShapeDtypeStruct(shape, CODE_DTYPES[self.kv_format], sharding=NamedSharding(self.mesh, spec)),
            scales=jax.ShapeDtypeStruct(shape[:4], jnp.float32, sharding=NamedSharding(self.mesh, PartitionSpec(*spec[:4]))))

    def _start_impl(self, params: Any, *, rows: int, pages: int, slots: int | None = None) -> SlotState:
        """The empty state: a zero pool of ``pages`` pages, ``slots`` free slots (None:
        :meth:`slots_for` ``rows``), every row's outputs blank."""
        s, S, N = self.sampling, self.slots_for(rows) if slots is None else slots, self.sampling.max_new_tokens
        pool = self._abstract_pool(params, pages, S)
        zeros = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(jnp.zeros(a.shape, a.dtype), a.sharding), pool)

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
            routed=self._blank_routing(params, rows, batch),
        )

    def _blank_routing(self, params: Any, rows: int, batch: Any) -> jax.Array | None:
        """Every row's routed experts [rows, N, layers, k], -1 (None unless ``record_routing``)."""
        if not self.record_routing:
            return None
        c = merge_rollout(self.graphdef, params).config
        shape = (rows, self.sampling.max_new_tokens, c.num_hidden_layers, c.num_experts_per_tok)
        return batch(jnp.full(shape, -1, EXPERT_ID_DTYPE), "length", None, None)

    def _prefill_impl(self, params: Any, state: SlotState, tokens: jax.Array, mask: jax.Array, src: jax.Array,
                      rows: jax.Array, slots: jax.Array, table: jax.Array, raw_key: jax.Array,
                      stop_at: jax.Array | None = None, *, key_impl: str | None) -> SlotState:
        """Prefill u distinct prompts [u, Lp] (left-aligned) once, then seat n rows, row i
        over prompt ``src[i]``: its keys/values scattered into its pages, its step 0 drawn
        (with its own key) from its prompt's last logits."""
        s, model = self.sampling, self._model(params)
        N = state.tokens.shape[1]
        logits, cache = prefill_forward(model, tokens, mask, cache_dtype=dense_dtype(state.k, model.dtype))  # u V
        logits = logits[src]  # n V
        cache = cache._replace(k=cache.k[:, src], v=cache.v[:, src])
        live = rows >= 0
        plen = mask.sum(axis=1).astype(jnp.int32)[src]  # n
        eos = jnp.asarray(s.eos_ids, jnp.int32) if s.eos_ids else None
        drawn = draw(logits, row_key_data(raw_key, key_impl, rows), jnp.int32(0), live, sampling=s, stops=eos,
                     stop_at=_per_row(stop_at, rows))
        st = self._write_pages(state, cache, plen, table, live)
        return self._seat(st, slots=slots, rows=rows, lengths=plen, drawn=drawn, done=drawn.stopped | (N <= 1))

    def _refresh_impl(self, params: Any, state: SlotState, tokens: jax.Array, mask: jax.Array, rows: jax.Array,
                      table: jax.Array) -> SlotState:
        """Rebuild the pages of n in-flight rows under ``params``: each row's cached
        tokens (its prompt and every drawn token but the last, which the next step feeds)
        [n, L] left-aligned, through the model again, their keys and values written over
        the old ones (``train.async.on_weight_change: reprefill``). Nothing is drawn."""
        model = self._model(params)
        _, cache = prefill_forward(model, tokens, mask, cache_dtype=dense_dtype(state.k, model.dtype))
        return self._write_pages(state, cache, mask.sum(axis=1).astype(jnp.int32), table, rows >= 0)

    def _write_pages(self, state: SlotState, cache: Any, lengths: jax.Array, table: jax.Array, live: jax.Array
                     ) -> SlotState:
        """A dense prefill cache [layers, n, L, KH, E] (rows left-aligned, ``lengths`` [n]
        real tokens) written into the rows' pages (``table`` [n, W]); rows not ``live``
        write nowhere."""
        n, L = cache.k.shape[1], cache.k.shape[2]
        P, ps = state.k.shape[2], state.k.shape[3]
        # Token j of a row (j < its length) is dense slot L - len + j -> page table[j // ps], offset j % ps.
        j = jnp.arange(L, dtype=jnp.int32)[None, :]  # 1 L
        src = jnp.clip(L - lengths[:, None] + j, 0, L - 1)  # n L
        valid = live[:, None] & (j < lengths[:, None])
        page = jnp.take_along_axis(table, jnp.minimum(j // ps, table.shape[1] - 1).repeat(n, axis=0), axis=1)
        page = jnp.where(valid, page, P)  # out of range: dropped
        offset = jnp.broadcast_to(j % ps, (n, L))

        def scatter(pool, dense):  # dense [layers, n, L, KH, E] -> pool [layers, KH, P, ps, E]
            vals = jnp.take_along_axis(dense, src[None, :, :, None, None], axis=2).transpose(0, 3, 1, 2, 4)
            return pool_set(pool, (slice(None), slice(None), page, offset), vals, mode="drop", bits=bits)

        bits = bitwise_scatter(None if self.mesh is None else self.mesh.devices.flat[0].platform)
        return state._replace(k=scatter(state.k, cache.k), v=scatter(state.v, cache.v))

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
            # a row seated again (evicted) feeds its tokens again: what it recorded is dropped
            routed=None if st.routed is None else st.routed.at[out_rows].set(-1, mode="drop"),
        )

    def _decode_impl(self, params: Any, state: SlotState, table: jax.Array, idx: jax.Array, slot_rows: jax.Array,
                     raw_key: jax.Array, stop_at: jax.Array | None = None, turns: jax.Array | None = None,
                     caps: jax.Array | None = None, *, key_impl: str | None) -> SlotState:
        """``chunk`` decode steps of the n slots ``idx`` [n] (the host's
        :meth:`~grpo.engine.rollout.paged.scheduler.Scheduler.selection`: the live ones, padded with free ones of the same part
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
        keys = row_key_data(raw_key, key_impl, state.row)
        if turns is not None:  # a multi-turn row draws turn t's steps from fold_in(its key, t)
            keys = step_keys(keys, turns)
        cap = N if caps is None else caps
        slot_stop = _per_row(stop_at, state.row)

        routing = state.routed is not None

        def step(_, st: SlotState) -> SlotState:
            live = (st.row >= 0) & ~st.done
            cache = PagedKVCache(k=st.k, v=st.v, page_table=table, lengths=st.lengths, live=live)
            called = model(st.prev[:, None], st.lengths[:, None], cache=cache, paged=spec,
                           **({"moe": MoeCall()} if routing else {}))
            hidden, cache = called[:2]
            t = st.steps
            drawn = draw(model.logits(hidden)[:, 0, :], keys, t, live, sampling=s, stops=eos, stop_at=slot_stop)
            r = jnp.where(live, st.row, B)  # rows written (others dropped)
            tc = jnp.minimum(t, N - 1)
            out = Outputs(st.tokens, st.logprobs, st.behaviour).scatter(r, tc, drawn)
            return st._replace(
                k=cache.k, v=cache.v, lengths=st.lengths + live, steps=t + live,
                prev=jnp.where(live, drawn.tokens, st.prev), done=st.done | drawn.stopped | (live & (t + 1 >= cap)),
                tokens=out.tokens, logprobs=out.logprobs, behaviour=out.behaviour,
                mask=st.mask.at[r, tc].set(1, mode="drop"), out_len=st.out_len.at[r].add(1, mode="drop"),
                truncated=st.truncated.at[r].set(~drawn.stopped, mode="drop"),
                # the experts [L, n, 1, k] of the token fed (completion token t - 1) at its column
                routed=st.routed.at[r, jnp.maximum(t - 1, 0)].set(
                    jnp.transpose(called[2].experts[:, :, 0], (1, 0, 2)), mode="drop") if routing else None,
            )

        return jax.lax.fori_loop(0, self.chunk_steps, step, state)


def shared_prompts(tokens: np.ndarray, mask: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct prompts among ``rows`` [n] of ``tokens``/``mask`` [R, Lp]: ``firsts``
    [u] the first row of each (in order of appearance) and ``src`` [n] int32 each row's
    index into ``firsts`` (rows whose prompt tokens and mask are equal share one)."""
    seen: dict[bytes, int] = {}
    firsts: list[int] = []
    src = np.zeros(len(rows), np.int32)
    for i, r in enumerate(rows):
        key = tokens[r].tobytes() + mask[r].tobytes()
        if key not in seen:
            seen[key] = len(firsts)
            firsts.append(int(r))
        src[i] = seen[key]
    return np.asarray(firsts, np.int64), src


def _per_row(stop_at: jax.Array | None, rows: jax.Array) -> jax.Array | None:
    """The forced stop lengths [B] (None: none) of ``rows`` [n] (-1: any)."""
    return None if stop_at is None else stop_at[jnp.maximum(rows, 0)]


def _axes(entry: Any) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axes."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


__all__ = ["ContinuousSampler", "SlotState", "shared_prompts"]
