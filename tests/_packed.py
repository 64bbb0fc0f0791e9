"""Loss inputs in both layouts for the packing tests (tests/plugins/losses/test_packed_loss.py,
tests/engine/training/test_loss_call_packed.py): the same sequences padded (one row each,
completion slots [B, N]) and packed into bins by a first-fit-decreasing packer written here
in NumPy, independent of ``grpo.engine.training.packing``.

A sequence ``i`` is its ``prompt[i]`` tokens then its ``completion[i]`` tokens; packed, it
occupies ``prompt + completion`` contiguous slots of a bin, and the loss position of its
completion token ``j`` is ``offset + prompt - 1 + j`` (the slot that predicts it). Every
slot a padded row does not train (beyond its completion, environment tokens of a
multi-turn row, a truncated row) and every packed slot that is not a trained completion
token holds junk, so a loss that reads one of them is caught.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

D, V = 8, 32  # hidden size, vocabulary
PROMPT = np.array([3, 2, 4, 1, 2, 3, 2, 1])
COMPLETION = np.array([7, 3, 5, 8, 1, 6, 4, 2])
N = 8  # completion slots of a padded row
# Multi-turn rows: the environment's tokens inside the completion (attended to, never trained).
ENV = {0: (2, 3), 3: (3, 4)}
TRUNCATED = 2  # a row the loss drops whole (``loss.mask_truncated``)
TURNS = {0: 4, 3: 5}  # turn-level credit: the second turn of these rows starts at this slot


def ffd_pack(lengths, bin_length: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices per bin, in bin order (ties by index)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b in range(len(bins)):
            if lengths[i] <= room[b]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(bin_length - lengths[i])
    return bins


@dataclasses.dataclass
class Case:
    padded: dict  # loss kwargs, [B, N] (advantages [B]); numpy
    turn_advantages: np.ndarray  # B N: turn-level credit, padded
    packed: dict  # loss kwargs, [bins, L] + segment_ids; advantages per token (the row's)
    packed_turn_advantages: np.ndarray  # bins L
    bin_of: np.ndarray  # B N: the bin of padded slot (i, j); -1 if not a completion token
    pos_of: np.ndarray  # B N: its position in the bin


def build(*, rows: int = 8, bin_length: int = 16, bins: int | None = None, seed: int = 0,
          temperature: float = 0.7) -> Case:
    """The case for the first ``rows`` sequences, packed into bins of ``bin_length``
    (``bins``: pad the bin count up to this with empty bins)."""
    rng = np.random.default_rng(seed)
    p, c = PROMPT[:rows], COMPLETION[:rows]
    slot = np.arange(N)[None, :]
    valid = slot < c[:, None]  # B N completion tokens
    trained = valid.copy()
    for i, (lo, hi) in ENV.items():
        if i < rows:
            trained[i, lo:hi + 1] = False
    if TRUNCATED < rows:
        trained[TRUNCATED] = False

    hidden = rng.normal(size=(rows, N, D)).astype(np.float32)
    head = (rng.normal(size=(D, V)) * 2 / math.sqrt(D)).astype(np.float32)
    targets = rng.integers(0, V, (rows, N)).astype(np.int32)
    logits = np.einsum("bnd,dv->bnv", hidden, head) / temperature
    logits -= logits.max(-1, keepdims=True)
    logp = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), targets[..., None], -1)[..., 0]
    # Old, reference and sampler log-probs near the current ones: some ratios clip, some
    # sequence-level mismatch weights pass the cap.
    old = logp + 0.3 * rng.normal(size=logp.shape)
    ref = logp + 0.4 * rng.normal(size=logp.shape)
    sampler = old + 0.25 * rng.normal(size=logp.shape)
    adv = rng.normal(size=rows).astype(np.float32)
    turn = np.repeat(adv[:, None], N, 1)
    for i, start in TURNS.items():
        if i < rows:
            turn[i, start:] = rng.normal()
    junk = ~trained
    padded = dict(hidden=hidden, head_weight=head, targets=targets, mask=trained.astype(np.float32), advantages=adv,
                  old_logprobs=np.where(junk, 40.0, old), ref_logprobs=np.where(junk, -30.0, ref),
                  sampler_logprobs=np.where(junk, -50.0, sampler))
    padded = {k: np.asarray(v, np.float32) if v.dtype == np.float64 else v for k, v in padded.items()}
    turn = np.where(junk, 9.0, turn).astype(np.float32)

    layout = ffd_pack(list(p + c), bin_length)
    layout += [[] for _ in range((bins or len(layout)) - len(layout))]
    nb = len(layout)
    packed = dict(
        hidden=rng.normal(size=(nb, bin_length, D)).astype(np.float32), head_weight=head,
        targets=rng.integers(0, V, (nb, bin_length)).astype(np.int32), mask=np.zeros((nb, bin_length), np.float32),
        advantages=np.zeros((nb, bin_length), np.float32),
        old_logprobs=np.full((nb, bin_length), 40.0, np.float32), ref_logprobs=np.full((nb, bin_length), -30.0, np.float32),
        sampler_logprobs=np.full((nb, bin_length), -50.0, np.float32),
        segment_ids=np.zeros((nb, bin_length), np.int32),
    )
    packed_turn = np.zeros((nb, bin_length), np.float32)
    bin_of, pos_of = np.full((rows, N), -1), np.zeros((rows, N), int)
    for b, members in enumerate(layout):
        offset = 0
        for k, i in enumerate(members, 1):
            end = offset + p[i] + c[i]
            packed["segment_ids"][b, offset:end] = k
            packed["advantages"][b, offset:end] = adv[i]
            packed_turn[b, offset:end] = 7.0  # prompt slots: junk, never trained
            q = offset + p[i] - 1 + np.arange(c[i])  # loss positions of completion tokens 0..c-1
            bin_of[i, : c[i]], pos_of[i, : c[i]] = b, q
            for key in ("hidden", "targets", "mask", "old_logprobs", "ref_logprobs", "sampler_logprobs"):
                packed[key][b, q] = padded[key][i, : c[i]]
            packed_turn[b, q] = turn[i, : c[i]]
            offset = end
    return Case(padded=padded, turn_advantages=turn, packed=packed, packed_turn_advantages=packed_turn,
                bin_of=bin_of, pos_of=pos_of)


def unpack(case: Case, x: np.ndarray) -> np.ndarray:
    """A packed per-token array [bins, L, ...] in the padded layout [B, N, ...] (0 off the
    completion tokens)."""
    x = np.asarray(x)
    out = np.zeros(case.bin_of.shape + x.shape[2:], x.dtype)
    ok = case.bin_of >= 0
    out[ok] = x[case.bin_of[ok], case.pos_of[ok]]
    return out


def off_sequence(case: Case, x: np.ndarray) -> np.ndarray:
    """The entries of a packed per-token array [bins, L, ...] at slots no completion token
    of any sequence maps to."""
    keep = np.ones(np.asarray(x).shape[:2], bool)
    ok = case.bin_of >= 0
    keep[case.bin_of[ok], case.pos_of[ok]] = False
    return np.asarray(x)[keep]
