"""Partial rollouts (``train.async.partial_rollouts``): one continuous-batching stream
that lives across optimizer steps, so rows in flight at a weight change go on under the
new weights.

The stream (:class:`PartialStream`) keeps the engine's slots, page pool and in-flight
rows between steps; each call of :meth:`PartialStream.next_batch` decodes with the
weights the loop's weight sync last gave the engine (``update_weights``: the params are
an argument of the engine's programs, so a weight change is simply the next chunk
reading other params) until ``prompts_per_step`` groups
(all K rows) have finished, and stops at that chunk boundary. The rows still decoding keep
their slots and pages for the next call.

- **Batches.** A step's batch is the first ``prompts_per_step`` groups to finish (groups
  finishing at one chunk boundary: in data order), laid out in data order. Deterministic:
  the work between two weight changes is "until P more groups finish", never a time.
- **Feeding.** Prompts are fed in the data order (skipping those a resumed run already
  trained) so that the slots stay full, within the staleness budget: at policy version
  ``v`` the stream has fed at most ``(v + max_staleness + 1) * prompts_per_step`` groups
  in all. Were groups to finish in feed order, every group would then train at most
  ``max_staleness`` steps after its first token (AReaL bounds its rollouts' staleness
  the same way); with ``max_staleness = 0`` every batch is drawn to the end at one
  version, as the synchronous continuous run draws it.
- **Versions.** Every token records the policy version that drew it (``RolloutOutput.
  versions`` [B, N], -1 off the mask), kept on the host from the chunk boundaries: a
  row's tokens between two boundaries were drawn by the weights of that chunk.
- **Staleness** is measured on a row's *oldest* token: the update at step ``s`` refuses a
  group (exactly zero advantage, counted) when one of its rows holds a token drawn more
  than ``max_staleness`` versions before ``s``. The oldest token bounds how far the
  most off-policy part of the row is from the trained policy, and it is the version the
  row's prefix was conditioned on, so a row is never judged fresher than its start.
- **Correction.** The importance weights are already per token: the behaviour log-prob
  of each token is recorded by the sampler at the moment it is drawn, under the weights
  of that moment (``behaviour_logprobs``), so ``loss.mismatch``'s token weight
  ``exp(logp_current - logp_behaviour)`` compares each token with the very policy that
  drew it, and the sequence-level weight multiplies those per-token ratios (the
  behaviour probability of a mixed row is the product of its tokens' own). The version
  array serves the refusal and the logs (:func:`token_staleness`).
- **Nothing lost** (:class:`Ledger`): trained groups are not a prefix of the data order
  (they finish out of order), so the checkpoint holds the *frontier* (every data
  position below it trained: the trainer's ``data_position``) and the few positions
  above it already trained.
- **Nothing drawn twice** (:meth:`PartialStream.snapshot`): the same checkpoint step
  holds the stream: each row's tokens so far, behaviour log-probs and per-token
  versions, its key, its group and its place (slot and pages, or the queue), the
  finished rows of unfinished groups, the groups ready for a batch and the feed's
  position. A resumed stream puts every row back; the rows that were decoding rebuild
  their KV cache under the restored weights (the re-prefill of ``on_weight_change:
  reprefill``: the cache is rebuilt, not stored) and draw on from their next token
  (``async/resumed_inflight_rows``; ``async/regenerated_tokens`` counts tokens drawn a
  second time). Under ``reprefill`` the resumed run draws the very tokens the
  uninterrupted one does; under ``continue`` the rows in flight read a cache rebuilt
  under the new weights where the uninterrupted run's held the old ones, so their
  remaining tokens may differ (none is lost or drawn twice). An engine without
  ``snapshot`` re-feeds its rows in flight from the ledger's frontier instead.
- **Keys.** The prompt at data position ``p`` draws its row ``j`` from
  ``fold_in(fold_in(key(seed), p // P), (p % P) * K + j)``: the key the synchronous run's
  step ``p // P`` gives that row, so ``max_staleness = 0`` reproduces it.

Single-turn rows. Split by processes (:mod:`grpo.engine.loop.processes`) the stream
runs on every rollout process alike (the engine's host schedule reads every row, gathered
over the rollout side's processes; each process scores its own slice of a batch's
groups), and its snapshot crosses to the update side for the checkpoint.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import jax
import numpy as np

from grpo.core.errors import UserError
from grpo.core.contracts.engine import RolloutEngine, Rows
from grpo.engine.parallel.mesh import mesh_processes
from grpo.engine.rollout.decoding import row_keys
from grpo.engine.rollout.prompts import bucket_for, position_indices, process_slice
from grpo.engine.rollout.sampler import RolloutOutput
from grpo.engine.rollout.step import StepRollout

# ------------------------------------------------------------------ pure pieces


class Ledger:
    """Which data positions (groups) the update has trained: all below ``frontier``, and
    ``ahead`` above it. The checkpoint holds both; a resumed stream feeds from the
    frontier, skipping ``ahead``: no group lost, none trained twice."""

    def __init__(self, frontier: int = 0, ahead: Any = ()):
        self.frontier = int(frontier)
        self.ahead = {int(p) for p in ahead}

    def record(self, positions: Any) -> int:
        """Mark ``positions`` trained; returns the new frontier. A position trained twice
        is a bug, not a user error."""
        for p in (int(x) for x in positions):
            if p < self.frontier or p in self.ahead:
                raise RuntimeError(f"partial rollouts: data position {p} trained twice")
            self.ahead.add(p)
        while self.frontier in self.ahead:
            self.ahead.remove(self.frontier)
            self.frontier += 1
        return self.frontier

    def untrained(self):
        """The data positions not yet trained now, ascending (an endless iterator over a
        snapshot: the ledger may move on while the stream reads it)."""
        p, ahead = self.frontier, set(self.ahead)
        while True:
            if p not in ahead:
                yield p
            p += 1


def token_staleness(*, step: int, versions: np.ndarray) -> dict[str, float]:
    """Per-token staleness figures of a batch trained at ``step`` from its token versions
    ([B, N], -1 off the mask): the mean and max over the valid tokens, the fraction at
    each staleness (``async/token_staleness_hist/k``), the fraction drawn under a version
    older than their row's last token (``async/older_version_token_frac``: the part of
    rows that crossed a weight change before it) and the rows drawn under more than one
    version (``async/crossed_rows``)."""
    valid = versions >= 0  # B N
    stale = (step - versions)[valid]
    newest = versions.max(axis=1, initial=-1)  # B
    oldest = np.where(valid, versions, np.iinfo(np.int64).max).min(axis=1)  # B
    n = max(int(valid.sum()), 1)
    out = {
        "async/token_staleness_mean": float(stale.mean()) if stale.size else 0.0,
        "async/token_staleness_max": int(stale.max()) if stale.size else 0,
        "async/older_version_token_frac": float((valid & (versions < newest[:, None])).sum() / n),
        "async/crossed_rows": int(((oldest < newest) & valid.any(axis=1)).sum()),
    }
    for k, c in zip(*np.unique(stale, return_counts=True)):
        out[f"async/token_staleness_hist/{int(k)}"] = float(c / n)
    return out


def oldest_versions(versions: np.ndarray) -> np.ndarray:
    """Each row's oldest token version [B] (what the staleness refusal reads)."""
    valid = versions >= 0
    return np.where(valid.any(axis=1), np.where(valid, versions, np.iinfo(np.int64).max).min(axis=1), -1)


# ------------------------------------------------------------------ the stream


class PartialStream:
    """The persistent stream of a run (see the module docstring). ``collector``: the
    run's :class:`~grpo.engine.rollout.step.StepCollector` on the rollout mesh (sampler,
    prompts, scoring); ``ledger``: what the update has trained (read once, here);
    ``version``: the policy version of the first call; ``saved``: a checkpoint's
    :meth:`snapshot` (meta, arrays) to go on from."""

    def __init__(self, collector: Any, *, max_staleness: int, ledger: Ledger, version: int,
                 saved: tuple[dict, dict] | None = None):
        cfg = collector.config
        self.c, self.engine = collector, collector.sampler
        self.P, self.K, self.N = cfg.train.prompts_per_step, cfg.rollout.num_generations, cfg.rollout.max_new_tokens
        self.seed, self.m = cfg.train.seed, max_staleness
        self.rows = (max_staleness + 1) * self.P * self.K  # outstanding rows never exceed it
        self.width = bucket_for(max(len(t) for t in collector.prompts.token_ids), collector.buckets)
        # The step's rows' slots (P*K, or the engine's count): the rows fed ahead wait in its queue.
        self.engine.begin(rows=self.rows, prompt_length=self.width, versions=True,
                          slots=self.engine.slots_for(self.P * self.K, self.width),
                          on_weight_change=cfg.train.async_.on_weight_change)
        self.prompts = np.zeros((self.rows, self.width), np.int32)  # each buffer row's prompt (left-padded)
        self.prompt_masks = np.zeros((self.rows, self.width), np.int32)
        self.free = collections.deque(range(self.rows))
        self.todo = ledger.untrained()
        self.fed = version * self.P  # groups counted against the staleness budget
        self.groups: dict[int, dict] = {}  # data position -> {rows, width, done: {row: host arrays}}
        self.row_group: dict[int, int] = {}  # buffer row -> the data position of its group
        self.ready: list[int] = []  # finished groups not yet in a batch, in finish order
        self.widths: dict[int, int] = {}  # nominal step -> its prompts' bucket
        self.fed_log: list[int] = []  # data positions fed, in order (tests read it)
        self.last_fed = -1  # the last data position fed (in this life or before a resume)
        self.resumed_rows = 0  # rows put back from a checkpoint holding tokens (logged once)
        self.regenerated = 0  # tokens drawn a second time, already logged
        if saved is not None:
            self._restore(*saved, ledger=ledger)

    # ------------------------------------------------------------------ feeding

    def _row_width(self, position: int) -> int:
        """The bucket of the synchronous step ``position // P``'s prompts (what its prefill pads to)."""
        s = position // self.P
        if s not in self.widths:
            idx = position_indices(len(self.c.prompts), start=s * self.P, count=self.P, seed=self.seed)
            self.widths[s] = bucket_for(max(len(self.c.prompts.token_ids[i]) for i in idx), self.c.buckets)
        return self.widths[s]

    def _feed(self, version: int) -> None:
        """Queue the next groups of the data order while the staleness budget allows, each
        group's rows with the keys the synchronous run's step gives them: the prompt at
        data position ``p`` draws its row ``j`` from ``fold_in(fold_in(key(seed), p // P),
        (p % P) * K + j)``."""
        base = jax.random.key(self.seed)
        while self.fed < (version + self.m + 1) * self.P:
            p = next(self.todo)
            rows = [self.free.popleft() for _ in range(self.K)]
            ids = self.c.prompts.token_ids[position_indices(len(self.c.prompts), start=p, count=1, seed=self.seed)[0]]
            tokens = np.full((self.K, self.width), self.c.pad_id, np.int32)
            mask = np.zeros((self.K, self.width), np.int32)
            tokens[:, self.width - len(ids):], mask[:, self.width - len(ids):] = ids, 1
            for r in rows:
                self.row_group[r] = p
            self.prompts[rows], self.prompt_masks[rows] = tokens, mask
            self.groups[p] = {"rows": rows, "width": self._row_width(p), "done": {}}
            keys = row_keys(jax.random.fold_in(base, p // self.P), self.P * self.K)[
                (p % self.P) * self.K:(p % self.P + 1) * self.K]
            self.engine.submit(Rows(ids=np.asarray(rows), prompt_tokens=tokens, prompt_mask=mask, keys=keys,
                                    widths=np.full(self.K, self.groups[p]["width"])))
            self.fed += 1
            self.fed_log.append(p)
            self.last_fed = p

    # ------------------------------------------------------------------ the engine

    def _run_chunk(self) -> None:
        """One chunk of the engine under the weights of its last ``update_weights`` (the
        loop's weight sync: rows in flight go on under new weights), its finished rows
        handed to their groups (host copies)."""
        progress = self.engine.step()
        if progress.idle:
            raise RuntimeError("partial rollouts: nothing is queued or decoding, yet the batch is short")
        if progress.finished:
            ended = sorted(progress.finished)
            got = self.engine.read(ended)
            finished = set()
            for i, r in enumerate(ended):
                g = self.row_group[r]
                self.groups[g]["done"][r] = tuple(None if a is None else a[i].copy() for a in (
                    got.tokens, got.mask, got.logprobs, got.lengths, got.truncated, got.behaviour_logprobs)) + (
                    got.versions[i].copy(), None if got.routed_experts is None else got.routed_experts[i].copy())
                if len(self.groups[g]["done"]) == self.K:
                    finished.add(g)
            self.ready.extend(sorted(finished))  # one boundary's groups: in data order

    # ------------------------------------------------------------------ a batch

    def next_batch(self, *, step: int, version: int, sample_group: bool) -> tuple[StepRollout, np.ndarray, list[int]]:
        """Decode with the engine's weights (policy ``version``, synced to it) until
        ``prompts_per_step`` groups have finished; returns step ``step``'s rollout (rows
        in data order of their groups), its token versions [P*K, N] (host) and its
        groups' data positions."""
        t0 = time.perf_counter()
        while len(self.ready) < self.P:
            self._feed(version)
            self._run_chunk()
        picked, self.ready = sorted(self.ready[: self.P]), self.ready[self.P:]
        rollout, versions = self._rollout(picked, sample_group)
        for g in picked:
            for r in self.groups.pop(g)["rows"]:
                self.free.append(r)
                del self.row_group[r]
        in_flight = self.engine.in_flight()
        regenerated = self.engine.regenerated_tokens()
        rollout.metrics.update({"partial/in_flight_rows": in_flight, "partial/ready_groups": len(self.ready),
                                "async/resumed_inflight_rows": self.resumed_rows,
                                "async/regenerated_tokens": regenerated - self.regenerated})
        self.resumed_rows, self.regenerated = 0, regenerated
        rollout.rollout_s = time.perf_counter() - t0
        return rollout, versions, picked

    def _rollout(self, picked: list[int], sample_group: bool) -> tuple[StepRollout, np.ndarray]:
        """The picked groups' rows as a step's record (scored with the task's rewards)."""
        c, s, K = self.c, self.engine, self.K
        rows = [r for g in picked for r in self.groups[g]["rows"]]  # b*K + j: sample j of group b
        done = [self.groups[self.row_group[r]]["done"][r] for r in rows]
        tokens, mask, logprobs, out_len, truncated, behaviour, versions, routed = (
            None if d[0] is None else np.stack(d) for d in zip(*done))
        w = max(self.groups[g]["width"] for g in picked)

        def put(x, names, dtype):
            x = np.asarray(x, dtype)
            sharding = s.sharding(x.shape, names)
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        out = RolloutOutput(
            prompt_tokens=put(self.prompts[rows, -w:], ("batch", "length"), np.int32),
            prompt_mask=put(self.prompt_masks[rows, -w:], ("batch", "length"), np.int32),
            tokens=put(tokens, ("batch", "length"), np.int32), mask=put(mask, ("batch", "length"), np.int32),
            lengths=put(out_len, ("batch",), np.int32), truncated=put(truncated, ("batch",), bool),
            logprobs=put(logprobs, ("batch", "length"), np.float32),
            behaviour_logprobs=None if behaviour is None else put(behaviour, ("batch", "length"), np.float32),
            versions=put(versions, ("batch", "length"), np.int32),
            # each token's experts as the engine fed it, under the version that fed it
            routed_experts=None if routed is None else put(routed, ("batch", "length", None, None), np.int16),
        )
        # This process's groups are the ones it scores (over several rollout processes, its
        # slice of the batch: the rewards are made global from every process's own rows).
        local = process_slice(len(picked), *mesh_processes(c.programs.mesh))
        mine = slice(local.start * K, local.stop * K)
        examples = [c.prompts.examples[self._example(g)] for g in picked[local] for _ in range(K)]
        texts = list(s.detokenize(tokens[mine], mask[mine]))
        sample = None
        if sample_group:
            sample = (c.prompts.examples[self._example(picked[local][0])], int(self.prompt_masks[rows[mine][0]].sum()),
                      None)
        rollout = c.step_rollout(c.scored(out, examples=examples, texts=texts, lengths=mask[mine].sum(axis=1),
                                          seconds=0.0, sample=sample), drawn=len(picked))
        return rollout, versions

    # ------------------------------------------------------------------ checkpoint

    # A finished row's host arrays, in the order ``_run_chunk`` keeps them.
    DONE = ("tokens", "mask", "logprobs", "lengths", "truncated", "behaviour", "versions", "routed")

    def snapshot(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The stream between two batches as JSON and host arrays (see the module
        docstring): its groups (rows, bucket, finished rows' arrays), the groups ready,
        the free rows, the feed's position and budget, and the engine's session
        (:meth:`~grpo.core.contracts.engine.RolloutEngine.snapshot`; raises
        NotImplementedError for an engine that cannot)."""
        engine_meta, engine_arrays = self.engine.snapshot()
        done_rows = sorted(r for g in self.groups.values() for r in g["done"])
        arrays = {"prompts": self.prompts.copy(), "prompt_masks": self.prompt_masks.copy()}
        for i, name in enumerate(self.DONE):
            vals = [self.groups[self.row_group[r]]["done"][r][i] for r in done_rows]
            if vals and vals[0] is not None:
                arrays[f"done_{name}"] = np.stack(vals)
        arrays.update({f"engine_{k}": np.asarray(v) for k, v in engine_arrays.items()})
        meta = {"groups": [[int(p), [int(r) for r in g["rows"]], int(g["width"]), sorted(int(r) for r in g["done"])]
                           for p, g in self.groups.items()],
                "ready": [int(p) for p in self.ready], "free": [int(r) for r in self.free], "fed": int(self.fed),
                "last_fed": int(self.last_fed), "done_rows": [int(r) for r in done_rows], "engine": engine_meta}
        return meta, arrays

    def _restore(self, meta: dict[str, Any], arrays: dict[str, np.ndarray], *, ledger: Ledger) -> None:
        """:meth:`snapshot`'s stream back, in a stream just begun: the feed goes on after
        the last position fed (every untrained position at or before it is in the stream
        or in the loop's buffer)."""
        if arrays["prompts"].shape != self.prompts.shape:
            self._incompatible(f"{arrays['prompts'].shape[0]} rows of prompt width {arrays['prompts'].shape[1]}, this "
                               f"config's {self.prompts.shape[0]} of width {self.prompts.shape[1]}")
        self.prompts[:], self.prompt_masks[:] = arrays["prompts"], arrays["prompt_masks"]
        at = {r: i for i, r in enumerate(meta["done_rows"])}
        for p, rows, width, done in meta["groups"]:
            self.groups[p] = {"rows": rows, "width": width, "done": {
                r: tuple(arrays[f"done_{n}"][at[r]] if f"done_{n}" in arrays else None for n in self.DONE)
                for r in done}}
            self.row_group.update({r: p for r in rows})
        self.ready, self.free = list(meta["ready"]), collections.deque(meta["free"])
        self.fed, self.last_fed = int(meta["fed"]), int(meta["last_fed"])
        self.todo = (p for p in ledger.untrained() if p > self.last_fed)
        try:
            seated = self.engine.restore(meta["engine"], {k[len("engine_"):]: v for k, v in arrays.items()
                                                          if k.startswith("engine_")})
        except ValueError as err:  # the engine's session is another shape
            self._incompatible(str(err))
        self.regenerated = self.engine.regenerated_tokens()
        self.resumed_rows = seated + len(meta["done_rows"])

    @staticmethod
    def _incompatible(what: str) -> None:
        raise UserError(
            f"the checkpoint's partial-rollouts stream does not fit this config ({what}). To resume its rows in "
            "flight keep train.async.max_staleness, train.prompts_per_step, rollout.num_generations, "
            "rollout.max_prompt_length, rollout.max_new_tokens and rollout.continuous as they were saved.")

    def _example(self, position: int) -> int:
        return int(position_indices(len(self.c.prompts), start=position, count=1, seed=self.seed)[0])


class PartialRollouts:
    """The asynchronous pipeline's partial rollouts: the stream (rollout side, made at
    the first draw and again after a resume) and the ledger of trained groups (update
    side: only the main thread touches it)."""

    def __init__(self, collector: Any, *, max_staleness: int):
        sampler = collector.sampler
        if sampler.loss_mask or not sampler.streams:
            raise UserError(
                "train.async.partial_rollouts=true needs the single-turn continuous engine (rollout.engine: "
                f"continuous); this run's sampler is {type(sampler).__name__} (a task with tools rolls out "
                "multi-turn rows). Set train.async.partial_rollouts=false."
            )
        self.collector, self.max_staleness = collector, max_staleness
        self.ledger = Ledger()
        self.stream: PartialStream | None = None
        self.saved: tuple[dict, dict] | None = None  # a checkpoint's stream, put back at the next draw
        # Whether the engine can checkpoint its rows in flight (else a resume re-feeds them).
        self.keeps_rows = type(sampler).snapshot is not RolloutEngine.snapshot
        self.trained_log: list[list[int]] = []  # each trained batch's data positions (this process's life)

    def reset(self, *, frontier: int = 0, ahead: Any = (), saved: tuple[dict, dict] | None = None) -> None:
        """Start the ledger at a checkpoint's and the stream at its ``saved`` one
        (:meth:`PartialStream.snapshot`; None: in-flight rows are re-fed)."""
        self.stream, self.saved = None, saved
        self.ledger = Ledger(frontier, ahead)

    def snapshot(self) -> tuple[dict, dict] | None:
        """The stream for a checkpoint (None: no stream yet, or an engine that cannot)."""
        if self.stream is None:
            return self.saved  # nothing drawn since the resume
        return self.stream.snapshot() if self.keeps_rows else None

    def draw(self, *, step: int, version: int, sample_group: bool):
        """Step ``step``'s batch at policy ``version``, the weights the engine was last
        synced (:meth:`PartialStream.next_batch`)."""
        if self.stream is None:
            self.stream = PartialStream(self.collector, max_staleness=self.max_staleness, ledger=self.ledger,
                                        version=version, saved=self.saved)
            self.saved = None
        return self.stream.next_batch(step=step, version=version, sample_group=sample_group)

    def trained(self, positions: list[int]) -> int:
        """Record a trained batch's groups; returns the new frontier (the data position)."""
        self.trained_log.append(list(positions))
        return self.ledger.record(positions)

    def meta(self) -> dict[str, Any]:
        """What the checkpoint needs beside ``data_position`` (the frontier)."""
        return {"partial_trained_ahead": sorted(self.ledger.ahead)}


__all__ = ["Ledger", "PartialRollouts", "PartialStream", "oldest_versions", "token_staleness"]
