"""The static engine's rows: the contract's ``begin``/``submit``/``step``/``read`` over
whole batches.

The static sampler (:class:`~grpo.engine.rollout.sampler.Sampler`) has no slots and no
pages: its programs roll out a batch from prefill to the last token in one go. It still
takes rows through the engine contract (:class:`grpo.RolloutEngine`), so a feeder written
against the contract runs on it unchanged:

- :meth:`BatchRows.submit` queues :class:`~grpo.core.contracts.engine.Rows` (their
  prompts and, or else the session's rollout key, their own keys);
- :meth:`BatchRows.step` rolls out every queued row as one batch (prefill, then decode
  to the end) under the weights of the last ``update_weights``, and reports all of them
  finished; nothing can join a batch while it runs, which is why the static engine does
  not claim ``streams`` (the capability partial rollouts and streaming dynamic sampling
  need);
- :meth:`BatchRows.read` / :meth:`BatchRows.outputs` hand the finished rows on the host
  or as the rollout's global arrays, every token stamped with the policy version that
  drew it (and, recording routing, with the experts it was fed through).

Row ``r`` draws step ``t`` from ``fold_in(fold_in(key, r), t)`` (or ``fold_in(its own
key, t)``): exactly what :meth:`~grpo.engine.rollout.sampler.Sampler.sample` draws for
row ``r`` of the same key, whatever batch the row was submitted in (the one row-key
derivation, :func:`~grpo.engine.rollout.decoding.row_key_data`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo.core.contracts.engine import FinishedRows, Progress, RolloutOutput, Rows
from grpo.engine.rollout.decoding import left_align_rows, row_key_data


@dataclasses.dataclass
class _Session:
    """A session's rows on the host: prompts (left-aligned) [rows, Lp], keys, the queue,
    and each finished row's outputs [rows, N]."""

    tokens: np.ndarray
    mask: np.ndarray
    widths: np.ndarray
    key: Any  # the session's raw rollout key (row r: fold_in(key, r)), or None
    impl: str | None
    key_data: np.ndarray | None  # rows' own keys (submitted with them)
    out: dict[str, np.ndarray]
    versions: np.ndarray | None
    queue: list[int] = dataclasses.field(default_factory=list)
    batches: int = 0
    rows_run: int = 0


class BatchRows:
    """The contract's row methods for an engine whose programs roll out whole batches
    (``self.prefill(params, tokens, mask, repeat=1)``, ``self.decode(params, prefilled,
    raw_key_data)``), mixed into :class:`~grpo.engine.rollout.sampler.Sampler`."""

    def begin(self, *, rows: int, prompt_length: int, key: Any = None, versions: bool = False,
              slots: int | None = None, on_weight_change: str = "continue") -> None:
        """A session of row ids [0, ``rows``) (see :meth:`grpo.RolloutEngine.begin`);
        ``slots`` is ignored (a step rolls out every queued row at once), and so is
        ``on_weight_change`` (no row is in flight between steps, when weights change)."""
        del slots, on_weight_change
        s = self.sampling
        N = s.max_new_tokens
        impl, raw = None, None
        if key is not None:
            typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
            impl = jax.random.key_impl(key) if typed else None
            raw = np.asarray(jax.random.key_data(key) if typed else key)
        out = {"tokens": np.full((rows, N), s.pad_id, np.int32), "mask": np.zeros((rows, N), np.int32),
               "logprobs": np.zeros((rows, N), np.float32), "lengths": np.zeros(rows, np.int32),
               "truncated": np.zeros(rows, bool)}
        if s.truncates:
            out["behaviour"] = np.zeros((rows, N), np.float32)
        self._batch_session = _Session(
            tokens=np.full((rows, prompt_length), s.pad_id, np.int32), mask=np.zeros((rows, prompt_length), np.int32),
            widths=np.full(rows, prompt_length, np.int64), key=raw, impl=impl,
            key_data=raw if raw is not None and raw.ndim == 2 else None, out=out,
            versions=np.full((rows, N), -1, np.int64) if versions else None)

    def submit(self, rows: Rows) -> None:
        ses = self._row_session()
        ids = np.asarray(rows.ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(ses.tokens)):
            raise ValueError(f"row ids must lie in [0, {len(ses.tokens)}) (this session's rows); got "
                             f"{ids.min()}..{ids.max()}")
        t, m = left_align_rows(np.asarray(rows.prompt_tokens), np.asarray(rows.prompt_mask))
        if ids.size and np.any(m.sum(axis=1) == 0):
            raise ValueError(f"rows {ids[m.sum(axis=1) == 0][:10].tolist()} have no prompt tokens")
        w = t.shape[1]
        ses.tokens[ids], ses.mask[ids] = self.sampling.pad_id, 0
        ses.tokens[ids, -w:], ses.mask[ids, -w:] = t, m
        ses.widths[ids] = w if rows.widths is None else np.asarray(rows.widths)
        if rows.keys is not None:
            ses.impl = jax.random.key_impl(rows.keys)
            data = np.asarray(jax.random.key_data(rows.keys))
            if ses.key_data is None:
                ses.key_data = np.zeros((len(ses.tokens),) + data.shape[1:], data.dtype)
            ses.key_data[ids] = data
        elif ses.key is None and ses.key_data is None:
            raise ValueError("these rows bring no keys and the session has no rollout key (begin(key=...))")
        ses.queue.extend(int(r) for r in ids)

    def step(self) -> Progress:
        """Every queued row rolled out as one batch; all of them finish."""
        ses = self._row_session()
        if not ses.queue:
            return Progress(idle=True)
        ids = np.asarray(ses.queue, np.int64)
        ses.queue = []
        w = int(ses.widths[ids].max())
        prefilled = self.prefill(self.weights, ses.tokens[ids, -w:], ses.mask[ids, -w:], repeat=1)
        out, _ = self.decode(self.weights, prefilled, self._row_keys(ses, ids))
        got = dict(zip(("tokens", "mask", "logprobs", "lengths", "truncated"),
                       jax.device_get((out.tokens, out.mask, out.logprobs, out.lengths, out.truncated))))
        if "behaviour" in ses.out:
            got["behaviour"] = jax.device_get(out.behaviour)
        if out.routed_experts is not None:  # MoE, record_routing: [n, N, layers, k] int16
            got["routed"] = routed = np.asarray(jax.device_get(out.routed_experts))
            if "routed" not in ses.out:
                ses.out["routed"] = np.full((len(ses.tokens),) + routed.shape[1:], -1, routed.dtype)
        for name, value in got.items():
            ses.out[name][ids] = np.asarray(value)
        if ses.versions is not None:
            ses.versions[ids] = np.where(ses.out["mask"][ids] == 1, self.version, -1)
        ses.batches += 1
        ses.rows_run += ids.size
        return Progress(finished=tuple(int(r) for r in ids))

    def read(self, ids: Sequence[int]) -> FinishedRows:
        ses = self._row_session()
        ids = np.asarray(list(ids), np.int64)
        o = ses.out
        return FinishedRows(ids=ids, tokens=o["tokens"][ids], mask=o["mask"][ids], logprobs=o["logprobs"][ids],
                            behaviour_logprobs=o["behaviour"][ids] if "behaviour" in o else None,
                            lengths=o["lengths"][ids], truncated=o["truncated"][ids],
                            versions=None if ses.versions is None else ses.versions[ids].copy(),
                            routed_experts=o["routed"][ids] if "routed" in o else None)

    def abort(self, ids: Sequence[int]) -> None:
        """Drop queued rows (between steps no row is running)."""
        ses = self._row_session()
        gone = {int(r) for r in ids}
        ses.queue = [r for r in ses.queue if r not in gone]

    def in_flight(self) -> int:
        return len(self._row_session().queue)

    def outputs(self) -> RolloutOutput:
        """Every row of the session as the rollout's global arrays (row ``r`` at index
        ``r``; rows never rolled out are blank)."""
        ses = self._row_session()
        o = ses.out

        def place(x, names):
            sharding = self.sharding(x.shape, names)
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        return RolloutOutput(
            prompt_tokens=place(ses.tokens, ("batch", "length")), prompt_mask=place(ses.mask, ("batch", "length")),
            tokens=place(o["tokens"], ("batch", "length")), mask=place(o["mask"], ("batch", "length")),
            lengths=place(o["lengths"], ("batch",)), truncated=place(o["truncated"], ("batch",)),
            logprobs=place(o["logprobs"], ("batch", "length")),
            behaviour_logprobs=place(o["behaviour"], ("batch", "length")) if "behaviour" in o else None,
            routed_experts=place(o["routed"], ("batch", "length", None, None)) if "routed" in o else None,
        )

    def stats(self) -> dict[str, Any]:
        ses = self._row_session()
        return {"batches": ses.batches, "rows": ses.rows_run}

    def end(self) -> None:
        self._batch_session = None
        super().end()  # the prepared weights too

    def _row_session(self) -> _Session:
        ses = getattr(self, "_batch_session", None)
        if ses is None:
            raise RuntimeError(f"{type(self).__name__}: begin() a session before submitting rows")
        return ses

    @staticmethod
    def _row_keys(ses: _Session, ids: np.ndarray) -> Any:
        """Rows ``ids``' keys [n] (typed, or raw ``uint32`` data when the session's are):
        their own, else ``fold_in(key, id)``."""
        if ses.key_data is not None:
            data = jnp.asarray(ses.key_data[ids])
            return data if ses.impl is None else jax.random.wrap_key_data(data, impl=ses.impl)
        return row_key_data(jnp.asarray(ses.key), ses.impl, jnp.asarray(ids, jnp.int32))


__all__ = ["BatchRows"]
