"""``grpo bench reward``: how long scoring takes, and how much of it hides behind the decode.

A synthetic reward sleeps ``--sleep-ms`` per completion plus ``--call-ms`` per call (the
round trip of a verifier service or a sandbox), so the figures are the scoring machinery's
and the overlap's, not a particular reward's. Two sections, each the best of
``--repeats`` after one untimed run:

- ``scoring`` (no model): ``--batch`` completions in groups of ``--generations``, scored
  per completion (one call a completion, in series: how grpo scored before), per
  completion on ``--threads`` threads, batched per group and batched per step
  (:func:`grpo.batched_reward`): seconds and calls of each.
- ``overlap``: a model (``--preset``, random weights) rolls the rows out on the
  continuous engine, each row stopped at a length drawn from ``--lengths`` (as ``grpo
  bench rollout --lengths`` does), and the per-completion reward scores them: ``after``
  (the rollout, then every row scored) against ``overlap`` (each row's calls started on
  the reward pool as soon as it finishes, collected once the rollout is done:
  ``task.reward_scoring: overlap``, whose per-completion rewards start so; a batched one
  waits for its group). ``overlap_over_after`` is the ratio of their wall
  times; ``same_scores`` says both scored the same rows alike.

Compare ratios within one run; on a shared CPU, absolute times move with the load.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, ClassVar

import click
import numpy as np

from grpo.core.config.schema import OVERLAP_REWARD_THREADS
from grpo.core.contracts import NoOptions, TaskPlugin, batched_reward


class SleepTask(TaskPlugin):
    """A task whose one reward sleeps ``call_ms`` per call and ``sleep_ms`` per completion
    and scores a completion's length; ``per``: None (per completion), ``step`` or ``group``."""

    name: ClassVar[str] = "bench-sleep"
    Options = NoOptions

    def __init__(self, *, sleep_ms: float, call_ms: float, per: str | None):
        self.sleep_s, self.call_s, self.per = sleep_ms / 1e3, call_ms / 1e3, per

    def load(self, *, split, options, seed=0):
        return []

    def prompt_messages(self, example, *, options):
        return [{"role": "user", "content": str(example["prompt"])}]

    def reward_functions(self, *, options):
        sleep_s, call_s = self.sleep_s, self.call_s

        def length(completion, example):
            time.sleep(call_s + sleep_s)
            return min(len(completion), 64) / 64

        if self.per is None:
            return {"length": length}

        @batched_reward(per=self.per)
        def length_batched(completions, prompts, **columns):
            time.sleep(call_s + sleep_s * len(completions))
            return [min(len(c), 64) / 64 for c in completions]

        return {"length": length_batched}


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    fn()
    best, out = float("inf"), None
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def scoring_section(*, rows: int, k: int, sleep_ms: float, call_ms: float, threads: int, repeats: int
                    ) -> dict[str, Any]:
    """Per-completion (in series, on threads) and batched (per group, per step) scoring of
    the same ``rows`` completions."""
    from grpo.engine.rollout.scoring import RewardScorer

    examples = [{"prompt": f"p{i // k}"} for i in range(rows)]
    texts = [f"completion {i} " * (1 + i % 5) for i in range(rows)]
    modes = {"per_completion": (None, 1), "per_completion_threads": (None, threads),
             "batched_group": ("group", 1), "batched_step": ("step", 1)}
    out: dict[str, Any] = {}
    reference = None
    for mode, (per, n_threads) in modes.items():
        scorer = RewardScorer(SleepTask(sleep_ms=sleep_ms, call_ms=call_ms, per=per), NoOptions(), threads=n_threads,
                              group_size=k)
        seconds, scores = _best(lambda: scorer.score(examples, texts), repeats)
        calls = scorer.calls["length"] // (max(1, repeats) + 1)
        out[mode] = {"seconds": round(seconds, 4), "calls": calls, "threads": n_threads}
        reference = reference or scores.totals
        out[mode]["same_scores"] = scores.totals == reference
    return out


def overlap_section(*, preset: str, rows: int, k: int, prompt_len: int, new_tokens: int, lengths: str,
                    sleep_ms: float, threads: int, slots: int, chunk: int, seed: int, repeats: int) -> dict[str, Any]:
    """The continuous engine's rollout of ``rows`` rows, scored after it or overlapped."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from grpo.core.contracts.engine import Rows
    from grpo.engine.bench.engines import engine_config
    from grpo.engine.bench.rollout import _build, _random_prompts, bench_config
    from grpo.engine.planning.profiles import draw, load_profile, summary
    from grpo.engine.rollout.feeders import round_keys
    from grpo.engine.rollout.scoring import RewardScorer

    settings = dict(model_path=None, preset=preset, dtype="float32", batch=rows, generations=k, prompt_len=prompt_len,
                    new_tokens=new_tokens, early_stop=True, early_stop_chunk=16, kv_segment=0, style="legacy",
                    mesh_policy="auto", mesh_shape=None, temperature=1.0, top_k=0, top_p=1.0, seed=seed)
    config = engine_config(bench_config(**settings), "continuous", {"slots": slots, "chunk": chunk})
    built = _build(config, settings)
    sampler = built.programs.sampler()
    profile = load_profile(lengths)
    tokens, mask = _random_prompts(built.arch, built.eos, batch=rows, generations=k, prompt_len=prompt_len, seed=seed)
    _, stop_at = draw(profile, rows=rows, cap=new_tokens, prompt_length=prompt_len, seed=seed)
    key = jax.random.key(seed)
    examples = [{"prompt": f"p{i // k}"} for i in range(rows)]
    scorer = RewardScorer(SleepTask(sleep_ms=sleep_ms, call_ms=0.0, per=None), NoOptions(), threads=threads,
                          group_size=k, background=True)  # as task.reward_scoring: overlap builds it
    sampler.update_weights(built.state)
    params = sampler.weights

    def text(t: np.ndarray, m: np.ndarray) -> str:
        return " ".join(map(str, t[m > 0]))

    def rollout() -> Any:
        return jax.block_until_ready(sampler.generate(params, tokens, mask, key, stop_at=stop_at))

    def after() -> Any:
        out = jax.device_get(rollout())
        return scorer.score(examples, [text(t, m) for t, m in zip(out.tokens, out.mask)])

    def overlap() -> Any:
        sampler.update_weights(built.state)
        sampler.begin(rows=rows, prompt_length=prompt_len, key=round_keys(key, rows=rows, round_rows=rows),
                      stop_at=jax.device_put(stop_at.astype(np.int32), NamedSharding(sampler.mesh, PartitionSpec())))
        sampler.submit(Rows(ids=np.arange(rows), prompt_tokens=np.repeat(tokens, k, axis=0),
                            prompt_mask=np.repeat(mask, k, axis=0), keys=None))
        done: dict[int, str] = {}
        parts = []
        t0 = time.perf_counter()
        while True:
            progress = sampler.step()
            if progress.idle:
                break
            if progress.finished:  # as the run's overlapped scoring: each row's calls as soon as it ends
                ended = sorted(progress.finished)
                got = sampler.read(ended)
                done.update({r: text(t, m) for r, t, m in zip(ended, got.tokens, got.mask)})
                parts.append(scorer.start([examples[r] for r in ended], [done[r] for r in ended], rows=ended))
        sampler.end()
        # How far the scoring had got when the rollout was done.
        timeline["rollout_s"] = time.perf_counter() - t0
        timeline["rows_scored_by_then"] = sum(c.future.done() for p in parts for c in p.calls)
        return scorer.collect(parts)

    timeline: dict[str, float] = {}
    rollout_s, _ = _best(rollout, repeats)
    after_s, after_scores = _best(after, repeats)
    overlap_s, overlap_scores = _best(overlap, repeats)
    return {"lengths": summary(profile, cap=new_tokens, prompt_length=prompt_len), "preset": preset, "rows": rows,
            "generations": k, "new_tokens": new_tokens, "slots": slots, "chunk": chunk, "threads": threads,
            "valid_tokens": int(stop_at.sum()), "rollout_s": round(rollout_s, 4),
            "scoring_alone_s": round(rows * sleep_ms / 1e3 / threads, 4), "after_s": round(after_s, 4),
            "overlap_s": round(overlap_s, 4), "overlap_over_after": round(overlap_s / after_s, 3),
            "overlap_rollout_s": round(timeline["rollout_s"], 4),
            "overlap_rows_scored_by_rollout_end": timeline["rows_scored_by_then"],
            "same_scores": after_scores.totals == overlap_scores.totals}


@click.command("reward")
@click.option("--batch", type=click.IntRange(min=1), default=64, show_default=True, help="Completions scored (rows).")
@click.option("--generations", type=click.IntRange(min=1), default=4, show_default=True, help="Rows per group.")
@click.option("--sleep-ms", type=click.FloatRange(min=0), default=20.0, show_default=True,
              help="The synthetic reward's cost per completion.")
@click.option("--call-ms", type=click.FloatRange(min=0), default=20.0, show_default=True,
              help="Its cost per call (scoring section: what batching saves).")
@click.option("--threads", type=click.IntRange(min=1), default=OVERLAP_REWARD_THREADS, show_default=True,
              help="Calls of the reward at once (task.reward_threads; the default is what auto gives overlapped "
              "scoring).")
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True, help="Timed runs (best kept).")
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="Also time the rollout scored after it against overlapped (builds a model).")
@click.option("--preset", default="tiny", show_default=True, help="Model preset (random weights) for the rollout.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=32, show_default=True, help="Prompt tokens.")
@click.option("--new-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="The length cap.")
@click.option("--lengths", default="gsm8k-qwen25-3b-v6e8", show_default=True,
              help="Completion-length profile the rows stop at (built-in name or file; see grpo plan --lengths).")
@click.option("--slots", type=click.IntRange(min=0), default=16, show_default=True, help="Continuous-engine slots.")
@click.option("--chunk", type=click.IntRange(min=1), default=16, show_default=True, help="Decode steps a chunk.")
@click.option("--seed", type=int, default=0, show_default=True)
def bench_reward(batch, generations, sleep_ms, call_ms, threads, repeats, overlap, preset, prompt_len, new_tokens,
                 lengths, slots, chunk, seed) -> None:
    """Time reward scoring on the host: per completion, batched, and overlapped with the
    continuous engine's decode (JSON)."""
    from grpo.core.errors import UserError

    if batch % generations:
        raise UserError(f"--batch {batch} must be a multiple of --generations {generations}.")
    result: dict[str, Any] = {"sleep_ms": sleep_ms, "call_ms": call_ms, "batch": batch, "generations": generations,
                              "scoring": scoring_section(rows=batch, k=generations, sleep_ms=sleep_ms, call_ms=call_ms,
                                                         threads=max(threads, 4) if threads == 1 else threads,
                                                         repeats=repeats)}
    if overlap:
        result["overlap"] = overlap_section(preset=preset, rows=batch, k=generations, prompt_len=prompt_len,
                                            new_tokens=new_tokens, lengths=lengths, sleep_ms=sleep_ms, threads=threads,
                                            slots=slots, chunk=chunk, seed=seed, repeats=repeats)
    click.echo(json.dumps(result, indent=2))


__all__ = ["SleepTask", "bench_reward", "overlap_section", "scoring_section"]
