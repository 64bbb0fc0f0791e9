"""``grpo bench update``: the update padded against the update packed, in one run, on the
same rows.

The rows are drawn from a length profile (``--lengths``: a built-in name, a file of
lengths or a run's ``samples.jsonl``; :mod:`grpo.engine.planning.profiles`): each row a
prompt and a completion of the drawn lengths, random token ids, the prompt left-padded
to ``--prompt-len`` and the completion padded to ``--new-tokens`` as a rollout pads them.
Both updates are the program ``grpo run`` executes (:meth:`grpo.engine.programs.RunPrograms.update`),
from the same parameters: padded on the rows, packed on the bins the trainer packs them
into and the micro-batch schedule the trainer runs them in, on the finest shape grid
(``train.packing.bins_per_device: exact``, ``head_buckets: 8``)
(:meth:`~grpo.engine.programs.RunPrograms.pack_plan` and
:meth:`~grpo.engine.programs.RunPrograms.pack`, whose time is reported as ``pack_s``).

Prints one JSON object: ``padded_s`` and ``packed_s`` (the fastest of ``--iters`` timed
updates each way, after compiling and ``--warmup`` untimed ones; the two ways' timed
updates alternate, so a drift in the machine's load falls on both), ``pack_s`` (planning the bins
and gathering the batch into them), ``ratio`` = ``(pack_s + packed_s) / padded_s``
(``update_ratio`` without the packing), the process's CPU seconds of both timed updates
(``cpu_s``, ``cpu_ratio``: on a machine shared with other jobs, wall time includes waiting
for a core), XLA's exact count of each compiled update's work (``compiled``: flops, bytes
accessed, transcendentals; ``flops_ratio``, ``bytes_ratio``: packed / padded, no timer in
them), valid (trained) tokens per second each way, the bins, the micro-batch
schedule, the loss's head width (``head_width``: the slots predicting a completion
token, per device and micro-batch), their efficiency (real tokens / bin tokens), and both updates' losses (equal up
to float rounding: the same rows). Times mean something only relative to each other on CPU.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click
import numpy as np

from grpo.core.errors import UserError


def bench_config(*, preset: str, dtype: str, rows: int, generations: int, prompt_len: int, new_tokens: int,
                 micro_batch: int | None, loss: str, attention: str, seed: int) -> Any:
    """The run config whose update the bench times (validated like a config file)."""
    from grpo.core.config import load_config
    from grpo.core.errors import ConfigError

    raw = {
        "model": {"source": "random", "random": {"preset": preset}, "param_dtype": dtype, "compute_dtype": dtype,
                  "attention": attention},
        "rollout": {"num_generations": generations, "max_prompt_length": prompt_len, "prompt_buckets": [prompt_len],
                    "max_new_tokens": new_tokens},
        # The finest shape grid (every bins-per-device width, 8 head widths): what packing
        # saves before a coarse grid's padding (CPU runs compile one shape: the padded work).
        "train": {"prompts_per_step": rows // generations, "micro_batch_size": micro_batch, "seed": seed,
                  "packing": {"bins_per_device": "exact", "head_buckets": 8}},
        "loss": {"impl": loss},
        "task": {"name": "arithmetic"},
    }
    if rows % generations:
        raise UserError(f"--rows {rows} must be a multiple of --generations {generations}.")
    try:
        return load_config(raw)
    except ConfigError as err:
        raise UserError("The bench's settings do not make a valid run (--rows / --generations is "
                        "train.prompts_per_step, --micro-batch train.micro_batch_size):", problems=err.problems) from None


def synthetic_rows(*, prompts: np.ndarray, completions: np.ndarray, prompt_len: int, new_tokens: int, vocab: int,
                   seed: int) -> dict[str, np.ndarray]:
    """Rows of the drawn lengths: random tokens, prompts left-padded to ``prompt_len``,
    completions right-padded to ``new_tokens``, a random advantage per row."""
    rng = np.random.default_rng(seed)
    b = len(prompts)
    cols_p, cols_c = np.arange(prompt_len)[None, :], np.arange(new_tokens)[None, :]
    prompt_mask = (cols_p >= prompt_len - prompts[:, None]).astype(np.int32)  # left-padded
    mask = (cols_c < completions[:, None]).astype(np.int32)
    return {
        "prompt_tokens": (rng.integers(1, vocab, (b, prompt_len)) * prompt_mask).astype(np.int32),
        "prompt_mask": prompt_mask,
        "tokens": (rng.integers(1, vocab, (b, new_tokens)) * mask).astype(np.int32),
        "mask": mask,
        "advantages": rng.standard_normal(b).astype(np.float32),
    }


def _timed(prepare: Any, calls: dict[str, Any], *, warmup: int, iters: int) -> dict[str, tuple[float, float, float, Any]]:
    """Per call name: ``(compile + first call s, fastest of iters s, the process's CPU s
    of that call, first call's metrics)``. Each call gets fresh ``prepare()``d arguments,
    made outside the timed region. The calls' timed runs alternate (padded, packed,
    padded, ...), so a shared machine's load, which drifts over minutes, falls on both
    alike; CPU seconds (every thread of the process) are what its other jobs disturb
    least: wall time there includes waiting for a core."""
    import jax

    def once(call: Any) -> tuple[float, float, Any]:
        args = jax.block_until_ready(prepare())
        t0, c0 = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(call(*args))
        return time.perf_counter() - t0, time.process_time() - c0, out

    first = {name: once(call) for name, call in calls.items()}
    for _ in range(warmup):
        for call in calls.values():
            once(call)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for _ in range(iters):
        for name, call in calls.items():
            runs[name].append(once(call)[:2])
    out = {}
    for name in calls:
        best = min(runs[name], key=lambda t: t[0])
        out[name] = (first[name][0], best[0], best[1], first[name][2])
    return out


def compiled_cost(jitted: Any, args: tuple, micro_batches: int) -> dict[str, float] | None:
    """XLA's cost analysis of the compiled update: ``flops``, ``bytes_accessed`` and
    ``transcendentals`` of one update of ``micro_batches`` micro-batches. XLA counts a
    loop's body once, and every pass of the update but the optimizer step is in its
    micro-batch loop, so the counts are scaled by the loop's trip count (the optimizer
    step, outside the loop, is scaled with them: an over-count of ``micro_batches - 1``
    optimizer steps, about 1e-4 of the tiny preset's update at the defaults). Exact (no
    timer); None where the backend gives no analysis."""
    try:
        analysis = jitted.lower(*args).compile().cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: the times stand alone
        return None
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    if not analysis:
        return None
    keys = {"flops": "flops", "bytes_accessed": "bytes accessed", "transcendentals": "transcendentals"}
    return {k: float(analysis.get(v, 0.0)) * micro_batches for k, v in keys.items()}


def _ratio(cost: dict[str, Any], key: str) -> float | None:
    if cost["padded"] is None or cost["packed"] is None or not cost["padded"][key]:
        return None
    return cost["packed"][key] / cost["padded"][key]


def run_update_bench(*, lengths: str, iters: int, warmup: int, **settings: Any) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from grpo.engine.parallel.mesh import build_mesh, current_topology
    from grpo.engine.planning.profiles import draw, load_profile, summary
    from grpo.engine.programs import build_programs
    from grpo.engine.training.update import UpdateBatch
    from grpo.core.config import resolve_layout
    from grpo.models.loading import build_model
    from grpo.models.lora import split_params

    profile = load_profile(lengths)
    config = bench_config(**settings)
    topology = current_topology()
    layout = resolve_layout(config, topology)
    mesh = build_mesh(layout)
    model = build_model(config.model, mesh, seed=settings["seed"])
    arch = model.config
    graphdef, state = nnx.split(model)
    del model
    params, frozen = split_params(state)
    programs = build_programs(config, mesh=mesh, layout=layout, graphdef=graphdef, eos_ids=(0,), pad_id=0, arch=arch,
                              topology=topology, state=state)
    Lp, N = settings["prompt_len"], settings["new_tokens"]
    prompts, completions = draw(profile, rows=config.sequences_per_step, cap=N, prompt_length=Lp,
                                seed=settings["seed"])
    host = synthetic_rows(prompts=prompts, completions=completions, prompt_len=Lp, new_tokens=N,
                          vocab=arch.vocab_size, seed=settings["seed"])
    to_train = programs.to_train
    ub = UpdateBatch(**{k: to_train(jnp.asarray(v)) for k, v in host.items()}, old_logprobs=None, ref_logprobs=None)
    update = programs.update(params, programs.init_opt_state(params))

    def prepare() -> tuple[Any, Any]:
        # The update donates its parameters and optimizer state: each call starts from a
        # fresh copy of the same ones.
        p = jax.tree.map(jnp.copy, params)
        return p, programs.init_opt_state(p)

    def runner(batch: Any):
        return lambda p, opt: update(p, opt, batch, frozen)[2]

    t0 = time.perf_counter()
    plan = programs.pack_plan(ub)
    packed, _ = programs.pack(ub, plan)
    jax.block_until_ready(packed)
    pack_first = time.perf_counter() - t0
    pack_s = float("inf")
    for _ in range(max(iters, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(programs.pack(ub, programs.pack_plan(ub))[0])
        pack_s = min(pack_s, time.perf_counter() - t0)
    timed = _timed(prepare, {"padded": runner(ub), "packed": runner(packed)}, warmup=warmup, iters=iters)
    micro = {"padded": config.sequences_per_step // config.micro_batch_size, "packed": plan.micro_batches}
    cost = {name: compiled_cost(update, (params, programs.init_opt_state(params), batch, frozen), micro[name])
            for name, batch in (("padded", ub), ("packed", packed))}
    padded_first, padded_s, padded_cpu, m_pad = timed["padded"]
    packed_first, packed_s, packed_cpu, m_pack = timed["packed"]
    valid = int(completions.sum())
    device = jax.devices()[0]
    return {
        "device": f"{device.platform}:{getattr(device, 'device_kind', '')}",
        "devices": jax.device_count(),
        "model": f"preset:{settings['preset']} (random weights)",
        "shape": {"rows": config.sequences_per_step, "prompt_len": Lp, "new_tokens": N,
                  "micro_batches": config.sequences_per_step // config.micro_batch_size,
                  "dtype": settings["dtype"], "loss": settings["loss"], "attention": settings["attention"]},
        "lengths": summary(profile, cap=N, prompt_length=Lp),
        "valid_tokens": valid,
        "real_tokens": int((prompts + completions).sum()),
        "padded_tokens": config.sequences_per_step * (Lp + N),
        "bins": plan.bins,
        "bins_used": plan.used,
        "bin_length": plan.bin_length,
        "micro_batches_packed": plan.micro_batches,
        "bins_per_device": plan.per,
        "head_width": plan.head,  # the loss's head slots per device per micro-batch (of per x bin_length)
        "max_bins_per_device": programs.max_bins_per_device,
        "efficiency": plan.efficiency,
        "padded_s": padded_s,
        "packed_s": packed_s,
        "pack_s": pack_s,
        "ratio": (pack_s + packed_s) / padded_s,
        "update_ratio": packed_s / padded_s,
        "cpu_s": {"padded": padded_cpu, "packed": packed_cpu},
        "cpu_ratio": packed_cpu / padded_cpu,
        "compiled": cost,
        "flops_ratio": _ratio(cost, "flops"),
        "bytes_ratio": _ratio(cost, "bytes_accessed"),
        "valid_tokens_per_s_padded": valid / padded_s,
        "valid_tokens_per_s_packed": valid / (pack_s + packed_s),
        "first_call_s": {"padded": padded_first, "packed": packed_first, "pack": pack_first},
        "loss_padded": float(m_pad["loss"]),
        "loss_packed": float(m_pack["loss"]),
        "iters": iters,
    }


@click.command("update")
@click.option("--lengths", required=True, metavar="PROFILE",
              help="Completion-length profile: a built-in name (gsm8k-qwen25-3b-v6e8), a file with one length "
              "(tokens) a line, or a run's samples.jsonl.")
@click.option("--preset", default="tiny", show_default=True, help="Model preset (random weights, no download).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--rows", type=click.IntRange(min=1), default=128, show_default=True, help="Sequences per step.")
@click.option("--generations", type=click.IntRange(min=1), default=8, show_default=True, help="Samples per prompt.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=256, show_default=True,
              help="Prompt length (rollout.max_prompt_length; prompts of a profile without prompt lengths fill it).")
@click.option("--new-tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Length cap (rollout.max_new_tokens); a built-in profile scales to it.")
@click.option("--micro-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="train.micro_batch_size (sequences).")
@click.option("--loss", default="jax", show_default=True, help="Loss plugin (loss.impl).")
@click.option("--attention", default="auto", show_default=True, help="model.attention.")
@click.option("--iters", type=click.IntRange(min=1), default=3, show_default=True, help="Timed updates each way.")
@click.option("--warmup", type=click.IntRange(min=0), default=0, show_default=True,
              help="Untimed updates after the first call.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON line (default: indented JSON).")
def bench_update(lengths, preset, dtype, rows, generations, prompt_len, new_tokens, micro_batch, loss, attention,
                 iters, warmup, seed, as_json) -> None:
    """Time the update padded vs packed on the same rows drawn from a length profile."""
    result = run_update_bench(lengths=lengths, iters=iters, warmup=warmup, preset=preset, dtype=dtype, rows=rows,
                              generations=generations, prompt_len=prompt_len, new_tokens=new_tokens,
                              micro_batch=micro_batch, loss=loss, attention=attention, seed=seed)
    click.echo(json.dumps(result, indent=None if as_json else 2))


__all__ = ["bench_update", "run_update_bench", "synthetic_rows"]
