"""The continuous rollout engine's section of a plan (``rollout.engine: continuous``).

Costs are counted per chip as everywhere in the plan (:mod:`grpo.engine.planning.costs`),
but at the schedule the engine runs rather than at the length cap:

- **Synchronous decode** (``--lengths``): one step's rows, drawn from the profile, run
  through the engine's own host scheduler
  (:meth:`~grpo.engine.rollout.continuous.ContinuousSampler.simulate`, with its trace).
  Each chunk decodes ``n`` slots (the live ones, padded part by part of the pool to a power
  of two, as the compiled variant does) for ``chunk`` steps; a step reads the chip's
  weights once and, per slot, the pages of its cached tokens (a slot that stopped in the
  chunk still attends over its pages; the page-table width caps what a slot reads). Each
  admission batch is one prefill of its rows padded to a power of two, its forward run once
  per distinct prompt (a group's samples admitted together share it). The slowest part of
  the pool sets a step's time. The static engine's figure at the same rows decodes every
  row until the longest stops, each step reading every row's whole cache segment.
- **Concurrent rows**: rows of the profile's lengths (prompt + completion, in whole
  pages) that the static cache's bytes hold as pages, against the static cache's rows.
- **Largest pool**: the rollout programs that hold the pool (start, prefill, decode)
  grow by the pool's bytes once (it is donated through prefill and decode); the largest
  ``pool_pages`` is the pool plus the least headroom of those programs, in pages.
- **Steady state** (rows run on across steps: partial rollouts): ``S`` slots are always
  live, each makes one token a step, so a step's tokens cost ``step(S) / S`` a token; a
  slot's cached length averages ``E[c (p + (c + 1) / 2)] / E[c]`` over a row's life
  (prompt ``p``, completion ``c``: a longer row is live for longer), plus half a page for
  page rounding; each row's prefill, amortised over its ``c`` tokens, comes on top.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import numpy as np

from grpo.engine.planning.costs import kv_bytes_per_slot, matmul_params
from grpo.engine.planning.quantized import config_roofs


@dataclasses.dataclass(frozen=True)
class ChipRoof:
    """One chip's costs of a rollout pass: ``seconds(rows, tokens)`` for ``rows`` rows
    attending over ``tokens`` cached tokens in all (decode), or of ``rows`` prompts
    (prefill: ``tokens`` unused, ``row_flops`` / ``row_bytes`` are per prompt)."""

    weight_bytes: float  # the chip's weights, read once per pass
    row_flops: float  # per row
    token_flops: float  # per attended cached token
    row_bytes: float  # per row (prefill: its prompt's keys and values written)
    token_bytes: float  # per attended cached token (keys and values read)
    peak: float  # FLOP/s
    bw: float  # HBM bytes/s
    ici_s: float = 0.0  # per pass (decode: the compiled decode's ICI per step)

    def seconds(self, rows: float, tokens: float) -> float:
        flops = rows * self.row_flops + tokens * self.token_flops
        nbytes = self.weight_bytes + rows * self.row_bytes + tokens * self.token_bytes
        return max(flops / self.peak, nbytes / self.bw, self.ici_s)

    def prefill_seconds(self, prompts: float, rows: float) -> float:
        """A prefill of ``rows`` rows whose prompts hold ``prompts`` distinct ones (the
        continuous engine's shared prompts: a group's samples admitted together run their
        prompt once): the forward's FLOPs per distinct prompt, every row's keys and values
        written into its own pages."""
        nbytes = self.weight_bytes + rows * self.row_bytes
        return max(prompts * self.row_flops / self.peak, nbytes / self.bw, self.ici_s)


def decode_roof(dims: Any, *, weight_bytes: float, itemsize: int, tp: int, kv_split: int, peak: float, bw: float,
                adapters: int = 0, ici_s: float = 0.0) -> ChipRoof:
    """A decode step on one chip (as :func:`~grpo.engine.planning.costs.decode_step_cost`):
    per row ``(2 (Wm + Na) + 2 D V) / tp`` FLOPs, per attended token ``4 H E Lyr / tp``
    FLOPs and its keys and values read."""
    d = dims
    return ChipRoof(
        weight_bytes=weight_bytes, row_flops=(2 * (matmul_params(d) + adapters) + 2 * d.hidden_size * d.vocab_size) / tp,
        token_flops=4 * d.num_attention_heads * d.head_dim * d.num_hidden_layers / tp, row_bytes=0.0,
        token_bytes=kv_bytes_per_slot(d, itemsize=itemsize, kv_split=kv_split), peak=peak, bw=bw, ici_s=ici_s)


def prefill_roof(dims: Any, *, prompt_length: int, weight_bytes: float, itemsize: int, tp: int, kv_split: int,
                 peak: float, bw: float, adapters: int = 0) -> ChipRoof:
    """A prefill of prompts of ``prompt_length`` tokens on one chip (as the plan's
    ``prefill``): per prompt ``Lp 2 (Wm + Na) + 4 Lp^2 H E Lyr + 2 D V`` FLOPs over ``tp``,
    its keys and values written."""
    d, Lp = dims, prompt_length
    flops = (Lp * 2 * (matmul_params(d) + adapters) + 4 * Lp * Lp * d.num_attention_heads * d.head_dim
             * d.num_hidden_layers + 2 * d.hidden_size * d.vocab_size) / tp
    return ChipRoof(weight_bytes=weight_bytes, row_flops=flops, token_flops=0.0,
                    row_bytes=Lp * kv_bytes_per_slot(d, itemsize=itemsize, kv_split=kv_split), token_bytes=0.0,
                    peak=peak, bw=bw)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def schedule_seconds(*, trace: list[dict[str, Any]], decode: ChipRoof, prefill: ChipRoof, chunk: int, page_size: int,
                     shards: int, slots: int) -> dict[str, float]:
    """Roofline seconds of a simulated schedule (``simulate(trace=...)``): each chunk's
    ``chunk`` steps at its ``n`` slots per part of the pool, a step as slow as its slowest
    part; each prefill batch padded to a power of two (at most ``slots``) over the parts,
    its forward run once per distinct prompt (the entry's ``prompts``, padded to a power of
    two, at most the rows; absent: one per row)."""
    dec = pre = 0.0
    steps = 0
    t = np.arange(chunk)[:, None, None]  # C 1 1
    for e in trace:
        if "prefill" in e:
            rows = min(_pow2(e["prefill"]), slots)
            prompts = min(_pow2(e.get("prompts", e["prefill"])), rows)
            pre += prefill.prefill_seconds(math.ceil(prompts / shards), math.ceil(rows / shards))
            continue
        n = len(e["idx"]) // shards
        L0 = np.asarray(e["lengths"], np.int64).reshape(shards, n)[None]  # 1 shards n
        adv = np.asarray(e["advance"], np.int64).reshape(shards, n)[None]
        # Step t feeds the slot's token at its length and attends over length + 1 tokens,
        # in whole pages, at most the table's width.
        cached = L0 + np.minimum(t, adv) + 1  # C shards n
        tokens = np.minimum(-(-cached // page_size), e["width"]) * page_size
        per_part = tokens.sum(axis=2)  # C shards
        dec += sum(max(decode.seconds(n, float(x)) for x in row) for row in per_part)
        steps += chunk
    return {"decode_s": dec, "prefill_s": pre, "decode_steps": steps}


def static_decode_seconds(*, segments: tuple[tuple[int, int], ...], steps: int, rows_per_chip: float,
                          prompt_length: int, decode: ChipRoof) -> float:
    """The static engine's decode until its longest row stops (``steps``): every row of the
    chip decodes, each step reading the whole cache segment ``Lp + b`` of the
    ``segments`` ``(a, b)`` it falls in."""
    total = 0.0
    for a, b in segments:
        n = max(0, min(b, steps) - a)
        total += n * decode.seconds(rows_per_chip, rows_per_chip * (prompt_length + b))
    return total


def pool_rows(*, cache_bytes: float, page_bytes: float, page_size: int, prompts: np.ndarray,
              completions: np.ndarray, shards: int) -> float:
    """Rows of the profile's lengths (prompt + completion, in whole pages) that
    ``cache_bytes`` per chip hold as pages of ``page_bytes``, over ``shards`` parts."""
    pages = math.floor(cache_bytes / page_bytes)
    per_row = float(np.mean(-(-(np.asarray(prompts) + np.asarray(completions)) // page_size)))
    return shards * pages / per_row


def mean_live_tokens(*, prompts: np.ndarray, completions: np.ndarray, page_size: int) -> float:
    """A live slot's cached tokens, averaged over time: ``E[c (p + (c + 1) / 2)] / E[c]``
    plus half a page (a step reads whole pages)."""
    p, c = np.asarray(prompts, np.float64), np.asarray(completions, np.float64)
    return float(np.sum(c * (p + (c + 1) / 2)) / np.sum(c)) + (page_size - 1) / 2


def steady_state(*, slots: int, shards: int, decode: ChipRoof, prefill: ChipRoof, prompts: np.ndarray,
                 completions: np.ndarray, page_size: int, prefill_rows: float,
                 prefill_prompts: float | None = None) -> dict[str, float]:
    """Partial rollouts: ``slots`` always live (``slots / shards`` a part), one token each a
    step; each row prefilled once in batches of ``prefill_rows`` a chip holding
    ``prefill_prompts`` distinct prompts (None: one per row). Seconds per valid token and
    valid tokens/s over the whole rollout mesh."""
    n = slots / shards
    live = mean_live_tokens(prompts=prompts, completions=completions, page_size=page_size)
    step = decode.seconds(n, n * live)
    mean_c = float(np.mean(completions))
    shared = prefill_rows if prefill_prompts is None else prefill_prompts
    pre_row = prefill.prefill_seconds(shared, prefill_rows) / prefill_rows
    per_token_part = step / n + pre_row / mean_c  # one part's seconds per valid token
    return {"slots": slots, "step_s": step, "mean_live_tokens": live, "decode_s_per_valid_token": step / slots,
            "prefill_s_per_valid_token": pre_row / mean_c / shards, "s_per_valid_token": per_token_part / shards,
            "valid_tokens_per_s": shards / per_token_part, "pool_pages_per_part": n * live / page_size}


def largest_pool(*, hbm: int, pool_bytes: int, pool_pages: int, peaks: list[int]) -> dict[str, int]:
    """The most pages per chip the pool can have while every program holding it (peaks:
    their peak bytes with the pool of ``pool_pages`` pages, ``pool_bytes``) fits ``hbm``."""
    page = pool_bytes / pool_pages
    room = min(hbm - p for p in peaks)
    pages = int((pool_bytes + room) // page)
    return {"pool_pages": max(pages, 0), "pool_bytes": int(max(pages, 0) * page), "page_bytes": int(page)}


POOL_PROGRAMS = ("start", "prefill", "decode")  # the step's programs that hold the page pool


def _simulate(engine: Any, *, groups: np.ndarray, **kwargs: Any) -> dict[str, Any]:
    """``engine.simulate(**kwargs)``, with each row's prompt ``groups`` where the engine
    takes them (an engine of another package may implement the contract's older form)."""
    shared = {"groups": groups} if "groups" in inspect.signature(engine.simulate).parameters else {}
    return engine.simulate(**kwargs, **shared)


def engine_section(s: Any, lengths: Any, *, chip: Any, hbm: int, entries: dict[str, Any],
                   rollout_weight_bytes: float | None) -> dict[str, Any]:
    """The continuous engine's section of a plan (subject ``s``, a
    :class:`~grpo.engine.planning.plan.Subject`): its page pool per device, the largest
    pool that fits, and under a length profile one step's rows (drawn with seed 0) through
    the engine's scheduler, costed (module docstring), beside the static engine's."""
    from grpo.engine.planning.costs import rollout_figures
    from grpo.engine.planning.profiles import draw
    from grpo.engine.rollout.decoding import effective_chunk

    config, sampler = s.config, s.sampler
    P, Lp = s.inputs["prompt_tokens"].shape
    rows, N = P * config.rollout.num_generations, config.rollout.max_new_tokens
    S = sampler.slots_for(rows, Lp)
    shards = sampler.shards(S)
    pool_pages = sampler.pool_size(Lp, S // shards)  # per part of the pool (per device)
    out: dict[str, Any] = {"engine": config.rollout.engine, "pool_bytes_per_device": s.state["kv_cache"],
                           "slots": S, "page_size": sampler.page_size, "pool_pages_per_device": pool_pages}
    peaks = [entries[n]["peak_bytes"] for n in POOL_PROGRAMS if entries.get(n, {}).get("peak_bytes") is not None]
    if peaks:
        out["largest_pool"] = largest_pool(hbm=hbm, pool_bytes=s.state["kv_cache"], pool_pages=pool_pages,
                                           peaks=peaks)
    if lengths is None:
        return out
    f = rollout_figures(s.programs, s.arch, chip, rollout_weight_bytes=rollout_weight_bytes)
    common = {k: f[k] for k in ("weight_bytes", "itemsize", "tp", "kv_split", "peak", "bw", "adapters")}
    ici = entries.get("decode", {}).get("ici_s_per_step") or 0.0
    base = decode_roof(s.arch, ici_s=ici, **common), prefill_roof(s.arch, prompt_length=Lp, **common)
    dec, pre = config_roofs(config, s.arch, *base, f)  # rollout.quantization's bytes
    prompts, completions = draw(lengths, rows=rows, cap=N, prompt_length=Lp, seed=0)
    groups = np.arange(rows) // config.rollout.num_generations  # rows prompt-major: a group shares its prompt

    def run(smp: Any, no_comm: bool = False, decode: Any = None, prefill: Any = None) -> dict[str, Any]:
        trace: list[dict[str, Any]] = []
        sim = _simulate(smp, prompt_lengths=prompts, completions=completions, prompt_length=Lp, trace=trace,
                        groups=groups)
        kw = dict(trace=trace, prefill=prefill or pre, chunk=sim["chunk"], page_size=smp.page_size,
                  shards=smp.shards(sim["slots"]), slots=sim["slots"])
        secs = schedule_seconds(decode=decode or dec, **kw)
        if no_comm:  # the same schedule without the decode's ICI (the plan's figure without communication)
            secs["decode_no_comm_s"] = schedule_seconds(decode=dataclasses.replace(dec, ici_s=0.0), **kw)["decode_s"]
        batches = [e["prefill"] for e in trace if "prefill" in e]
        shared = [e.get("prompts", e["prefill"]) for e in trace if "prefill" in e]
        return {**sim, **secs, "mean_prefill_rows": float(np.mean(batches)) if batches else 0.0,
                "mean_prefill_prompts": float(np.mean(shared)) if shared else 0.0}

    sim = run(sampler, no_comm=True)
    C = effective_chunk(N, config.rollout.early_stop_chunk)
    static_steps = -(-(int(completions.max()) - 1) // C) * C if C else N - 1
    static_s = static_decode_seconds(segments=sampler.plan(), steps=static_steps, rows_per_chip=rows / f["shards"],
                                     prompt_length=Lp, decode=dec)
    static_prefill = entries.get("prefill", {}).get("roofline_s")
    out.update({
        "valid_tokens": int(completions.sum()),
        "decode_steps": sim["decode_steps"], "slot_steps": sim["slot_steps"], "chunks": sim["chunks"],
        "prefills": sim["prefills"], "evictions": sim["evictions"], "peak_pages": sim["peak_pages"],
        "pool_pages": sim["pool_pages"],
        "peak_pool_bytes_per_device": s.state["kv_cache"] * sim["peak_pages"] // max(sim["pool_pages"], 1),
        "static_decode_steps": static_steps, "static_slot_steps": static_steps * rows,
        "decode_roofline_s": sim["decode_s"], "prefill_roofline_s": sim["prefill_s"],
        "decode_roofline_no_comm_s": sim["decode_no_comm_s"],
        "static_decode_roofline_s": static_s, "static_prefill_roofline_s": static_prefill,
        "decode_ratio": sim["decode_s"] / static_s if static_s else None,
        "rollout_ratio": (sim["decode_s"] + sim["prefill_s"]) / (static_s + static_prefill)
        if static_s and static_prefill else None,
    })
    # The static cache (every row at prompt + cap) against the pool in the same bytes.
    kv_tok = dec.token_bytes  # the static cache is in the compute dtype (base), the pool in its format
    static_bytes = rows / f["shards"] * (Lp + N) * base[0].token_bytes
    held = pool_rows(cache_bytes=static_bytes, page_bytes=sampler.page_size * kv_tok, page_size=sampler.page_size,
                     prompts=prompts, completions=completions, shards=f["shards"])
    out["concurrent_rows"] = {"static": rows, "static_cache_bytes_per_device": int(static_bytes), "pool": held,
                              "ratio": held / rows}
    big = out.get("largest_pool", {}).get("pool_pages", pool_pages)
    out.update(_slot_sweep(sampler, run, sim, rows=rows, shards=shards, big=big, static_s=static_s, dec=dec, pre=pre,
                           prompts=prompts, completions=completions))
    out["quantization"] = _variants(s.arch, base, f, lambda **kw: run(sampler, **kw), sampler, big, prompts,
                                    completions, static_bytes=static_bytes, shards=shards, sim=sim)
    return out


def _slot_sweep(sampler: Any, run: Any, sim: dict[str, Any], *, rows: int, shards: int, big: int,
                static_s: float | None, dec: Any, pre: Any, prompts: Any, completions: Any) -> dict[str, Any]:
    """Slots: the schedule (``run``) and the steady state at each power-of-two slot count
    the largest pool (``big`` pages a part) holds, the pool fixed at its largest (slots
    change only [slots] arrays): ``slots_sweep``, ``steady_state`` and ``steady_state_best``."""
    import copy

    sweep, steady = [], []
    for n in (shards << i for i in range(16)):
        if n > rows * 8:
            break
        smp = copy.copy(sampler)
        smp.slots, smp.pool_pages = n, big
        if n <= rows and smp.shards(n) == shards:
            r = run(smp)
            sweep.append({"slots": n, "decode_roofline_s": r["decode_s"], "prefill_roofline_s": r["prefill_s"],
                          "decode_ratio": r["decode_s"] / static_s if static_s else None,
                          "evictions": r["evictions"], "peak_pages": r["peak_pages"]})
        st = steady_state(slots=n, shards=shards, decode=dec, prefill=pre, prompts=prompts, completions=completions,
                          page_size=sampler.page_size, prefill_rows=max(sim["mean_prefill_rows"] / shards, 1.0),
                          prefill_prompts=max(sim["mean_prefill_prompts"] / shards, 1.0))
        st["fits_pool"] = bool(st["pool_pages_per_part"] + n / shards * math.ceil(sim["chunk"] / sampler.page_size)
                               <= big)
        steady.append(st)
    fit = [x for x in steady if x["fits_pool"]]
    return {"slots_sweep": sweep, "steady_state": steady,
            "steady_state_best": max(fit, key=lambda x: x["valid_tokens_per_s"]) if fit else None}


def _variants(dims: Any, base: tuple[Any, Any], f: dict[str, Any], run: Any, sampler: Any, big: int, prompts: Any,
              completions: Any, *, static_bytes: float, shards: int, sim: dict[str, Any]) -> dict[str, Any]:
    """The low-precision rollout's variants at this schedule
    (:func:`grpo.engine.planning.quantized.variants_section`): the page pool in the static
    cache's bytes, the steady state at the slot counts the pool holds in the same bytes."""
    from grpo.engine.planning.quantized import variants_section

    dec, pre = base
    ps = sampler.page_size

    def steady(decode: Any, prefill: Any) -> list[dict[str, Any]]:
        pages = big * dec.token_bytes / decode.token_bytes  # the same bytes in the variant's pages
        out = []
        for n in (shards << i for i in range(16)):
            if n > len(completions) * 8:
                break
            st = steady_state(slots=n, shards=shards, decode=decode, prefill=prefill, prompts=prompts,
                              completions=completions, page_size=ps,
                              prefill_rows=max(sim["mean_prefill_rows"] / shards, 1.0))
            st["fits_pool"] = bool(st["pool_pages_per_part"] + n / shards * math.ceil(sim["chunk"] / ps) <= pages)
            out.append(st)
        return out

    def rows(page_bytes: float) -> float:
        return pool_rows(cache_bytes=static_bytes, page_bytes=page_bytes, page_size=ps, prompts=prompts,
                         completions=completions, shards=f["shards"])

    return variants_section(dims, dec=dec, pre=pre, figures=f, run=run, static_rows_bytes=static_bytes,
                            page_size=ps, pool_rows=rows, steady=steady)


__all__ = ["POOL_PROGRAMS", "engine_section", "ChipRoof", "decode_roof", "largest_pool", "mean_live_tokens", "pool_rows", "prefill_roof",
           "schedule_seconds", "static_decode_seconds", "steady_state"]
