"""``grpo bench rollout --lengths PROFILE``: the static and the continuous rollout engines
on the same rows, each row stopped at a completion length drawn from the profile.

Random weights almost never draw a stop token, so a plain rollout bench decodes every
row to the cap: the static engine's worst case and nothing like a real step. Serving
benchmarks force each request's output length instead; here each row gets a length drawn
from the profile (:func:`grpo.engine.planning.profiles.draw`, seeded) and both samplers
are handed the same ``stop_at`` [rows] (a bench-only argument of their ``generate``): a
row stops once it holds that many tokens, exactly as if it had drawn a stop token there.
Both engines then sample the same rows (same keys, same tokens) and do the same useful
work, so their valid tokens/s compare the engines alone.

Each engine is run once untimed (compiles, and the continuous engine's admission-size
prefills), then ``repeats`` times; the fastest run is reported. Per engine:

- ``valid_tokens_per_s``: the rows' completion tokens (the drawn lengths: the samplers'
  stop token is set past the vocabulary, so no row stops early at random) over the rollout's wall time (prefill, decode and, for
  the continuous engine, its host scheduling at chunk boundaries); ``rollout_cpu_s`` and
  ``valid_tokens_per_cpu_s`` the same over the process's CPU seconds (every thread), and
  ``continuous_over_static_cpu`` their ratio: on a shared CPU machine the wall times of
  two rollouts run minutes apart measure the machine's load as much as the engines;
- ``slot_occupancy``: live-row decode steps over slot-steps run. Static: every row holds
  its slot until the longest row stops (``sum(lengths) / (rows * steps)``). Continuous:
  the steps live slots ran over ``slots * chunk * chunks``, and ``computed_occupancy``
  over the slot-steps its chunks computed (a chunk decodes only the live slots, padded to
  a power of two);
- ``kv_tokens``: the KV cache's token slots: the static cache's ``rows x (prompt + the
  decode's last segment)``, the continuous pool's peak (``peak_pages x page_size``; its
  ``pool_pages`` are what it reserves).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from grpo.core.errors import UserError

ENGINES = ("static", "continuous")


def engine_config(config: Any, engine: str, continuous: dict[str, Any]) -> Any:
    """``config`` with ``rollout.engine`` (and its continuous options) set; validated."""
    from grpo.core.config import load_config
    from grpo.core.errors import ConfigError

    raw = config.model_dump()
    raw["rollout"]["engine"] = engine
    raw["rollout"]["continuous"] = {**raw["rollout"]["continuous"], **continuous}
    try:
        return load_config(raw)
    except ConfigError as err:
        raise UserError("The bench's continuous-engine settings are not a valid rollout.continuous:",
                        problems=err.problems) from None


def run_engines_bench(*, config: Any, built: Any, params: Any, tokens: np.ndarray, mask: np.ndarray, lengths: str,
                      engines: tuple[str, ...], continuous: dict[str, Any], seed: int, repeats: int) -> dict[str, Any]:
    """Time each of ``engines`` on the same prompts, each row stopped at its drawn length."""
    import jax

    from grpo.engine.planning.profiles import draw, load_profile, summary
    from grpo.engine.programs import build_programs

    r = config.rollout
    rows, N, Lp = tokens.shape[0] * r.num_generations, r.max_new_tokens, tokens.shape[1]
    profile = load_profile(lengths)
    _, stop_at = draw(profile, rows=rows, cap=N, prompt_length=Lp, seed=seed)
    result: dict[str, Any] = {"lengths": summary(profile, cap=N, prompt_length=Lp), "rows": rows,
                              "drawn_tokens": int(stop_at.sum()), "engines": {}}
    outs = {}
    for engine in engines:
        cfg = engine_config(config, engine, continuous)
        # The stop token is an id past the vocabulary, never drawn: a row stops at its drawn
        # length alone (random weights would otherwise stop rows at random, far shorter
        # than the profile with a small vocabulary), yet the static engine still checks
        # "every row stopped?" each early_stop_chunk steps as with a real stop token.
        programs = build_programs(
            cfg, mesh=built.mesh, layout=built.layout, graphdef=built.graphdef, eos_ids=(built.arch.vocab_size,),
            pad_id=built.pad,
            arch=built.arch, topology=None, state=built.state,
        )
        sampler = programs.sampler()
        figures, outs[engine] = _time_engine(sampler, params, tokens, mask, stop_at, seed=seed, repeats=repeats)
        result["engines"][engine] = figures
    if "static" in outs and "continuous" in outs:
        a, b = outs["static"], outs["continuous"]
        result["same_tokens"] = bool(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))
        result["continuous_over_static"] = round(
            result["engines"]["continuous"]["valid_tokens_per_s"] / result["engines"]["static"]["valid_tokens_per_s"], 3)
        # The same by the process's CPU seconds: on a shared machine the wall time of two
        # rollouts run minutes apart also measures how busy the machine was meanwhile.
        result["continuous_over_static_cpu"] = round(
            result["engines"]["static"]["rollout_cpu_s"] / max(result["engines"]["continuous"]["rollout_cpu_s"], 1e-9), 3)
    del jax
    return result


def _time_engine(sampler: Any, params: Any, tokens: np.ndarray, mask: np.ndarray, stop_at: np.ndarray, *, seed: int,
                 repeats: int) -> tuple[dict[str, Any], tuple[np.ndarray, np.ndarray]]:
    """One untimed rollout, then the fastest of ``repeats``; the engine's figures and its
    (tokens, mask)."""
    import jax

    key = jax.random.key(seed)

    def once() -> tuple[float, float, Any]:
        t, c = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(sampler.generate(params, tokens, mask, key, stop_at=stop_at))
        return time.perf_counter() - t, time.process_time() - c, out

    first_s, _, out = once()
    runs = [once()[:2] for _ in range(max(1, repeats))]
    best, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
    lengths = np.asarray(out.lengths)
    valid = int(lengths.sum())
    figures: dict[str, Any] = {"first_call_s": round(first_s, 4), "rollout_s": round(best, 4),
                               "rollout_cpu_s": round(cpu, 4), "valid_tokens": valid,
                               "valid_tokens_per_s": round(valid / best, 2),
                               "valid_tokens_per_cpu_s": round(valid / max(cpu, 1e-9), 2)}
    stats = getattr(sampler, "last_stats", None)
    if stats:  # the continuous engine
        steps = stats["slots"] * stats["chunk"] * stats["chunks"]
        # Every row's first token comes from its prefill; the rest from decode steps.
        decoded = valid - len(lengths)
        figures.update({k: stats[k] for k in ("slots", "chunk", "chunks", "prefills", "evictions", "peak_pages",
                                              "pool_pages", "page_size")})
        figures["slot_occupancy"] = round(decoded / max(steps, 1), 4)
        if "slot_steps" in stats:  # the slots each chunk computed (live ones and their padding)
            figures["computed_occupancy"] = round(decoded / max(stats["slot_steps"], 1), 4)
        figures["kv_tokens"] = stats["peak_pages"] * stats["page_size"]
    else:
        steps = int(lengths.max())
        figures["decode_steps"] = steps
        figures["slot_occupancy"] = round(valid / (len(lengths) * max(steps, 1)), 4)
        figures["kv_tokens"] = len(lengths) * sampler.cache_slots(tokens.shape[1])
    return figures, (np.asarray(out.tokens), np.asarray(out.mask))


__all__ = ["ENGINES", "engine_config", "run_engines_bench"]
