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
  loop with a traced trip count), so each pass compiles once per ``per`` and head width:
  :func:`schedule_shapes` and :func:`head_widths` are the compile bound.
* The head (:func:`head_width`, :func:`head_layout`): only the slots that predict a
  completion token reach the vocabulary head and the loss. Each device's bins of a
  micro-batch (``per`` bins, ``per x L`` slots) give one row of the loss's layout, their
  predicting slots in order, ``K`` wide: ``K`` is the step's most predicting slots of a
  device's micro-batch, rounded up to one of :data:`HEAD_BUCKETS` sizes (multiples of an
  eighth of ``per x L``), so each pass compiles at most :data:`HEAD_BUCKETS` times per
  ``per``. A padded row runs the head on its completion slots only; without this a bin
  would run it on its prompts too (a third to a half of its slots at the built-in profile).
* :func:`pack_batch` / :func:`unpack_logprobs` (jittable, jnp): the padded update batch ->
  the packed one by a gather with the plan's indices, and the packed per-token log-probs
  back to the row layout [B, N] by the inverse scatter (either layout: the token axis is
  the last).
* The update's pack programs (:func:`pack_program`, :func:`unpack_program`,
  :func:`lengths_program`): those functions jitted in the update's shardings, which the
  program builder (:mod:`grpo.engine.programs`) caches under the names ``grpo plan``
  lists; :func:`packing_active` decides whether a run packs at all.

Layout (the packing contract shared with the losses): ``segment_ids`` [bins, L] int32 are
1, 2, ... in bin order for the sequences of a bin, 0 for bin padding; ``positions`` restart
at 0 at each sequence's first token (RoPE sees exactly what the padded row gave it);
``hidden[:, t]`` predicts ``targets[:, t]`` (the next token of the same sequence), and
every per-token array (mask, advantages, old/ref/sampler log-probs) sits at the
predicting slot, as in the padded layout. The head layout (``head_index``,
``head_segments`` [.., R, K]) is a narrower packed layout of the same contract: row ``r``
holds the predicting slots of bins ``r x per .. (r + 1) x per - 1`` in order, its
sequences renumbered 1, 2, ... (so every per-sequence reduction of a loss is unchanged),
0 past its count.
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


def micro_schedule(bins: int, *, devices: int, max_per: int, pers: tuple[int, ...] | None = None) -> tuple[int, int]:
    """``(m, per)`` for a step that uses ``bins`` bins: ``m`` micro-batches of ``per`` bins
    per device, ``m x devices x per >= bins`` the smallest with ``1 <= per <= max_per``,
    ties to fewer micro-batches (each reads the weights once more). E.g. 56 bins on 8
    devices: 7 micro-batches of 1 bin a device (56), not 2 of 4 (64).

    ``pers`` (a coarse grid, :func:`per_grid`): that ``per`` rounded up to the grid's next
    width, and the micro-batches that width needs (never more than before; the padding
    bins are the price of fewer compiled shapes)."""
    need = max(1, math.ceil(bins / devices))  # bins per device
    best = None
    for per in range(1, max_per + 1):
        m = math.ceil(need / per)
        key = (m * per, m)
        if best is None or key < best[0]:
            best = (key, (m, per))
    m, per = best[1]
    if pers is None:
        return m, per
    per = min(p for p in pers if p >= per)
    return math.ceil(need / per), per


PER_GRIDS = ("exact", "pow2", "widest")
"""The bins-per-device grids a step's schedule picks ``per`` from
(``train.packing.bins_per_device``): every width up to the most a device holds
(``exact``: no bin computed beyond the step's need, a compile per width), powers of two
and the most (``pow2``), or the most only (``widest``: one compiled bin layout; a step
computes up to ``per - 1`` padding bins a device more than it needs)."""


def per_grid(max_per: int, grid: str = "exact") -> tuple[int, ...]:
    """The ``per`` values of ``grid`` (:data:`PER_GRIDS`) up to ``max_per``, ascending."""
    if grid == "exact":
        return tuple(range(1, max_per + 1))
    if grid == "pow2":
        return tuple(sorted({1 << i for i in range(max_per.bit_length()) if 1 << i <= max_per} | {max_per}))
    if grid == "widest":
        return (max_per,)
    raise ValueError(f"unknown bins-per-device grid {grid!r}: one of {', '.join(PER_GRIDS)}")


def micro_capacity(*, rows: int, devices: int, per: int) -> int:
    """The most micro-batches a step of ``rows`` sequences scheduled at ``per`` bins per
    device can run (first-fit never opens more bins than sequences): the leading size of
    the bins' layout at ``per``, so a pass's shape depends on ``per`` alone."""
    return math.ceil(math.ceil(rows / devices) / per)


def schedule_shapes(*, rows: int, devices: int, max_per: int,
                    pers: tuple[int, ...] | None = None) -> dict[int, list[tuple[int, int]]]:
    """The schedule space: for every ``per`` a step of at most ``rows`` sequences can be
    scheduled at, the ``(m, per)`` pairs that use it. Each ``per`` is one compiled bin
    layout of each packed pass, and each of its :func:`head_widths` one compile of it."""
    out: dict[int, list[tuple[int, int]]] = {}
    for bins in range(1, rows + 1):
        m, per = micro_schedule(bins, devices=devices, max_per=max_per, pers=pers)
        if (m, per) not in out.setdefault(per, []):
            out[per].append((m, per))
    return out


def shape_grid(packing: Any, *, max_per: int, cpu: bool) -> tuple[tuple[int, ...], int]:
    """``(pers, head_buckets)`` of a run's ``train.packing`` section: the bins-per-device
    widths (:func:`per_grid`) and head widths per width it compiles. ``auto``: one shape on
    CPU (``widest``, 1), where a compile costs more than the padding; ``pow2`` and 4 head
    widths elsewhere (12 shapes a pass on the v6e-8 recipe rather than 32: the same bins
    at its profile, 12% more head slots)."""
    grid = packing.bins_per_device if packing.bins_per_device != "auto" else ("widest" if cpu else "pow2")
    return per_grid(max_per, grid), packing.head_buckets or (1 if cpu else 4)


HEAD_BUCKETS = 8
"""The head widths a ``per`` can compile to by default (``train.packing.head_buckets``):
``K`` is a multiple of an eighth of ``per x L`` (rounded up to 8 slots, the TPU sublane
tile), at most ``per x L``."""


def head_width(count: int, *, slots: int, buckets: int = HEAD_BUCKETS) -> int:
    """The compiled head width ``K`` for a step whose fullest loss row (a device's bins of
    one micro-batch, ``slots`` = ``per x L``) has ``count`` predicting slots: ``count``
    rounded up to a multiple of ``slots / buckets`` (in 8s), capped at ``slots``."""
    unit = 8 * math.ceil(math.ceil(slots / buckets) / 8)
    return min(slots, unit * max(1, math.ceil(count / unit)))


def head_widths(*, slots: int, buckets: int = HEAD_BUCKETS) -> tuple[int, ...]:
    """Every :func:`head_width` of ``slots`` (its length: the compiles per ``per``)."""
    return tuple(sorted({head_width(c, slots=slots, buckets=buckets) for c in range(slots + 1)}))


def head_count(plan: "PackPlan", completions: np.ndarray) -> int:
    """The most predicting slots (completion tokens) one loss row of a scheduled ``plan``
    holds: the sum of ``completions`` [B] over the sequences of a device's bins of one
    micro-batch. A sequence predicts each of its completion tokens from the slot before
    it (its prompt is never empty), so its count is its completion length."""
    row, index, seg = (x.reshape(-1, x.shape[-1]) for x in (plan.row, plan.index, plan.segment_ids))
    starts = (seg > 0) & (index == 0)  # bins L: each sequence's first slot
    per_bin = np.zeros(row.shape[0], np.int64)
    np.add.at(per_bin, np.nonzero(starts)[0], np.asarray(completions, np.int64)[row[starts]])
    return int(per_bin.reshape(-1, plan.per).sum(axis=1).max()) if per_bin.size else 0


class PackPlan(NamedTuple):
    """Where each bin slot's token comes from (host arrays, [bins, L] int32 each, or
    scheduled, [m_cap, devices x per, L]: micro-batch major).

    ``row``: the source row (0 on padding); ``index``: the token's index among its row's
    real tokens (its RoPE position; 0 on padding); ``segment_ids``: 1, 2, ... per bin, 0 on
    padding. ``used`` bins hold sequences, the rest (up to the rounded count) are padding.
    Scheduled: ``micro_batches`` (``m``) of ``per`` bins a device run; the micro-batches
    after the ``m``-th are layout only (never computed); ``head``: the head width ``K``
    (:func:`head_width`; None: the head runs on every slot)."""

    row: np.ndarray
    index: np.ndarray
    segment_ids: np.ndarray
    used: int
    real_tokens: int
    micro_batches: int | None = None
    per: int | None = None
    head: int | None = None

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
                     rows: int | None = None, completions: np.ndarray | None = None,
                     pers: tuple[int, ...] | None = None, head_buckets: int = HEAD_BUCKETS) -> PackPlan:
    """The packing of ``lengths`` [B] laid out for the step's micro-batch schedule
    (:func:`micro_schedule`): arrays [m_cap, devices x per, L], bin ``b`` of first-fit in
    micro-batch ``b // (devices x per)``. ``rows``: the most sequences a step has (the
    layout's capacity; default B). Each micro-batch's bins split evenly over the devices
    (a device's block of the bin axis), so taking micro-batch ``i`` moves no data.

    ``completions`` [B] (each row's completion tokens): the bins are dealt to the step's
    loss rows (a device's ``per`` bins of a micro-batch) evenly by completion tokens
    (:func:`balance_bins`) rather than in first-fit order, and the plan's ``head`` is the
    head width of the fullest row (:func:`head_count`). ``pers`` and ``head_buckets``: the
    run's shape grid (:func:`per_grid`, :func:`head_width`)."""
    flat = plan_packing(lengths, bin_length=bin_length)
    m, per = micro_schedule(flat.used, devices=devices, max_per=max_per, pers=pers)
    cap = micro_capacity(rows=rows or len(lengths), devices=devices, per=per)
    width = devices * per
    where = np.arange(flat.used)
    if completions is not None:
        starts = (flat.segment_ids > 0) & (flat.index == 0)
        per_bin = np.zeros(flat.used, np.int64)
        np.add.at(per_bin, np.nonzero(starts)[0], np.asarray(completions, np.int64)[flat.row[starts]])
        where = balance_bins(per_bin, groups=m * devices, per=per)

    def lay(x: np.ndarray) -> np.ndarray:
        out = np.zeros((cap * width, bin_length), np.int32)
        out[where] = x
        return out.reshape(cap, width, bin_length)  # m_cap (devices per) L

    plan = flat._replace(row=lay(flat.row), index=lay(flat.index), segment_ids=lay(flat.segment_ids),
                         micro_batches=m, per=per)
    if completions is None:
        return plan
    return plan._replace(head=head_width(head_count(plan, completions), slots=per * bin_length, buckets=head_buckets))


def balance_bins(counts: np.ndarray, *, groups: int, per: int) -> np.ndarray:
    """Each bin's slot in a layout of ``groups`` groups of ``per`` bins (group ``g`` at slots
    ``g x per ..``): largest ``counts`` first, each into the group with the least so far
    that has room (ties: the lower group), a group's bins in first-fit order. The head
    width is the fullest group's count, so this keeps it near the mean rather than the
    first micro-batches holding the longest completions (first-fit order). Deterministic."""
    load = np.zeros(groups, np.int64)
    members: list[list[int]] = [[] for _ in range(groups)]
    for b in sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i)):
        g = min((g for g in range(groups) if len(members[g]) < per), key=lambda g: (load[g], g))
        members[g].append(b)
        load[g] += int(counts[b])
    where = np.zeros(len(counts), np.int64)
    for g, bins in enumerate(members):
        for k, b in enumerate(sorted(bins)):
            where[b] = g * per + k
    return where


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
    # The head layout (:func:`head_layout`, [.., R, K]): each loss row's predicting slots
    # (index into its ``per x L`` slots; ``per x L`` past its count) and their sequences
    # renumbered 1.. (0 past the count). None: the head runs on every slot.
    head_index: jax.Array | None = None
    head_segments: jax.Array | None = None
    # bins L layers k int16 (MoE, model.moe.router_replay on): the sampler's routed experts
    # of the token *in* each slot (not the one it predicts), -1 for prompt tokens and padding
    routed_experts: jax.Array | None = None


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
    sampler_logprobs=None, dropout_keys=None, head_rows: int | None = None, head: int | None = None,
    routed_experts=None,
) -> tuple[PackedBatch, Placement]:
    """The padded batch (``prompt_*`` [B, Lp], ``tokens``/``mask`` [B, N], per-token arrays
    [B, N], ``advantages`` [B] or [B, N], ``dropout_keys`` [B, 2]) gathered into bins by
    a plan's ``row``/``index``/``segment_ids`` [bins, L]; ``routed_experts`` [B, N, layers, k]
goes with the token in each slot. ``loss_mask``: the tokens the loss
    trains on [B, N] (default ``trained``, default ``mask``). ``head`` (static, with
    ``head_rows`` loss rows per micro-batch, the devices): the head layout of width ``head``
    (:func:`head_layout`; the plan's ``head``)."""
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
        routed_experts=None if routed_experts is None else jnp.where(
            (real & (col >= lp))[..., None, None], routed_experts[row, jnp.clip(col - lp, 0, n - 1)], -1
        ).astype(routed_experts.dtype),
    )
    if head is not None:
        index, segments = head_layout(predicts, segment_ids, rows=head_rows, width=head)
        packed = packed._replace(head_index=index, head_segments=segments)
    return packed, place


def head_layout(predicts: jax.Array, segment_ids: jax.Array, *, rows: int, width: int) -> tuple[jax.Array, jax.Array]:
    """The head layout of bins [.., W, L] (``predicts``: the slots that predict a completion
    token): ``W`` bins -> ``rows`` loss rows of ``W / rows`` consecutive bins (a device's
    block), each row's predicting slots in order (``index`` [.., rows, width] into the row's
    ``W / rows x L`` slots, that count past the row's slots: gathers fill, scatters drop)
    and their sequences renumbered 1, 2, ... in order (``segments``, 0 past the count).
    A row with more predicting slots than ``width`` loses the rest: ``width`` comes from
    the plan (:func:`head_count`), which counts them."""
    *lead, w, length = predicts.shape
    slots = (w // rows) * length
    p = predicts.reshape(*lead, rows, slots)
    # Each slot's sequence, unique in the row: bin-in-row x (L + 1) + segment id.
    key = (segment_ids.astype(jnp.int32) + (length + 1) * (jnp.arange(w, dtype=jnp.int32) % (w // rows))[:, None])
    key = key.reshape(*lead, rows, slots)
    order = jnp.argsort(jnp.logical_not(p), axis=-1, stable=True)[..., :width].astype(jnp.int32)  # .. R K
    valid = jnp.arange(width) < jnp.sum(p, axis=-1, keepdims=True)
    k = jnp.take_along_axis(key, order, axis=-1)
    first = jnp.concatenate([jnp.ones_like(k[..., :1], bool), k[..., 1:] != k[..., :-1]], axis=-1)
    segments = jnp.where(valid, jnp.cumsum(first & valid, axis=-1), 0).astype(jnp.int32)
    return jnp.where(valid, order, slots), segments


def to_head(x: jax.Array | None, index: jax.Array) -> jax.Array | None:
    """A bins array [W, L, ...] at the head layout's slots ``index`` [R, K]: [R, K, ...]
    (0 past each row's count)."""
    if x is None:
        return None
    r = index.shape[0]
    flat = x.reshape((r, -1) + x.shape[2:])  # R (W/R L) ...
    ix = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(flat, ix, axis=1, mode="fill", fill_value=0)


def from_head(values: jax.Array, index: jax.Array, *, bins: int, length: int) -> jax.Array:
    """Head-layout values [R, K] back to the bins [bins, length] (0 at the other slots)."""
    r = index.shape[0]
    out = jnp.zeros((r, (bins // r) * length), values.dtype)
    out = out.at[jnp.arange(r)[:, None], index].set(values, mode="drop")
    return out.reshape(bins, length)


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


# --------------------------------------------------------------------------- the update's pack programs


def packing_active(config: Any, plugins: dict[str, Any]) -> bool:
    """Whether the run packs: ``train.packing.enabled``, a loss plugin declaring
    ``supports_packing`` and an objective taking ``segment_ids`` (otherwise the run is
    unpacked, with a one-line warning)."""
    if not config.train.packing.enabled:
        return False
    loss = plugins["loss"].plugin
    if not getattr(loss, "supports_packing", False):
        import logging

        logging.getLogger(__name__).warning(
            "loss.impl=%s does not declare supports_packing: the update runs unpacked (padded rows)", config.loss.impl)
        return False
    from grpo.core.plugins import get_plugins

    objective = get_plugins().get("objective", config.loss.objective)
    if not objective.supports_packing:
        import logging

        logging.getLogger(__name__).warning(
            "loss.objective=%s has no segment_ids in per_token: the update runs unpacked (padded rows)",
            config.loss.objective)
        return False
    return True


def lengths_program(*, replicated: Any) -> Any:
    """The jitted ``(prompt_mask, mask) -> [B, 2]`` int32: each row's real tokens and its
    completion tokens (the pack plan's bins and head width), ``replicated``."""

    def lengths(prompt_mask, mask):
        return jnp.stack([sequence_lengths(prompt_mask, mask), jnp.sum(mask.astype(jnp.int32), axis=1)], axis=1)

    return jax.jit(lengths, out_shardings=replicated)


def pack_program(step: Any, *, bins_sharding: Any, rows_sharding: Any, replicated: Any, head_rows: int) -> Any:
    """The jitted ``(batch, row, index, segment_ids, head=None) -> (PackedBatch,
    Placement)`` of the update ``step`` (an :class:`~grpo.engine.training.update.UpdateStep`:
    its loss tokens and normaliser): :func:`pack_batch` with the packed arrays on
    ``bins_sharding`` (scheduled bins, 3-d indices) or ``rows_sharding`` (flat bins), the
    normaliser of the padded batch ``replicated``; ``head_rows``: the update's devices."""

    def pack(b, row, index, seg, head=None):
        rows = bins_sharding if row.ndim == 3 else rows_sharding
        packed, place = pack_batch(
            prompt_tokens=b.prompt_tokens, prompt_mask=b.prompt_mask, tokens=b.tokens, mask=b.mask,
            row=row, index=index, segment_ids=seg, loss_mask=step.loss_tokens(b), trained=b.trained,
            advantages=b.advantages, old_logprobs=b.old_logprobs, ref_logprobs=b.ref_logprobs,
            sampler_logprobs=b.sampler_logprobs, dropout_keys=b.dropout_keys,
            head_rows=head_rows, head=head, routed_experts=b.routed_experts,
        )
        on_rows = lambda x: None if x is None else jax.lax.with_sharding_constraint(x, rows)  # noqa: E731
        packed = jax.tree.map(on_rows, packed._replace(normalizer=None))
        norm = jax.lax.with_sharding_constraint(step.settings.normalizer(step.loss_tokens(b)), replicated)
        return packed._replace(normalizer=norm), jax.tree.map(on_rows, place)

    return jax.jit(pack, static_argnames=("head",))


def pack_arrays(program: Any, batch: Any, plan: PackPlan, *, replicated: Any) -> tuple[Any, Any]:
    """``(PackedBatch, Placement)`` of the padded ``batch`` (an UpdateBatch) laid out by
    ``plan``, through the jitted :func:`pack_program` ``program``: the plan's indices as
    ``replicated`` arrays (every process holds the whole plan), and a scheduled plan's
    micro-batch count."""
    idx = [jax.make_array_from_callback(a.shape, replicated, lambda i, a=a: a[i])
           for a in (plan.row, plan.index, plan.segment_ids)]
    packed, place = program(batch, *idx, head=plan.head)
    if plan.scheduled:
        m = jax.make_array_from_callback((), replicated, lambda i: np.asarray(plan.micro_batches, np.int32))
        packed = packed._replace(micro_batches=m)
    return packed, place


def unpack_program(*, out_sharding: Any) -> Any:
    """The jitted ``(values, place, rows, length) -> [rows, length]``
    (:func:`unpack_logprobs`; ``rows`` and ``length`` static) in ``out_sharding``."""

    def unpack(values, place, rows, length):
        return unpack_logprobs(values, place, rows=rows, length=length)

    return jax.jit(unpack, static_argnums=(2, 3), out_shardings=out_sharding)


__all__ = [
    "HEAD_BUCKETS",
    "PER_GRIDS",
    "PackPlan",
    "PackedBatch",
    "Placement",
    "balance_bins",
    "bin_count_sizes",
    "first_fit_decreasing",
    "from_head",
    "head_count",
    "head_layout",
    "head_width",
    "head_widths",
    "lengths_program",
    "max_bins_per_device",
    "micro_capacity",
    "micro_schedule",
    "pack_arrays",
    "pack_batch",
    "pack_program",
    "packing_active",
    "packing_stats",
    "per_grid",
    "plan_packing",
    "real_order",
    "round_bins",
    "schedule_packing",
    "schedule_shapes",
    "shape_grid",
    "sequence_lengths",
    "to_head",
    "unpack_logprobs",
    "unpack_program",
]
