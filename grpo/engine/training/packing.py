"""Sequence packing: a finished step's sequences laid end to end in fixed-length bins, so
every pass over the batch (the update, the old-log-prob, reference and behaviour passes)
pays for real tokens rather than for ``prompt + max_new_tokens`` per row.

Two halves, so the plan is deterministic and cheap and the data never leaves the devices:

* :func:`plan_packing` (host, numpy): the rows' lengths -> a :class:`PackPlan`, first-fit
  decreasing into bins of ``bin_length`` tokens (a sequence is never split; its tokens are
  contiguous; ties broken by row index, so every process computes the same plan from the
  same lengths), optionally rounded up to a multiple of ``unit`` (:func:`round_bins`; the
  flat [bins, L] layout the loss tests and fixtures use).
* :func:`micro_schedule` (host): the step's micro-batches. A run's update does not round
  the bins to a fixed multiple: each step takes the micro-batch count ``m`` and bins per
  device per micro-batch ``per`` whose ``m x devices x per`` is the smallest at least the
  bins used, ``per`` within the memory the configured micro-batch holds
  (:func:`max_bins_per_device`), ties to fewer micro-batches. :func:`schedule_packing`
  lays the bins out micro-batch major, ``[m_cap, devices x per, L]``, ``m_cap`` the most
  micro-batches a step of ``per`` can need; the update loops over the first ``m`` only (a
  loop with a traced trip count), so each pass compiles once per ``per``:
  :func:`schedule_shapes` is the compile bound.
* :func:`pack_batch` / :func:`unpack_logprobs` (jittable, jnp): the padded update batch ->
  the packed one by a gather with the plan's indices, and the packed per-token log-probs
  back to the row layout [B, N] by the inverse scatter (either layout: the token axis is
  the last).

Layout (the packing contract shared with the losses): ``segment_ids`` [bins, L] int32 are
1, 2, ... in bin order for the sequences of a bin, 0 for bin padding; ``positions`` restart
at 0 at each sequence's first token (RoPE sees exactly what the padded row gave it);
``hidden[:, t]`` predicts ``targets[:, t]`` (the next token of the same sequence), and
every per-token array (mask, advantages, old/ref/sampler log-probs) sits at the
predicting slot, as in the padded layout.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


# --------------------------------------------------------------------------- host: the plan


def first_fit_decreasing(lengths: np.ndarray, *, bin_length: int) -> list[list[int]]:
    """Row indices of each bin, first-fit decreasing: rows in order of decreasing length
    (ties by row index: deterministic), each into the first bin with room.

    The classic bound holds: bins <= 11/9 OPT + 6/9 (Dosa 2007). Raises ValueError for a
    length over ``bin_length`` (config validation makes that impossible in a run)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and int(lengths.max()) > bin_length:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit a bin of {bin_length}")
    order = sorted(range(lengths.size), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        if n == 0:
            continue  # nothing to compute for an empty row (never happens: prompts are non-empty)
        for b, r in enumerate(room):
            if r >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(bin_length - n)
    return bins


def round_bins(bins: int, *, unit: int) -> int:
    """The compiled bin count for ``bins`` used ones: the next multiple of ``unit`` (at
    least one ``unit``)."""
    return max(1, math.ceil(bins / unit)) * unit


def bin_count_sizes(*, rows: int, unit: int) -> tuple[int, ...]:
    """Every bin count a step of ``rows`` sequences can compile to: the multiples of
    ``unit`` up to ``rows`` rounded up (first-fit never opens more bins than sequences,
    each sequence fitting one bin). Its length is the compile bound of each packed pass."""
    return tuple(unit * k for k in range(1, math.ceil(rows / unit) + 1))


def max_bins_per_device(*, micro_batch_size: int, devices: int, sequence_length: int, bin_length: int) -> int:
    """The most bins one device may hold in one micro-batch: no more tokens than the
    configured padded micro-batch gives it (``micro_batch_size / devices`` rows of
    ``sequence_length``), so a packed micro-batch never needs more activation memory than
    the padded one the config was sized for. At least one bin (a bin holds one sequence)."""
    return max(1, (micro_batch_size * sequence_length) // (devices * bin_length))


def micro_schedule(bins: int, *, devices: int, max_per: int) -> tuple[int, int]:
    """``(m, per)`` for a step that uses ``bins`` bins: ``m`` micro-batches of ``per`` bins
    per device, ``m x devices x per >= bins`` the smallest with ``1 <= per <= max_per``,
    ties to fewer micro-batches (each reads the weights once more). E.g. 56 bins on 8
    devices: 7 micro-batches of 1 bin a device (56), not 2 of 4 (64)."""
    need = max(1, math.ceil(bins / devices))  # bins per device
    best = None
    for per in range(1, max_per + 1):
        m = math.ceil(need / per)
        key = (m * per, m)
        if best is None or key < best[0]:
            best = (key, (m, per))
    return best[1]


def micro_capacity(*, rows: int, devices: int, per: int) -> int:
    """The most micro-batches a step of ``rows`` sequences scheduled at ``per`` bins per
    device can run (first-fit never opens more bins than sequences): the leading size of
    the bins' layout at ``per``, so a pass's shape depends on ``per`` alone."""
    return math.ceil(math.ceil(rows / devices) / per)


def schedule_shapes(*, rows: int, devices: int, max_per: int) -> dict[int, list[tuple[int, int]]]:
    """The schedule space: for every ``per`` a step of at most ``rows`` sequences can be
    scheduled at, the ``(m, per)`` pairs that use it. Each ``per`` is one compiled shape
    of each packed pass (its length is the compile bound)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for bins in range(1, rows + 1):
        m, per = micro_schedule(bins, devices=devices, max_per=max_per)
        if (m, per) not in out.setdefault(per, []):
            out[per].append((m, per))
    return out


class PackPlan(NamedTuple):
    """Where each bin slot's token comes from (host arrays, [bins, L] int32 each, or
    scheduled, [m_cap, devices x per, L]: micro-batch major).

    ``row``: the source row (0 on padding); ``index``: the token's index among its row's
    real tokens (its RoPE position; 0 on padding); ``segment_ids``: 1, 2, ... per bin, 0 on
    padding. ``used`` bins hold sequences, the rest (up to the rounded count) are padding.
    Scheduled: ``micro_batches`` (``m``) of ``per`` bins a device run; the micro-batches
    after the ``m``-th are layout only (never computed)."""

    row: np.ndarray
    index: np.ndarray
    segment_ids: np.ndarray
    used: int
    real_tokens: int
    micro_batches: int | None = None
    per: int | None = None

    @property
    def scheduled(self) -> bool:
        return self.micro_batches is not None

    @property
    def bins(self) -> int:
        """The bins computed: every bin of the layout, or the scheduled micro-batches'."""
        if self.scheduled:
            return self.micro_batches * self.row.shape[1]
        return self.row.shape[0]

    @property
    def bin_length(self) -> int:
        return self.row.shape[-1]

    @property
    def efficiency(self) -> float:
        """Real tokens / bin tokens of the computed bins."""
        return self.real_tokens / max(1, self.bins * self.bin_length)

    @property
    def positions(self) -> np.ndarray:
        return self.index


def plan_packing(lengths: np.ndarray, *, bin_length: int, unit: int = 1) -> PackPlan:
    """The packing of sequences of ``lengths`` [B] (prompt + completion real tokens) into
    bins of ``bin_length``, the bin count rounded up to a multiple of ``unit``."""
    lengths = np.asarray(lengths, np.int64)
    bins = first_fit_decreasing(lengths, bin_length=bin_length)
    n = round_bins(len(bins), unit=unit)
    row = np.zeros((n, bin_length), np.int32)
    index = np.zeros((n, bin_length), np.int32)
    seg = np.zeros((n, bin_length), np.int32)
    for b, members in enumerate(bins):
        start = 0
        for s, r in enumerate(members, start=1):
            ln = int(lengths[r])
            row[b, start : start + ln] = r
            index[b, start : start + ln] = np.arange(ln, dtype=np.int32)
            seg[b, start : start + ln] = s
            start += ln
    return PackPlan(row=row, index=index, segment_ids=seg, used=len(bins), real_tokens=int(lengths.sum()))


def schedule_packing(lengths: np.ndarray, *, bin_length: int, devices: int, max_per: int,
                     rows: int | None = None) -> PackPlan:
    """The packing of ``lengths`` [B] laid out for the step's micro-batch schedule
    (:func:`micro_schedule`): arrays [m_cap, devices x per, L], bin ``b`` of first-fit in
    micro-batch ``b // (devices x per)``. ``rows``: the most sequences a step has (the
    layout's capacity; default B). Each micro-batch's bins split evenly over the devices
    (a device's block of the bin axis), so taking micro-batch ``i`` moves no data."""
    flat = plan_packing(lengths, bin_length=bin_length)
    m, per = micro_schedule(flat.used, devices=devices, max_per=max_per)
    cap = micro_capacity(rows=rows or len(lengths), devices=devices, per=per)
    width = devices * per

    def lay(x: np.ndarray) -> np.ndarray:
        out = np.zeros((cap * width, bin_length), np.int32)
        out[: x.shape[0]] = x
        return out.reshape(cap, width, bin_length)  # m_cap (devices per) L

    return flat._replace(row=lay(flat.row), index=lay(flat.index), segment_ids=lay(flat.segment_ids),
                         micro_batches=m, per=per)


# --------------------------------------------------------------------------- device: the arrays


class PackedBatch(NamedTuple):
    """A step's batch packed into bins (every array [bins, L], global).

    ``mask`` is what the loss trains on (the model's own completion tokens, truncated rows
    zeroed with ``loss.mask_truncated``); ``trained`` the same before that zeroing (what
    the log-prob passes keep). Per-token arrays sit at the slot predicting their token."""

    tokens: jax.Array  # bins L
    positions: jax.Array  # bins L, restarting at 0 per sequence
    segment_ids: jax.Array  # bins L, 1.. per bin, 0 padding
    targets: jax.Array  # bins L, the next token of the same sequence (0 elsewhere)
    mask: jax.Array  # bins L
    trained: jax.Array  # bins L
    advantages: jax.Array | None  # bins L (per token, always)
    old_logprobs: jax.Array | None
    ref_logprobs: jax.Array | None
    sampler_logprobs: jax.Array | None = None
    dropout_keys: jax.Array | None = None  # bins L 2: each token's row's key
    # The loss's normaliser of the padded batch (valid tokens, sequences, or sequences x
    # max length): scalar, replicated; the update divides every micro-batch by it.
    normalizer: jax.Array | None = None
    # Scheduled layout (every array [m_cap, devices x per, L]): the micro-batches this step
    # runs, an int32 scalar (replicated; traced, so one compile serves every m at a per).
    micro_batches: jax.Array | None = None


class Placement(NamedTuple):
    """Where each slot's predicted token lives in the padded row layout (jnp, [bins, L])."""

    row: jax.Array  # source row
    target_col: jax.Array  # completion column j of the token this slot predicts (clipped)
    predicts: jax.Array  # bool: this slot predicts a completion token of its row


def real_order(kv_mask: jax.Array) -> jax.Array:
    """[B, S] -> [B, S] int32: the columns of each row's real tokens first, in order (a
    stable sort, so it holds for left-padded prompts and any completion mask)."""
    return jnp.argsort(jnp.logical_not(kv_mask.astype(bool)), axis=-1, stable=True).astype(jnp.int32)


def pack_batch(
    *, prompt_tokens, prompt_mask, tokens, mask, row, index, segment_ids,
    loss_mask=None, trained=None, advantages=None, old_logprobs=None, ref_logprobs=None,
    sampler_logprobs=None, dropout_keys=None,
) -> tuple[PackedBatch, Placement]:
    """The padded batch (``prompt_*`` [B, Lp], ``tokens``/``mask`` [B, N], per-token arrays
    [B, N], ``advantages`` [B] or [B, N], ``dropout_keys`` [B, 2]) gathered into bins by
    a plan's ``row``/``index``/``segment_ids`` [bins, L]. ``loss_mask``: the tokens the loss
    trains on [B, N] (default ``trained``, default ``mask``)."""
    lp, n = prompt_tokens.shape[1], tokens.shape[1]
    full = jnp.concatenate([prompt_tokens, tokens], axis=1)  # B S
    kv = jnp.concatenate([prompt_mask, mask], axis=1)  # B S
    order = real_order(kv)  # B S
    real = segment_ids > 0
    col = order[row, index]  # bins L
    # The next slot of the bin holds the next token of the same sequence iff same segment.
    nxt = jnp.concatenate([segment_ids[..., 1:], jnp.zeros_like(segment_ids[..., :1])], axis=-1)
    has_next = real & (nxt == segment_ids)
    ncol = order[row, jnp.minimum(index + 1, lp + n - 1)]
    predicts = has_next & (ncol >= lp)
    j = jnp.clip(ncol - lp, 0, n - 1)
    place = Placement(row=row, target_col=j, predicts=predicts)
    trained = mask if trained is None else trained
    loss_mask = trained if loss_mask is None else loss_mask

    def at_target(x):
        if x is None:
            return None
        x = jnp.asarray(x)
        return jnp.where(predicts, x[row, j], 0).astype(x.dtype)

    if advantages is not None:
        advantages = at_target(advantages) if advantages.ndim == 2 else jnp.where(real, advantages[row], 0.0)
    packed = PackedBatch(
        tokens=jnp.where(real, full[row, col], 0).astype(tokens.dtype),
        positions=jnp.where(real, index, 0).astype(jnp.int32),
        segment_ids=segment_ids.astype(jnp.int32),
        targets=jnp.where(has_next, full[row, ncol], 0).astype(tokens.dtype),
        mask=at_target(loss_mask),
        trained=at_target(trained),
        advantages=advantages,
        old_logprobs=at_target(old_logprobs),
        ref_logprobs=at_target(ref_logprobs),
        sampler_logprobs=at_target(sampler_logprobs),
        dropout_keys=None if dropout_keys is None else dropout_keys[row],
    )
    return packed, place


def unpack_logprobs(values: jax.Array, place: Placement, *, rows: int, length: int) -> jax.Array:
    """Packed per-token values [bins, L] -> the row layout [rows, length]: each completion
    token's value from the slot that predicts it, 0 where no slot does (padding)."""
    r = jnp.where(place.predicts, place.row, rows)  # out of range: dropped
    out = jnp.zeros((rows, length), values.dtype)
    return out.at[r, place.target_col].set(values, mode="drop")


def sequence_lengths(prompt_mask: jax.Array, mask: jax.Array) -> jax.Array:
    """[B] int32: each row's real tokens (prompt + completion, padding dropped)."""
    return (jnp.sum(prompt_mask.astype(jnp.int32), axis=1) + jnp.sum(mask.astype(jnp.int32), axis=1)).astype(jnp.int32)


def packing_stats(plan: PackPlan) -> dict[str, float]:
    """The step's packing metrics: efficiency (real / bin tokens), bin counts and, when
    scheduled, the micro-batches and bins per device per micro-batch."""
    out = {"packing/efficiency": plan.efficiency, "packing/bins": float(plan.bins), "packing/bins_used": float(plan.used)}
    if plan.scheduled:
        out.update({"packing/micro_batches": float(plan.micro_batches), "packing/bins_per_device": float(plan.per)})
    return out


__all__ = [
    "PackPlan",
    "PackedBatch",
    "Placement",
    "bin_count_sizes",
    "first_fit_decreasing",
    "max_bins_per_device",
    "micro_capacity",
    "micro_schedule",
    "pack_batch",
    "packing_stats",
    "plan_packing",
    "real_order",
    "round_bins",
    "schedule_packing",
    "schedule_shapes",
    "sequence_lengths",
    "unpack_logprobs",
]
