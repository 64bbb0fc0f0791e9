"""The one decode body every engine runs: keys, prefill, draw, record, chunked loops.

The static sampler (:mod:`~grpo.engine.rollout.sampler`), its multi-turn turns
(:mod:`~grpo.engine.rollout.multiturn`) and the paged continuous engine
(:mod:`~grpo.engine.rollout.continuous`, :mod:`~grpo.engine.rollout.continuous_multiturn`)
differ in where their KV cache lives (one dense cache, or a page pool) and in how rows
sit in the batch (every row at the same step, or each slot at its own). What a token is
does not differ, and lives here once:

- :func:`row_key_data`: **the row-key derivation**. Row ``r`` of a rollout draws from
  ``fold_in(rng, r)`` (or, when the caller hands each row its own key, that key), so a
  row's samples depend on the run key and its index alone, never on the batch, the slot
  or the sharding it ran in;
- :func:`prefill_forward`: **the prefill**: left-aligned prompts through the model into
  a fresh dense cache, and the next-token logits after each prompt;
- :func:`draw`: **the draw** of one step of every row (sampled token, both log-probs,
  which rows stopped) from that step's key ``fold_in(row key, step)``;
- :class:`Outputs`: **the record** of a draw into the rollout's output buffers, at one
  column for every row (:meth:`Outputs.column`) or at each row's own column
  (:meth:`Outputs.scatter`);
- :func:`run_chunks`, :func:`segment_plan`, :func:`effective_chunk`: the chunked
  ``fori_loop`` inside a ``while_loop`` that reads "all done?" once per chunk.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo.engine.rollout._sampling import SamplingParams, sample_tokens, step_keys
from grpo.models.decoder import KVCache, positions_from_mask

# --------------------------------------------------------------------------- keys


def row_key_data(raw_key: jax.Array, key_impl: str | None, rows: jax.Array) -> jax.Array:
    """Each of ``rows`` [n] int (-1, padding: row 0's) its key [n], inside a program.

    ``raw_key``: the rollout key's data (one key: row ``r`` gets ``fold_in(key, r)``) or
    each row's own key data [rows, ...] (row ``r`` gets entry ``r``: a stream's rows,
    whose keys the feeder chose); ``key_impl``: the typed key's implementation (None: a
    raw ``uint32[2]`` key, and raw keys come back). This is the rollout's one row-key
    derivation: the static sampler asks it for rows ``0 .. B-1``, the continuous engine
    for the rows in its slots, and the host-side feeders' :func:`row_keys` is the same
    function over ``arange``."""
    rows = jnp.maximum(rows, 0)
    if raw_key.ndim == 2:
        data = raw_key[rows]
        return data if key_impl is None else jax.random.wrap_key_data(data, impl=key_impl)
    rng = raw_key if key_impl is None else jax.random.wrap_key_data(raw_key, impl=key_impl)
    return jax.vmap(lambda r: jax.random.fold_in(rng, r))(rows.astype(jnp.uint32))


def row_keys(rng: jax.Array, num_rows: int) -> jax.Array:
    """One PRNG key per row ``0 .. num_rows - 1`` of a rollout keyed ``rng`` (typed or
    raw; the keys come back the same kind): :func:`row_key_data`'s ``fold_in(rng, row)``."""
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    raw = jax.random.key_data(rng) if typed else rng
    return row_key_data(raw, jax.random.key_impl(rng) if typed else None, jnp.arange(num_rows, dtype=jnp.int32))


# --------------------------------------------------------------------------- prefill


def prefill_forward(model: Any, tokens: jax.Array, mask: jax.Array, *, cache_dtype: Any
                    ) -> tuple[jax.Array, KVCache]:
    """The prefill of rows ``tokens`` [n, Lp] (left-aligned: each row's real tokens end at
    slot ``Lp - 1``; ``mask`` [n, Lp] 1 on them): their next-token logits [n, V] and a
    dense cache of exactly ``Lp`` slots holding their keys and values. RoPE positions
    count each row's real tokens from 0. The static sampler grows the cache in place and
    repeats it K times; the paged engine scatters it into the rows' pages."""
    n, Lp = tokens.shape
    cache = model.init_cache(n, Lp, dtype=cache_dtype)
    hidden, cache = model(tokens, positions_from_mask(mask), mask.astype(bool), cache=cache, write_index=0)
    return model.logits(hidden[:, -1:, :])[:, 0, :], cache


def left_align(tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every row's real tokens moved to its end, in order (identity for left-padded rows):
    a stable sort puts the padding first. The mask comes back as int32 0/1."""
    order = jnp.argsort(mask != 0, axis=1, stable=True)
    tokens = jnp.take_along_axis(tokens, order, axis=1)
    return tokens, (jnp.take_along_axis(mask, order, axis=1) != 0).astype(jnp.int32)


def left_align_rows(tokens: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`left_align` on the host, for rows an engine holds there (int32 tokens, 0/1
    mask): the same stable sort."""
    order = np.argsort(mask != 0, axis=1, kind="stable")
    return np.take_along_axis(tokens, order, axis=1).astype(np.int32), (
        np.take_along_axis(mask, order, axis=1) != 0).astype(np.int32)


# --------------------------------------------------------------------------- draw and record


class Drawn(NamedTuple):
    """One step's draw of every row [B]: the tokens (``pad_id`` where not live), their
    full-vocabulary log-probs, the behaviour log-probs (None: no top-k/top-p filter, the
    full ones are the behaviour ones) and which live rows stopped with this token."""

    tokens: jax.Array
    logprobs: jax.Array
    behaviour: jax.Array | None
    stopped: jax.Array


def draw(logits: jax.Array, keys: jax.Array, step: jax.Array, live: jax.Array, *, sampling: SamplingParams,
         stops: jax.Array | None, stop_at: jax.Array | None = None) -> Drawn:
    """One sampling step of every row from ``logits`` [B, V]: each row draws from
    ``fold_in(keys[b], step)`` (``step`` a scalar, or each row's own [B]). Rows not
    ``live`` draw ``pad_id`` and log-prob 0. ``stopped``: the live rows that drew one of
    ``stops`` [S] or, with ``stop_at`` [B] (a benchmark's forced completion lengths,
    ``grpo bench rollout --lengths``), reached their length with this token."""
    s = sampling
    tok, lp, blp = sample_tokens(
        logits, step_keys(keys, step), temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, greedy=s.greedy
    )
    tok = jnp.where(live, tok, jnp.int32(s.pad_id))
    lp = jnp.where(live, lp, 0.0)
    blp = jnp.where(live, blp, 0.0) if s.truncates else None
    forced = jnp.zeros_like(live) if stop_at is None else live & (step + 1 >= stop_at)
    if stops is None or not stops.size:
        return Drawn(tok, lp, blp, forced)
    return Drawn(tok, lp, blp, forced | (live & jnp.any(tok[:, None] == stops[None, :], axis=1)))


class Outputs(NamedTuple):
    """A rollout's output buffers [B, W]: the drawn tokens, their log-probs and (with a
    top-k/top-p filter) their behaviour log-probs. A draw is recorded at one column for
    every row (:meth:`column`: rows in lock-step) or at each row's own column
    (:meth:`scatter`: slots at their own steps); the two write the same values."""

    tokens: jax.Array
    logprobs: jax.Array
    behaviour: jax.Array | None

    @classmethod
    def blank(cls, rows: int, width: int, sampling: SamplingParams, place: Any = lambda x: x) -> "Outputs":
        """Empty buffers: ``pad_id`` tokens, zero log-probs (``place``: each buffer's
        sharding constraint)."""
        return cls(
            tokens=place(jnp.full((rows, width), sampling.pad_id, jnp.int32)),
            logprobs=place(jnp.zeros((rows, width), jnp.float32)),
            behaviour=place(jnp.zeros((rows, width), jnp.float32)) if sampling.truncates else None,
        )

    def column(self, step: jax.Array, drawn: Drawn) -> "Outputs":
        """``drawn`` written at column ``step`` of every row."""
        def put(buf, x):
            return jax.lax.dynamic_update_index_in_dim(buf, x, step, axis=1)

        return Outputs(put(self.tokens, drawn.tokens), put(self.logprobs, drawn.logprobs),
                       None if self.behaviour is None else put(self.behaviour, drawn.behaviour))

    def scatter(self, rows: jax.Array, cols: jax.Array, drawn: Drawn) -> "Outputs":
        """``drawn``'s entry i written at (``rows[i]``, ``cols[i]``); a row out of range
        (``B``: a free slot, a finished row) writes nothing."""
        def put(buf, x):
            return buf.at[rows, cols].set(x, mode="drop")

        return Outputs(put(self.tokens, drawn.tokens), put(self.logprobs, drawn.logprobs),
                       None if self.behaviour is None else put(self.behaviour, drawn.behaviour))


# --------------------------------------------------------------------------- chunked loops


def effective_chunk(max_new_tokens: int, early_stop_chunk: int) -> int:
    """Decode steps between "all stopped?" checks: ``early_stop_chunk`` capped at the
    number of decode steps (0 = no checks)."""
    return min(early_stop_chunk, max(max_new_tokens - 1, 0))


def segment_plan(max_new_tokens: int, *, early_stop_chunk: int, kv_segment: int) -> tuple[tuple[int, int], ...]:
    """Decode steps 1 .. n (step 0 samples from the prefill logits) split into segments
    ``(a, b)``: steps ``a+1 .. b`` run with a cache of ``Lp + b`` slots.

    ``n = max_new_tokens - 1`` rounded up to a whole number of chunks
    (:func:`effective_chunk`; the at most ``chunk - 1`` extra steps are discarded, one
    step for the usual power-of-two lengths), so every chunk runs the same compiled body.
    Segment lengths are ``kv_segment`` rounded up to whole chunks; 0 (or a segment at
    least n long) gives one segment.
    """
    n = max_new_tokens - 1
    if n <= 0:
        return ()
    chunk = effective_chunk(max_new_tokens, early_stop_chunk)
    if chunk > 0:
        n = math.ceil(n / chunk) * chunk
    if kv_segment <= 0 or kv_segment >= n:
        return ((0, n),)
    seg = kv_segment
    if chunk > 0:
        seg = math.ceil(seg / chunk) * chunk
    bounds = list(range(0, n, seg)) + [n]
    return tuple(zip(bounds[:-1], bounds[1:]))


def run_chunks(step: Any, state: Any, *, first: int, n_chunks: int, chunk: int, going: Any) -> Any:
    """Decode steps ``first .. first + n_chunks * chunk - 1`` of ``step(t, state)``:
    ``lax.fori_loop`` chunks of ``chunk`` steps (a static trip count) inside a
    ``lax.while_loop`` that exits once ``going(state)`` is false, so the "all rows done?"
    predicate (a host copy on GPU) is read once per chunk, never per token. The single-turn
    decode and the multi-turn turn loop both run this loop."""

    def cond(carry):
        i, st = carry
        return (i < n_chunks) & going(st)

    def body(carry):
        i, st = carry
        start = first + i * chunk
        return i + 1, jax.lax.fori_loop(0, chunk, lambda j, x: step(start + j, x), st)

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


__all__ = [
    "Drawn", "Outputs", "draw", "effective_chunk", "left_align", "left_align_rows", "prefill_forward", "row_key_data",
    "row_keys", "run_chunks", "segment_plan",
]
