"""Feeders over the rollout-engine contract (:class:`grpo.core.contracts.engine.RolloutEngine`):
what streams rows into an engine that streams (``engine.streams``), using nothing but
``begin``, ``submit``, ``step``, ``read``, ``outputs`` and ``end``. The weights are the
engine's own: those of its last ``update_weights`` (the loop's weight sync), prepared at
the first step and released at ``end``.

- :func:`stream`: streaming dynamic sampling (``train.dynamic_sampling`` on a streaming
  engine): rows fed while the rollout runs, until the feeder has its groups.
- :func:`round_keys`: the row keys of a step's rounds (the one derivation a streamed row
  shares with the round that would have drawn it).

The one-batch feeder is the engine's own ``sample``; partial rollouts' stream is
:mod:`grpo.engine.rollout.partial`; multi-turn turns are the engine's conversations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from grpo.core.contracts.engine import RolloutEngine, RolloutOutput, Rows
from grpo.engine.rollout.decoding import row_keys


class StreamFeeder:
    """What :func:`stream` consults at chunk boundaries (the step's collector implements
    it; see :mod:`grpo.engine.rollout.step`)."""

    def feed(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Prompts to queue now ([n, prompt_length] tokens and mask, left-padded), or None."""
        raise NotImplementedError

    def finished(self, rows: np.ndarray, tokens: np.ndarray, mask: np.ndarray) -> bool:
        """Rows [m] that finished since the last call (ascending) with their completions
        [m, N]; True ends the stream (what is still in flight is dropped)."""
        raise NotImplementedError


def round_keys(rng: jax.Array, *, rows: int, round_rows: int) -> jax.Array:
    """Row r's key [rows]: ``fold_in(rng_q, r % round_rows)`` for round ``q = r //
    round_rows`` (``rng_0 = rng``, ``rng_q = fold_in(rng, q)``: the static step's rounds)."""
    keys = []
    for q in range(-(-rows // round_rows)):
        keys.append(row_keys(rng if q == 0 else jax.random.fold_in(rng, q), round_rows))
    return jnp.concatenate(keys)[:rows]


def stream(engine: RolloutEngine, feeder: StreamFeeder, rng: jax.Array, *, rows: int,
           prompt_length: int, round_rows: int) -> RolloutOutput:
    """Rows fed while the rollout runs, under the weights of the engine's last
    ``update_weights``: dynamic sampling's stream.

    At every chunk boundary the engine's finished rows go to ``feeder``
    (:meth:`StreamFeeder.finished`, ascending: tokens and masks on the host), and the
    stream stops as soon as it answers True; it then asks :meth:`StreamFeeder.feed` for
    more prompts ([n, ``prompt_length``] left-padded), queued after the rows already fed,
    K rows each, and ends when nothing runs, is queued or is fed. Rows still queued or
    decoding when the feeder stops are dropped (their tokens so far stay in the output:
    what was rolled out).

    ``rows``: the most rows a step may feed (the output's row count); row ``r`` is sample
    ``r % K`` of the ``r // K``-th prompt fed, its key row ``r`` of :func:`round_keys`, so
    a prompt draws the same tokens whether streamed or rolled out in its round. Figures
    land in the engine's ``last_stats`` (``fed_rows``, ``finished_rows``,
    ``dropped_rows``: fed and not finished)."""
    K = engine.sampling.num_generations
    engine.begin(rows=rows, prompt_length=prompt_length, key=round_keys(rng, rows=rows, round_rows=round_rows))
    fed = finished = 0
    while True:
        more = feeder.feed()
        if more is not None and len(more[0]):
            new = np.arange(fed, fed + len(more[0]) * K)
            if new.size and new[-1] >= rows:
                raise ValueError(f"the feeder fed more than rows={rows} rows")
            tokens, mask = np.asarray(more[0]), np.asarray(more[1])
            engine.submit(Rows(ids=new, prompt_tokens=np.repeat(tokens, K, axis=0),
                               prompt_mask=np.repeat(mask, K, axis=0), keys=None))
            fed += new.size
        progress = engine.step()
        if progress.idle:
            break
        if progress.finished:
            ended = sorted(progress.finished)
            finished += len(ended)
            got = engine.read(ended)
            if feeder.finished(np.asarray(ended, np.int64), got.tokens, got.mask):
                break
    engine.last_stats = {**engine.stats(), "fed_rows": fed, "finished_rows": finished,
                         "dropped_rows": fed - finished}
    out = engine.outputs()
    engine.end()
    return out


__all__ = ["StreamFeeder", "round_keys", "stream"]
