"""``grpo bench loss``: value+grad time and compiled memory of a loss implementation,
called as the update calls it (:func:`grpo.engine.programs.loss_program`).

Prints one JSON object. Memory comes from XLA's compiled-memory analysis
(``jax.jit(step).lower(...).compile().memory_analysis()``), which is exact and repeatable
on every backend; ``--compile-only`` reports just that and never allocates the inputs,
so the headline shape can be measured on a small CPU machine. Times mean something only
on an accelerator (on CPU the pallas kernels run in interpret mode).
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from grpo.core.errors import UserError

DTYPES = {"bf16": "bfloat16", "f32": "float32"}


def _options(impl: str, *, block_v, block_t, block_d, schedule, interpret) -> dict[str, Any]:
    if impl == "jax":
        unused = {"--block-size": block_v, "--time-block": block_t, "--block-d": block_d,
                  "--schedule": schedule, "--interpret": interpret}
        given = [flag for flag, val in unused.items() if val is not None]
        if given:
            raise UserError(f"{', '.join(given)} only apply to --impl pallas.")
        return {}
    raw: dict[str, Any] = {"block_v": block_v, "block_t": block_t, "block_d": block_d, "interpret": interpret}
    if schedule is not None:
        raw["schedule"] = schedule
    return {k: v for k, v in raw.items() if v is not None}


@click.command("loss")
@click.option("--impl", default="pallas", show_default=True, help="Loss plugin name (jax, pallas, or a third-party one).")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Sequences B.")
@click.option("--time", "time_", type=click.IntRange(min=1), default=4096, show_default=True, help="Completion length T.")
@click.option("--vocab", type=click.IntRange(min=2), default=151643, show_default=True, help="Vocabulary size V.")
@click.option("--hidden", type=click.IntRange(min=1), default=2048, show_default=True, help="Hidden size D.")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="bf16", show_default=True, help="Hidden states and head weight dtype.")
@click.option("--mode", type=click.Choice(["on_policy", "off_policy"]), default="on_policy", show_default=True,
              help="off_policy passes old log-probs (ratios != 1).")
@click.option("--beta", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="KL weight (> 0 passes reference log-probs).")
@click.option("--aggregation", type=click.Choice(["token_mean", "sequence_mean", "constant"]), default="token_mean", show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0, min_open=True), default=1.0, show_default=True)
@click.option("--block-size", "block_v", type=int, default=None, help="pallas: vocab block (block_v).")
@click.option("--time-block", "block_t", type=int, default=None, help="pallas: token-row block (block_t).")
@click.option("--block-d", "block_d", type=int, default=None, help="pallas: hidden chunk of the loop (GPU) schedule.")
@click.option("--schedule", type=click.Choice(["auto", "grid", "loop"]), default=None, help="pallas: kernel schedule.")
@click.option("--interpret/--no-interpret", default=None, help="pallas: force interpret mode on or off.")
@click.option("--iters", type=click.IntRange(min=1), default=10, show_default=True, help="Timed steps.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed steps after the first call.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--compile-only", is_flag=True, help="Only lower and compile: report compiled memory, allocate nothing.")
@click.option("--opaque-kernels", is_flag=True,
              help="pallas, with --compile-only: replace each kernel by an opaque call with the same operands, "
              "as a Mosaic/Triton custom call is, to measure the memory around the kernels without the "
              "interpreter's operand copies (CPU).")
@click.option("--json", "as_json", is_flag=True, help="One JSON line (default: indented JSON).")
def bench_loss(impl, batch, time_, vocab, hidden, dtype, mode, beta, aggregation, temperature, block_v, block_t,
               block_d, schedule, interpret, iters, warmup, seed, compile_only, opaque_kernels, as_json) -> None:
    """Time value+grad (w.r.t. hidden states and head weight) of a loss and report its memory."""
    import jax
    import jax.numpy as jnp

    from grpo.core.contracts import LossSettings
    from grpo.engine.training.update import loss_program

    if opaque_kernels and (impl != "pallas" or not compile_only):
        raise UserError("--opaque-kernels goes with --impl pallas and --compile-only (opaque kernels cannot run).")
    plugin, options = _plugin(impl, block_v=block_v, block_t=block_t, block_d=block_d, schedule=schedule,
                              interpret=interpret)
    settings = LossSettings(beta=beta, temperature=temperature, aggregation=aggregation, max_completion_length=time_)
    dt = jnp.dtype(DTYPES[dtype])
    b, t, d, v = batch, time_, hidden, vocab
    off_policy = mode == "off_policy"
    device = jax.devices()[0]
    result: dict[str, Any] = {
        "impl": impl,
        "device": f"{device.platform}:{getattr(device, 'device_kind', '')}",
        "backend": jax.default_backend(),
        "shape": {"batch": b, "time": t, "vocab": v, "hidden": d},
        "dtype": dtype,
        "mode": mode,
        "beta": beta,
        "aggregation": aggregation,
        "options": options.model_dump(),
    }
    kernel = getattr(plugin, "kernel_report", None)
    if kernel is not None:
        result["kernel"] = kernel(options, dtype=dt, hidden_size=d)

    # The program the update runs for this loss (the builder's), not a copy of it.
    jitted = loss_program(plugin, options, settings, old_logprobs=off_policy, ref_logprobs=beta > 0)
    opaque = plugin.opaque_kernels() if opaque_kernels else None
    compiled = _compile(jitted, _shapes(b, t, d, v, dt), result, opaque=opaque)
    result["logits_bytes_f32"] = b * t * v * 4  # what materialising [B, T, V] f32 once costs
    if not compile_only:
        result.update(_timed(jitted, compiled, _inputs(b, t, d, v, dt, seed), compile_s=result["compile_s"],
                             warmup=warmup, iters=iters))
    result["peak_bytes_in_use"] = _peak_bytes_in_use(device)
    click.echo(json.dumps(result, indent=None if as_json else 2))


def _plugin(impl: str, **flags: Any) -> tuple[Any, Any]:
    """The loss plugin ``impl`` and its options from the kernel flags."""
    from pydantic import ValidationError

    from grpo.core.config import validation_problems
    from grpo.core.plugins import get_plugins

    plugin = get_plugins().get("loss", impl)
    raw = _options(impl, **flags)
    try:
        return plugin, plugin.parse_options(raw)
    except ValidationError as err:
        raise UserError(f"Invalid options for loss {impl!r}:", problems=validation_problems(err, "options", plugin.Options)) from None


def _shapes(b: int, t: int, d: int, v: int, dt: Any) -> tuple:
    """The loss program's arguments, abstract: hidden [B, T, D], head [D, V], targets,
    mask [B, T], advantages [B], old and reference log-probs [B, T]."""
    import jax
    import jax.numpy as jnp

    return (
        jax.ShapeDtypeStruct((b, t, d), dt),
        jax.ShapeDtypeStruct((d, v), dt),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
        jax.ShapeDtypeStruct((b, t), jnp.float32),
        jax.ShapeDtypeStruct((b,), jnp.float32),
        jax.ShapeDtypeStruct((b, t), jnp.float32),
        jax.ShapeDtypeStruct((b, t), jnp.float32),
    )


def _compile(jitted: Any, shapes: tuple, result: dict[str, Any], *, opaque: Any = None) -> Any:
    """Lower and compile (within ``opaque``, the plugin's opaque-kernels context, when
    given); ``compile_s`` and the compiled memory go into ``result``."""
    t0 = time.perf_counter()
    if opaque is not None:
        with opaque:
            compiled = jitted.lower(*shapes).compile()
        result["kernel"]["opaque"] = True
    else:
        compiled = jitted.lower(*shapes).compile()
    result["compile_s"] = round(time.perf_counter() - t0, 3)
    mem = compiled.memory_analysis()
    if mem is not None:
        result["compiled_temp_bytes"] = int(mem.temp_size_in_bytes)
        result["compiled_argument_bytes"] = int(mem.argument_size_in_bytes)
        result["compiled_output_bytes"] = int(mem.output_size_in_bytes)
        result["compiled_generated_code_bytes"] = int(mem.generated_code_size_in_bytes)
    else:
        result["compiled_temp_bytes"] = None
    return compiled


def _inputs(b: int, t: int, d: int, v: int, dt: Any, seed: int) -> tuple:
    """Random arguments of the shapes of :func:`_shapes`."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    h = (jax.random.normal(keys[0], (b, t, d), jnp.float32)).astype(dt)
    w = (jax.random.normal(keys[1], (d, v), jnp.float32) * (d ** -0.5)).astype(dt)
    targets = jax.random.randint(keys[2], (b, t), 0, v, jnp.int32)
    mask = jnp.ones((b, t), jnp.float32)
    adv = jax.random.normal(keys[3], (b,), jnp.float32)
    noise = 0.05 * jax.random.normal(keys[4], (b, t), jnp.float32)
    # Plausible old/ref log-probs: near the current ones is what a real run sees, but
    # any finite values exercise the same code; a constant keeps set-up cheap.
    old = jnp.full((b, t), -float(jnp.log(v)), jnp.float32) + noise
    ref = old - noise
    return (h, w, targets, mask, adv, old, ref)


def _timed(jitted: Any, compiled: Any, args: tuple, *, compile_s: float, warmup: int, iters: int) -> dict[str, Any]:
    """The first call (compile included), then the mean of ``iters`` compiled steps after
    ``warmup``; the loss and whether every gradient is finite."""
    import jax
    import jax.numpy as jnp

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    loss, grads = jitted(*args)
    jax.block_until_ready((loss, grads))
    out["first_call_s"] = round(time.perf_counter() - t0 + compile_s, 3)
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        step = compiled(*args)
    jax.block_until_ready(step)
    out["avg_step_ms"] = round((time.perf_counter() - t0) / iters * 1e3, 3)
    out["iters"] = iters
    out["loss"] = float(loss)
    out["grad_finite"] = bool(all(bool(jnp.isfinite(g).all()) for g in grads))
    return out


def _peak_bytes_in_use(device: Any) -> int | None:
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats raise or return None
        stats = None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None
