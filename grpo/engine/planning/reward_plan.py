"""The plan of a run's model rewards (``task.model_rewards``): their programs compiled for
the rollout side and their memory there.

A model reward runs on one process's rollout devices (a ``(1, n, 1)`` mesh of them: see
:mod:`grpo.engine.rollout.model_rewards`), so it is planned on the first process's
rollout devices of the topology:

- a reward model: its scoring pass (``<name>/score``) at ``micro_batch`` rows (rounded
  up over the devices) of ``max_length`` tokens, on its abstract parameters (read from
  the checkpoint's ``config.json``; nothing is downloaded: a hub id that is not a local
  directory is reported as not planned);
- a judge: its engine's programs (``<name>/prefill``, ``<name>/decode``, ... the run's
  ``rollout.engine`` lowering a batch of ``micro_batch`` rows at ``max_prompt_length``)
  on the judge model's abstract parameters, and the engine's KV cache.

Each reward's parameters stay resident on the rollout devices through the whole run, so
the report's ``peak_bytes_per_device`` grows by their sum, and by at most the largest
reward program's own bytes (an upper bound: each program's bytes count its own
parameters again); ``fits`` is judged again on the new peak.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from grpo.core.config import RunConfig
from grpo.core.config.rewards import JudgeConfig
from grpo.engine.planning.compiled import compile_program
from grpo.engine.planning.memory import bytes_per_device


def rollout_devices(planner: Any, config: RunConfig) -> list[Any]:
    """The first process's devices of the rollout side: all of its devices, or (async)
    those of the rollout split's first process."""
    devices = list(planner.devices)
    if config.train.async_.enabled:
        n = config.train.async_.rollout_devices or len(devices) // 2
        devices = devices[:n]
    first = devices[0].process_index
    return [d for d in devices if d.process_index == first]


def _mesh(devices: list[Any]):
    from grpo.core.contracts import MeshLayout
    from grpo.engine.parallel.mesh import build_mesh

    return build_mesh(MeshLayout(dp=1, fsdp=len(devices), tp=1), devices)


def _abstract(graphdef_state: tuple[Any, Any], shardings: dict[str, Any]) -> Any:
    from flax import nnx

    from grpo.models.loading import _dotted

    graphdef, flat = graphdef_state
    state = nnx.from_flat_state([
        (p, v.replace(jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype, sharding=shardings[_dotted(p)])))
        for p, v in flat])
    return graphdef, state


def reward_model_programs(entry: Any, mesh: Any) -> tuple[int, dict[str, Any]]:
    """``(parameter bytes per device, {program name: lower})`` of a reward model."""
    import jax.numpy as jnp

    from grpo.engine.rollout.reward_inputs import BATCH_AXES, round_up
    from grpo.models.classifier import classifier_scores, read_classifier_config
    from grpo.models.loading import _abstract as abstract_model_state, _model_kwargs, param_shardings

    from grpo.core.errors import UserError

    directory = Path(entry.checkpoint).expanduser()
    if not directory.is_dir():
        raise UserError(f"{entry.checkpoint!r} is not a local directory, and the plan downloads nothing; "
                        "pass the checkpoint's directory to plan its reward model")
    _, config, raw = read_classifier_config(directory, where=entry.name)
    graphdef, state = _abstract(abstract_model_state(config, **_model_kwargs(mesh, entry.dtype, entry.dtype, "none",
                                                                          "xla", None)),
                                param_shardings(config, mesh))
    labels = len(raw.get("id2label") or {}) or int(raw.get("num_labels", 1))
    dtype = jnp.bfloat16 if entry.dtype == "bfloat16" else jnp.float32
    score = jax.ShapeDtypeStruct((config.hidden_size, labels), dtype, sharding=NamedSharding(mesh, P()))
    rows = round_up(entry.micro_batch, math.prod(mesh.shape[a] for a in BATCH_AXES))
    batch = NamedSharding(mesh, P(BATCH_AXES))
    tokens = jax.ShapeDtypeStruct((rows, entry.max_length), jnp.int32, sharding=batch)
    pad = raw.get("pad_token_id")
    fn = jax.jit(classifier_scores, static_argnums=0, static_argnames="pad_token_id")
    lower = lambda: fn.lower(graphdef, state, score, tokens, tokens, pad_token_id=pad)  # noqa: E731
    return bytes_per_device((state, score)), {f"{entry.name}/score": lower}


def judge_programs(entry: JudgeConfig, config: RunConfig, mesh: Any) -> tuple[int, int, dict[str, Any]]:
    """``(parameter bytes, KV cache bytes per device, {program name: lower})`` of a judge."""
    from grpo.engine.rollout.engines import build_sampler
    from grpo.engine.rollout.judge import judge_run_config
    from grpo.engine.rollout.layout import RolloutPlacement
    from grpo.engine.rollout.reward_inputs import BATCH_AXES, round_up
    from grpo.models.loading import abstract_model

    run = judge_run_config(entry, config)
    graphdef, params, arch = abstract_model(run.model, mesh)
    eos = arch.eos_token_id if arch.eos_token_id is not None else 0
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    engine = build_sampler(run, placement=RolloutPlacement.training(mesh, BATCH_AXES), graphdef=graphdef,
                           plugins=None, eos_ids=eos, pad_id=eos[0], multi_turn=False, lora_adapters=False,
                           greedy=entry.greedy, num_generations=1)
    rows = round_up(entry.micro_batch, math.prod(mesh.shape[a] for a in BATCH_AXES))
    key = jax.random.key(entry.seed)
    lowerings = engine.lowerings(params, prompts=rows, prompt_length=entry.max_prompt_length, key=key)
    cache = engine.cache_bytes(params, rows=rows, prompt_length=entry.max_prompt_length)
    return bytes_per_device(params), int(cache), {f"{entry.name}/{n}": low for n, low in lowerings.items()}


def model_rewards_report(planner: Any, config: RunConfig) -> dict[str, Any] | None:
    """The ``model_rewards`` section of a plan (None without model rewards)."""
    from grpo.core.errors import UserError
    from grpo.core.contracts import NotPlanned

    if not config.task.model_rewards:
        return None
    devices = rollout_devices(planner, config)
    mesh = _mesh(devices)
    out: dict[str, Any] = {"devices": len(devices), "rewards": {}}
    resident = 0
    largest = 0
    for entry in config.task.model_rewards:
        item: dict[str, Any] = {"kind": entry.kind}
        try:
            if isinstance(entry, JudgeConfig):
                params, cache, lowerings = judge_programs(entry, config, mesh)
                item["kv_cache_bytes_per_device"] = cache
            else:
                params, lowerings = reward_model_programs(entry, mesh)
        except (UserError, NotPlanned) as err:
            item["not_planned"] = str(err)
            out["rewards"][entry.name] = item
            continue
        item["parameter_bytes_per_device"] = params
        item["programs"] = {}
        for name, lower in lowerings.items():
            r = compile_program(name, lower, ("parameters",))
            item["programs"][name] = {"program_bytes": None if r.memory is None else r.memory["program_bytes"],
                                      "error": r.error}
            if r.memory is not None:
                largest = max(largest, r.memory["program_bytes"])
        resident += params
        out["rewards"][entry.name] = item
    out["resident_bytes_per_device"] = resident
    out["largest_program_bytes"] = largest
    return out


def add_model_rewards(report: dict[str, Any], planner: Any, config: RunConfig) -> dict[str, Any]:
    """``report`` (a plan) with its ``model_rewards`` section, and its peak and fit with
    the rewards' resident parameters and their largest program on the rollout side."""
    section = model_rewards_report(planner, config)
    if section is None:
        return report
    report["model_rewards"] = section
    peak = report.get("peak_bytes_per_device")
    if peak is not None:
        # An upper bound: the run's peak (its resident state in it), every reward's
        # parameters, and the largest reward program (its own parameters counted again).
        new = peak + section["resident_bytes_per_device"] + section["largest_program_bytes"]
        section["peak_bytes_per_device_before"] = peak
        report["peak_bytes_per_device"] = new
        if "fits" in report:
            report["fits"] = bool(report["fits"] and new <= planner.hbm_bytes)
    return report


__all__ = ["add_model_rewards", "judge_programs", "model_rewards_report", "reward_model_programs"]


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 20):.2f} MiB"


def format_model_rewards(section: dict[str, Any]) -> str:
    """The ``model_rewards`` section as the text report's lines."""
    lines = [f"model rewards (on {section['devices']} rollout device(s) per process; resident "
             f"{_mib(section['resident_bytes_per_device'])}/device, counted in the peak above):"]
    for name, item in section["rewards"].items():
        if "not_planned" in item:
            lines.append(f"  {name} ({item['kind']}): not planned: {item['not_planned']}")
            continue
        programs = ", ".join(f"{p} {_mib(v['program_bytes'])}" if v["error"] is None else f"{p} failed: {v['error']}"
                             for p, v in item["programs"].items())
        cache = f", KV cache {_mib(item['kv_cache_bytes_per_device'])}" if "kv_cache_bytes_per_device" in item else ""
        lines.append(f"  {name} ({item['kind']}): parameters {_mib(item['parameter_bytes_per_device'])}{cache}; "
                     f"{programs}")
    return "\n".join(lines)


__all__ += ["format_model_rewards"]
