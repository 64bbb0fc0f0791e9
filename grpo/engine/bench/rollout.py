"""``grpo bench rollout``: speed of the rollout sampler (prefill + KV-cache decode).

A ``--preset`` builds random weights of the real architecture (no download); ``--model``
loads a Hugging Face directory or hub id. Prompts are random token ids with lengths drawn
uniformly from [prompt_len/2, prompt_len], left-padded to ``--prompt-len``; the batch is
``--batch`` sequences = ``batch / generations`` prompts x ``--generations`` samples.
Random weights almost never produce a stop token, so all ``--new-tokens`` are decoded.

Both jits are compiled ahead of time (``compile_s``), then prefill and decode run
``--repeats`` times and the fastest run is reported. ``ms_per_decode_step`` is
``decode_s`` over the forward steps (``decode_steps - 1``: the first token comes from the
prefill logits); ``tokens_per_s`` is ``batch * decode_steps / (prefill_s + decode_s)``
(rows that stopped early count too: the sampler's throughput, not useful tokens, which
are ``generated_tokens``). On an accelerator the decode is
compared with the HBM roofline: every forward step must read the weights plus the live
KV cache (the slots written so far, prompt padding included) of the device's rows, so

    hbm_roofline_fraction = sum over steps (weight_bytes + live_kv_bytes) / bandwidth / decode_s

with the bandwidth measured by a copy kernel on the device (or ``--bandwidth-gbps``);
``bandwidth_source`` says which. Absolute times mean something only on an accelerator.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

import click
import numpy as np

from grpo.core.errors import UserError
from grpo.engine.bench.engines import ENGINES

# Nominal HBM bandwidth (bytes/s) by device kind substring, most specific first; used
# only with --bandwidth nominal.
NOMINAL_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),
    ("H200", 4.8e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.04e12),
    ("A100", 1.56e12),
    ("TPU v6", 1.64e12),
    ("TPU v5p", 2.76e12),
    ("TPU v5 lite", 8.19e11),
    ("TPU v5e", 8.19e11),
    ("TPU v4", 1.2e12),
)


def nominal_bandwidth(device_kind: str) -> float | None:
    for key, bw in NOMINAL_BANDWIDTH:
        if key.lower() in device_kind.lower():
            return bw
    return None


def measure_bandwidth(nbytes: int = 2 * 1024**3, repeats: int = 5) -> float:
    """Bytes/s of ``x + 1`` over a bf16 buffer on the first device (reads and writes
    ``nbytes`` each)."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    n = nbytes // 2
    x = jax.device_put(jnp.zeros((n,), jnp.bfloat16), dev)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    return 2 * n * 2 / _best_of(lambda: f(x), repeats)


def _best_of(fn: Any, repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (after one untimed call)."""
    import jax

    jax.block_until_ready(fn())
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def _eos_ids(config: Any, model_dir: Any = None) -> tuple[int, ...]:
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
        elif v is not None:
            ids.add(int(v))

    add(config.eos_token_id)
    if model_dir is not None:
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            add(json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id"))
    return tuple(sorted(ids))


def bench_config(
    *,
    model_path: str | None,
    preset: str | None,
    dtype: str,
    batch: int,
    generations: int,
    prompt_len: int,
    new_tokens: int,
    early_stop: bool,
    early_stop_chunk: int,
    kv_segment: int,
    style: str,
    mesh_policy: str,
    mesh_shape: str | None,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    lora_rank: int = 0,
    base_quantization: str = "none",
    lora_sampler: str = "adapters",
    tensor_parallel: str | int = "auto",
    quantization: str = "none",
    kv_quantization: str = "none",
) -> Any:
    """The run config whose rollout the bench measures: ``--batch / --generations`` prompts
    per step of ``--prompt-len`` tokens (one bucket), the bench's sampling settings, mesh
    and rollout style. Validated like a config file; a problem names the config field."""
    from grpo.core.config import load_config
    from grpo.core.errors import ConfigError

    model: dict[str, Any] = {"param_dtype": dtype, "compute_dtype": dtype}
    if model_path is not None:
        model.update(source="hf", path=model_path)
    else:
        model.update(source="random", random={"preset": preset})
    if lora_rank or base_quantization != "none":
        rank = max(lora_rank, 1)
        model["lora"] = {"rank": rank, "alpha": 2.0 * rank, "base_quantization": base_quantization, "sampler": lora_sampler}
    raw = {
        "model": model,
        "mesh": {"policy": mesh_policy, "options": {"shape": mesh_shape} if mesh_shape else {}},
        "rollout": {
            "style": style, "num_generations": generations, "max_prompt_length": prompt_len,
            "prompt_buckets": [prompt_len], "max_new_tokens": new_tokens, "temperature": temperature,
            "top_k": top_k, "top_p": top_p, "early_stop_chunk": early_stop_chunk if early_stop else 0,
            "kv_segment": kv_segment, "quantization": {"weights": quantization, "kv_cache": kv_quantization},
            # a quantized KV cache is the continuous engine's page pool (--kv-quantization needs --lengths)
            **({"engine": "continuous"} if kv_quantization != "none" else {}),
            **({"options": {"tensor_parallel": tensor_parallel}} if style == "serving" else {}),
        },
        # Untimed warm-up runs compile what the timed ones take; nothing compiles ahead
        # (the continuous engine's decode buckets a timed run never reaches would be paid for).
        "train": {"prompts_per_step": batch // generations, "seed": seed, "compile": {"ahead": "lazy"}},
    }
    try:
        return load_config(raw)
    except ConfigError as err:
        raise UserError(
            "The bench's settings do not make a valid run (--batch / --generations is train.prompts_per_step, "
            "the sampling flags are rollout.*, --mesh/--shape is mesh.*):",
            problems=err.problems,
        ) from None


def _memory_stats() -> dict[str, int]:
    import jax

    peak = [int((d.memory_stats() or {}).get("peak_bytes_in_use", -1)) for d in jax.local_devices()]
    return {"peak_bytes_in_use": max(peak)} if max(peak, default=-1) >= 0 else {}


def run_rollout_bench(*, repeats: int, bandwidth: str, bandwidth_gbps: float | None, **settings: Any) -> dict[str, Any]:
    """Build the run config of ``settings`` (:func:`bench_config`'s keywords), its policy
    and its sampler through the program builder, then time prefill + decode."""
    model_path, preset = settings["model_path"], settings["preset"]
    batch, generations = settings["batch"], settings["generations"]
    if (model_path is None) == (preset is None):
        raise UserError("Give exactly one of --model PATH and --preset NAME.")
    if batch % generations:
        raise UserError(f"--batch {batch} must be a multiple of --generations {generations}.")
    config = bench_config(**settings)
    built = _build(config, settings)
    sampler = built.programs.sampler()
    params, reshard_s, weight_bytes = _sampler_state(built, settings, repeats)
    tokens, mask = _random_prompts(built.arch, built.eos, batch=batch, generations=generations,
                                   prompt_len=settings["prompt_len"], seed=settings["seed"])
    timing = _time_rollout(sampler, params, tokens, mask, seed=settings["seed"], repeats=repeats)
    result = _result(built, sampler, settings, timing, reshard_s=reshard_s, weight_bytes=weight_bytes)
    result.update(_roofline(built, settings, timing, weight_bytes=weight_bytes, bandwidth=bandwidth,
                            bandwidth_gbps=bandwidth_gbps))
    return result


def run_lengths_bench(*, repeats: int, lengths: str, engines: tuple[str, ...], continuous: dict[str, Any],
                      **settings: Any) -> dict[str, Any]:
    """The engines on the same rows stopped at lengths drawn from ``lengths``
    (:mod:`grpo.engine.bench.engines`), with the bench's model and prompts."""
    from grpo.engine.bench.engines import run_engines_bench

    if (settings["model_path"] is None) == (settings["preset"] is None):
        raise UserError("Give exactly one of --model PATH and --preset NAME.")
    if settings["batch"] % settings["generations"]:
        raise UserError(f"--batch {settings['batch']} must be a multiple of --generations {settings['generations']}.")
    config = bench_config(**settings)
    built = _build(config, settings)
    params, _, _ = _sampler_state(built, settings, repeats)
    tokens, mask = _random_prompts(built.arch, built.eos, batch=settings["batch"], generations=settings["generations"],
                                   prompt_len=settings["prompt_len"], seed=settings["seed"])
    import jax

    dev = jax.devices()[0]
    head = {"device": dev.device_kind, "platform": dev.platform, "num_devices": jax.device_count(),
            "source": built.source, "params": built.arch.num_params(), "dtype": settings["dtype"],
            "style": settings["style"], "batch": settings["batch"], "generations": settings["generations"],
            "prompt_len": settings["prompt_len"], "new_tokens": settings["new_tokens"],
            "kv_segment": settings["kv_segment"], "early_stop_chunk": settings["early_stop_chunk"],
            "quantization": {"weights": settings.get("quantization", "none"),
                             "kv_cache": settings.get("kv_quantization", "none")}}
    return {**head, **run_engines_bench(config=config, built=built, params=params, tokens=tokens, mask=mask,
                                        lengths=lengths, engines=engines, continuous=continuous,
                                        seed=settings["seed"], repeats=repeats)}


@dataclasses.dataclass
class _Built:
    """The bench's run as ``grpo run`` builds it: layout, policy (split as the run splits
    it) and the program builder."""

    layout: Any
    mesh: Any
    graphdef: Any
    state: Any
    adapters: Any
    frozen: Any
    arch: Any
    eos: tuple[int, ...]
    pad: int
    source: str
    programs: Any
    lora: dict[str, Any] | None  # the JSON's lora section (None without LoRA)


def _build(config: Any, settings: dict[str, Any]) -> _Built:
    import jax
    from flax import nnx

    from grpo.core.plugins import get_plugins
    from grpo.engine.parallel.mesh import build_mesh, current_topology
    from grpo.engine.planning.tpu import chip_of
    from grpo.engine.programs import build_programs
    from grpo.models.loading import build_model, resolve_checkpoint
    from grpo.models.lora import count_params, split_params

    model_path, preset, seed = settings["model_path"], settings["preset"], settings["seed"]
    lora_rank, base_quantization = settings.get("lora_rank", 0), settings.get("base_quantization", "none")
    plugins = get_plugins()
    topology = current_topology()
    # The layout of `grpo run`, with the rollout style's own checks; the batch-divisibility
    # checks of a run are left out so the bench can measure any batch (a dimension that
    # does not divide over the mesh is replicated).
    mesh_plugin = plugins.get("mesh", config.mesh.policy)
    layout = mesh_plugin.resolve(topology, mesh_plugin.parse_options(config.mesh.options))
    style_plugin = plugins.get("rollout", config.rollout.style)
    problems = style_plugin.check(
        layout=layout, topology=topology, options=style_plugin.parse_options(config.rollout.options)
    )
    if problems:
        raise UserError("The rollout style does not fit this mesh:", problems=problems)
    mesh = build_mesh(layout)

    # The policy as `grpo run` builds it (model.lora included), then split the same way.
    model = build_model(config.model, mesh, seed=seed)
    eos = _eos_ids(model.config, resolve_checkpoint(model_path) if model_path is not None else None)
    source = f"model:{model_path}" if model_path is not None else f"preset:{preset} (random weights)"
    cfg = model.config
    graphdef, state = nnx.split(model)
    del model
    adapters, frozen = split_params(state)
    lora_info = None
    if frozen is not None:
        if lora_rank:
            # B = 0 at init: make the adapters non-zero so their matmuls are real work.
            adapters = jax.tree.map(lambda x: x + 0.01, adapters)
        lora_info = {"rank": lora_rank, "base_quantization": base_quantization,
                     "trainable_params": count_params(adapters)}
    pad = int(cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0))
    programs = build_programs(
        config, mesh=mesh, layout=layout, graphdef=graphdef, eos_ids=eos, pad_id=pad, arch=cfg, topology=topology,
        state=state, chip=chip_of(jax.devices()[0]), frozen=frozen,
    )
    return _Built(layout, mesh, graphdef, state, adapters, frozen, cfg, eos, pad, source, programs, lora_info)


def _prepared(engine: Any, params: Any) -> Any:
    """What ``engine`` reads for the trained ``params``: taken in through its
    ``update_weights`` and read once (the engine's weight preparation: reshard, LoRA
    merge), the engine's own copy released (the caller's is the only one)."""
    engine.update_weights(params)
    try:
        return engine.weights
    finally:
        engine.release()


def _sampler_state(built: _Built, settings: dict[str, Any], repeats: int) -> tuple[Any, float | None, int]:
    """What the sampler reads (through its engine's ``update_weights``), the serving
    layout's reshard time (None without one) and the state's bytes; with LoRA the
    builder's merge time goes into ``built.lora``."""
    import jax

    from grpo.engine.programs import build_programs
    from grpo.models.quant import bits_per_element

    programs, adapters, frozen = built.programs, built.adapters, built.frozen
    engine = programs.sampler()
    params = jax.block_until_ready(_prepared(engine, adapters))
    # A serving layout's once-per-step reshard (timed like the rest: best of --repeats).
    reshard_s = None
    if programs.rollout.resharded:
        reshard_s = round(_best_of(lambda: _prepared(engine, adapters), repeats), 6)
    if built.lora is not None:
        if settings.get("base_quantization", "none") == "none":
            # What `model.lora.sampler: merged` adds per step: the builder's own merge.
            merged = build_programs(
                bench_config(**settings, lora_sampler="merged"), mesh=built.mesh, layout=built.layout,
                graphdef=built.graphdef, eos_ids=built.eos, pad_id=built.pad, frozen=frozen,
            ).sampler()
            built.lora["merge_s"] = round(_best_of(lambda: _prepared(merged, adapters)), 6)
        else:
            built.lora["merge_s"] = None
            built.lora["merge_note"] = "model.lora.sampler=merged needs an unquantized base"
    weight_bytes = sum((x.size * bits_per_element(x.dtype) + 7) // 8 for x in jax.tree.leaves(params))
    return params, reshard_s, weight_bytes


def _random_prompts(arch: Any, eos: tuple[int, ...], *, batch: int, generations: int, prompt_len: int,
                    seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``batch / generations`` prompts [P, prompt_len] of random non-stop tokens, lengths
    uniform in [prompt_len/2, prompt_len], left-padded."""
    P = batch // generations
    rs = np.random.default_rng(seed)
    lengths = rs.integers(max(1, prompt_len // 2), prompt_len + 1, size=P)
    allowed = np.setdiff1d(np.arange(arch.vocab_size), np.asarray(eos, dtype=np.int64))
    tokens = rs.choice(allowed, size=(P, prompt_len)).astype(np.int32)
    mask = (np.arange(prompt_len)[None, :] >= prompt_len - lengths[:, None]).astype(np.int32)
    tokens = np.where(mask == 1, tokens, 0).astype(np.int32)
    return tokens, mask


@dataclasses.dataclass
class _Timing:
    compile_s: float
    prefill_s: float  # the fastest of the repeats
    decode_s: float
    steps: int  # sampling steps of the last run
    out: Any  # its RolloutOutput
    memory: Any  # the compiled decode's memory analysis (None where the backend has none)


def _time_rollout(sampler: Any, params: Any, tokens: np.ndarray, mask: np.ndarray, *, seed: int,
                  repeats: int) -> _Timing:
    """Compile prefill and decode ahead of time, run them once untimed, then
    ``repeats`` timed runs."""
    import jax

    ptoks, pmask = sampler.place_prompts(tokens, mask)
    raw_key, impl = sampler.place_key(jax.random.key(seed))

    t = time.perf_counter()
    prefill_c = sampler.prefill_jit.lower(params, ptoks, pmask).compile()
    compile_s = time.perf_counter() - t
    pre = jax.block_until_ready(prefill_c(params, ptoks, pmask))
    decode_fn = sampler.decode_jit()
    t = time.perf_counter()
    decode_c = decode_fn.lower(
        params, pre.cache, pre.logits, pre.prompt_tokens, pre.prompt_mask, raw_key, key_impl=impl
    ).compile()
    compile_s += time.perf_counter() - t
    mem = decode_c.memory_analysis()

    def run_once() -> tuple[float, float, Any, int]:
        t0 = time.perf_counter()
        p = jax.block_until_ready(prefill_c(params, ptoks, pmask))
        t1 = time.perf_counter()
        out, steps, cache = jax.block_until_ready(
            decode_c(params, p.cache, p.logits, p.prompt_tokens, p.prompt_mask, raw_key)
        )
        t2 = time.perf_counter()
        del cache
        return t1 - t0, t2 - t1, out, int(steps)

    # The first execution pays one-off costs (autotuning, allocation); not reported.
    out, steps, cache = decode_c(params, pre.cache, pre.logits, pre.prompt_tokens, pre.prompt_mask, raw_key)
    jax.block_until_ready(out)
    del pre, cache
    runs = [run_once() for _ in range(max(1, repeats))]
    return _Timing(compile_s=compile_s, prefill_s=min(r[0] for r in runs), decode_s=min(r[1] for r in runs),
                   steps=runs[-1][3], out=runs[-1][2], memory=mem)


def _result(built: _Built, sampler: Any, settings: dict[str, Any], timing: _Timing, *, reshard_s: float | None,
            weight_bytes: int) -> dict[str, Any]:
    """The bench's JSON, the roofline apart."""
    import jax

    cfg, layout, dtype = built.arch, built.layout, settings["dtype"]
    batch, steps, mem = settings["batch"], timing.steps, timing.memory
    prefill_s, decode_s = timing.prefill_s, timing.decode_s
    dev = jax.devices()[0]
    forward_steps = max(steps - 1, 0)  # the first token comes from the prefill logits
    result: dict[str, Any] = {
        "device": dev.device_kind,
        "platform": dev.platform,
        "num_devices": jax.device_count(),
        "source": built.source,
        "params": cfg.num_params(),
        "dtype": dtype,
        "quantization": {"weights": settings.get("quantization", "none"), "kv_cache": settings.get("kv_quantization", "none")},
        "style": settings["style"],
        "mesh_shape": layout.shape,
        "rollout_layout": built.programs.rollout.describe(),
        "reshard_s": reshard_s,
        "batch_axes": list(built.programs.batch_axes),
        "batch": batch,
        "prompts": batch // settings["generations"],
        "generations": settings["generations"],
        "prompt_len": settings["prompt_len"],
        "new_tokens": settings["new_tokens"],
        "early_stop": settings["early_stop"],
        "early_stop_chunk": sampler.chunk(),
        "kv_segment": settings["kv_segment"],
        "decode_steps": steps,
        "generated_tokens": int(np.asarray(timing.out.lengths).sum()),
        "compile_s": round(timing.compile_s, 4),
        "prefill_s": round(prefill_s, 6),
        "decode_s": round(decode_s, 6),
        "ms_per_decode_step": round(1000 * decode_s / max(forward_steps, 1), 4),
        "tokens_per_s": round(batch * steps / (prefill_s + decode_s), 2),
        "weight_bytes": int(weight_bytes),
        "kv_bytes_per_token": cfg.kv_bytes_per_token(dtype),
        "compiled_decode_bytes": {
            "argument": int(mem.argument_size_in_bytes),
            "output": int(mem.output_size_in_bytes),
            "alias": int(mem.alias_size_in_bytes),
            "temp": int(mem.temp_size_in_bytes),
        }
        if mem is not None
        else None,
    }
    if built.lora is not None:
        result["lora"] = built.lora
    result.update(_memory_stats())
    if "peak_bytes_in_use" not in result:
        result["peak_bytes_in_use"] = None
        result["peak_bytes_note"] = f"the {dev.platform} backend reports no memory stats"
    return result


def _roofline(built: _Built, settings: dict[str, Any], timing: _Timing, *, weight_bytes: int, bandwidth: str,
              bandwidth_gbps: float | None) -> dict[str, Any]:
    """On an accelerator, the decode against the HBM roofline (see the module docstring)."""
    import jax

    dev = jax.devices()[0]
    if dev.platform not in ("gpu", "tpu", "cuda", "rocm"):
        return {
            "hbm_roofline_fraction": None,
            "roofline_note": f"not computed on {dev.platform}: the HBM roofline is for accelerators",
        }
    if bandwidth_gbps is not None:
        bw, bw_source = bandwidth_gbps * 1e9, f"--bandwidth-gbps {bandwidth_gbps}"
    elif bandwidth == "nominal" and nominal_bandwidth(dev.device_kind):
        bw, bw_source = nominal_bandwidth(dev.device_kind), f"nominal spec for {dev.device_kind}"
    else:
        bw, bw_source = measure_bandwidth(), "measured: bf16 x+1 copy kernel over 2 GiB (read + write)"
    # Per device: every device reads all weights each step (gathered when FSDP
    # shards them); the KV cache is split over the batch shards.
    layout, prompt_len = built.layout, settings["prompt_len"]
    forward_steps = max(timing.steps - 1, 0)
    shards = max(1, math.prod(layout.shape[a] for a in built.programs.batch_axes))
    kv_tok = built.arch.kv_bytes_per_token(settings["dtype"]) * settings["batch"] / shards
    live = sum(prompt_len + s for s in range(1, forward_steps + 1))  # slots attended over all steps
    ideal_s = (forward_steps * weight_bytes + kv_tok * live) / bw
    return {
        "hbm_roofline_fraction": round(ideal_s / timing.decode_s, 4),
        "roofline_decode_s": round(ideal_s, 6),
        "bandwidth_bytes_per_s": bw,
        "bandwidth_source": bw_source,
    }


@click.command("rollout")
@click.option("--model", "model_path", help="Hugging Face model directory or hub id.")
@click.option("--preset", help="Random weights of a preset architecture (tiny, qwen2.5-3b, qwen3-1.7b, llama-3.2-1b, ...).")
@click.option("--batch", type=click.IntRange(min=1), default=128, show_default=True, help="Sequences (prompts x generations).")
@click.option("--generations", type=click.IntRange(min=2), default=8, show_default=True, help="Samples per prompt.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--early-stop/--no-early-stop", default=True, show_default=True, help="Stop when every row has stopped.")
@click.option("--early-stop-chunk", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--kv-segment", type=click.IntRange(min=0), default=256, show_default=True,
              help="Decode tokens per cache-growth segment; 0 = full cache from the start.")
@click.option("--style", type=click.Choice(["legacy", "maxtext", "serving"]), default="legacy", show_default=True,
              help="Rollout style: legacy/maxtext decode on the training layout, serving in its own.")
@click.option("--tensor-parallel", default="auto", show_default=True,
              help="With --style serving: rollout.options.tensor_parallel (auto or an integer).")
@click.option("--mesh", "mesh_policy", default="auto", show_default=True, help="Mesh policy name.")
@click.option("--shape", "mesh_shape", help="Mesh shape for --mesh explicit, e.g. 1,-1,1.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True, help="Timed runs; the fastest is reported.")
@click.option("--bandwidth", type=click.Choice(["measured", "nominal"]), default="measured", show_default=True,
              help="HBM bandwidth for the roofline.")
@click.option("--bandwidth-gbps", type=float, help="Use this HBM bandwidth (GB/s) for the roofline.")
@click.option("--lora-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="Decode through rank-R LoRA adapters on every projection (unmerged, as `grpo run` "
              "samples); the JSON's lora.merge_s is what merging them into the weights once would cost.")
@click.option("--base-quantization", type=click.Choice(["none", "nf4", "int8"]), default="none", show_default=True,
              help="QLoRA: the base projections stored quantized, dequantized per layer in the decode.")
@click.option("--quantization", type=click.Choice(["none", "int8", "fp8"]), default="none", show_default=True,
              help="rollout.quantization.weights: the rollout's projections in int8/fp8, one scale per output "
              "channel (quantized once, as at a weight sync).")
@click.option("--kv-quantization", type=click.Choice(["none", "int8", "fp8"]), default="none", show_default=True,
              help="rollout.quantization.kv_cache: the continuous engine's page pool in int8/fp8 (needs --lengths; "
              "times the continuous engine).")
@click.option("--lengths", metavar="PROFILE",
              help="Stop each row at a completion length drawn from this profile (a built-in name, a file of "
              "lengths or a run's samples.jsonl) and time the rollout engines (--engine) on the same rows: "
              "valid tokens/s, slot occupancy, the page pool's peak.")
@click.option("--engine", "engines", type=click.Choice(["static", "continuous"]), multiple=True,
              help="With --lengths: the engines to time (repeatable; default both).")
@click.option("--slots", default="auto", show_default=True,
              help="With --lengths: rollout.continuous.slots (auto = the engine's rule, 0 = every row at once, or a "
              "count).")
@click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="With --lengths: rollout.continuous.page_size.")
@click.option("--pool-pages", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --lengths: rollout.continuous.pool_pages.")
@click.option("--chunk", type=click.IntRange(min=1), default=16, show_default=True,
              help="With --lengths: rollout.continuous.chunk.")
@click.option("--json", "as_json", is_flag=True, help="One line of JSON (default: indented).")
def bench_rollout(
    model_path, preset, batch, generations, prompt_len, new_tokens, early_stop, early_stop_chunk, kv_segment,
    style, mesh_policy, mesh_shape, dtype, temperature, top_k, top_p, seed, repeats, bandwidth, bandwidth_gbps,
    lora_rank, base_quantization, as_json, tensor_parallel, lengths, engines, slots, page_size, pool_pages, chunk,
    quantization, kv_quantization,
) -> None:
    """Rollout speed: prefill + decode of --batch sequences, JSON out."""
    if temperature <= 0:
        raise UserError(f"--temperature must be > 0, got {temperature}")
    if kv_quantization != "none" and (lengths is None or "static" in engines):
        raise UserError("--kv-quantization quantizes the continuous engine's page pool: give --lengths PROFILE (the "
                        "continuous engine is timed; the static engine's cache is not quantized).")
    if engines and lengths is None:
        raise UserError("--engine compares the rollout engines on rows stopped at drawn lengths: give --lengths "
                        "PROFILE too (e.g. --lengths gsm8k-qwen25-3b-v6e8).")
    settings = dict(
        model_path=model_path, preset=preset,
        batch=batch, generations=generations, prompt_len=prompt_len, new_tokens=new_tokens, early_stop=early_stop,
        early_stop_chunk=early_stop_chunk, kv_segment=kv_segment, style=style, mesh_policy=mesh_policy,
        mesh_shape=mesh_shape, dtype=dtype, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        lora_rank=lora_rank, base_quantization=base_quantization, quantization=quantization,
        kv_quantization=kv_quantization,
        tensor_parallel=int(tensor_parallel) if str(tensor_parallel).isdigit() else tensor_parallel,
    )
    if lengths is not None:
        if slots != "auto" and not (str(slots).isdigit()):
            raise UserError(f"--slots must be auto or a non-negative integer (got {slots!r}).")
        slots = slots if slots == "auto" else int(slots)
        continuous = {"slots": slots, "page_size": page_size, "pool_pages": pool_pages, "chunk": chunk}
        default = ("continuous",) if kv_quantization != "none" else ENGINES
        result = run_lengths_bench(repeats=repeats, lengths=lengths, engines=tuple(engines) or default,
                                   continuous=continuous, **settings)
    else:
        result = run_rollout_bench(repeats=repeats, bandwidth=bandwidth, bandwidth_gbps=bandwidth_gbps, **settings)
    import jax

    if jax.process_index() == 0:
        click.echo(json.dumps(result, indent=None if as_json else 2))
