"""Checks across the config: pydantic errors as one problem each, the chosen plugins and
their options, checks across sections, and (given a topology) the mesh layout.

Every problem names the dotted field path and the value received; all are reported at
once in a :class:`~grpo.core.errors.ConfigError`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from grpo.core.config.schema import SEQUENCE_OBJECTIVES, ModelConfig, RunConfig
from grpo.core.contracts.attention import auto_attention
from grpo.core.contracts.mesh import MeshLayout, Topology
from grpo.core.errors import ConfigError, PluginError, UserError

# Where each plugin kind is chosen in the config: kind -> (section, name field).
PLUGIN_FIELDS: dict[str, tuple[str, str]] = {
    "mesh": ("mesh", "policy"),
    "rollout": ("rollout", "style"),
    "loss": ("loss", "impl"),
    "objective": ("loss", "objective"),
    "task": ("task", "name"),
    "engine": ("rollout", "engine"),
}
# Where a kind's options live when not in ``<section>.options``.
OPTION_FIELDS: dict[str, str] = {"objective": "objective_options", "engine": "engine_options"}


def _fmt_loc(loc: tuple[Any, ...], prefix: str = "") -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (``X`` of ``X | None``), or None."""
    for sub in getattr(annotation, "__args__", (annotation,)):
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            return sub
    return None


def _field_names(model: type[BaseModel]) -> dict[str, Any]:
    """A model's fields by the name a config writes (``async`` for ``async_``)."""
    return {info.alias or name: info for name, info in model.model_fields.items()}


def _section_at(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> type[BaseModel] | None:
    for part in loc:
        info = _field_names(model).get(part) if model is not None and isinstance(part, str) else None
        if info is None:
            return None
        model = _submodel(info.annotation)
    return model


def _field_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for name, info in _field_names(model).items():
        paths.append((*prefix, name))
        sub = _submodel(info.annotation)
        if sub is not None:
            paths += _field_paths(sub, (*prefix, name))
    return paths


def _did_you_mean(loc: tuple[Any, ...], model: type[BaseModel] | None, prefix: str) -> str:
    """`` did you mean X?`` for an unknown key: the closest field at its own level
    (difflib), else a field of that exact name elsewhere in ``model``."""
    section = _section_at(model, loc[:-1])
    if section is None or not loc or not isinstance(loc[-1], str):
        return ""
    key = loc[-1]
    close = difflib.get_close_matches(key.lower(), list(_field_names(section)), n=1)
    if close:
        return f"; did you mean {_fmt_loc((*loc[:-1], close[0]), prefix)}?"
    elsewhere = sorted(_fmt_loc(p, prefix) for p in _field_paths(model) if p[-1] == key.lower())
    return f"; did you mean {' or '.join(elsewhere[:3])}?" if elsewhere else ""


def validation_problems(err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> list[str]:
    """One problem per pydantic error, each naming its dotted field (under ``prefix``).
    With the ``model`` that was validated, an unknown key gets "did you mean"."""
    problems = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if p not in ("function-after",))
        where = _fmt_loc(loc, prefix)
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if e["type"] == "extra_forbidden":
            hint = _did_you_mean(loc, model, prefix)
            msg = f"unknown field{hint}" if hint else "unknown field (check the spelling; `grpo config schema` lists the fields)"
        if e["type"] == "missing":
            problems.append(f"{where}: required field is missing")
        elif e["type"] == "value_error" and (not loc or where in msg):
            # Cross-field checks name their own fields and values (within ``prefix``).
            problems.append(f"{prefix}: {msg}" if prefix and not loc else msg)
        else:
            problems.append(f"{where}: {msg} (got {_short(e.get('input'))})")
    return problems


@dataclasses.dataclass(frozen=True)
class Selected:
    """A chosen plugin and its validated options."""

    kind: str
    plugin: Any
    options: BaseModel
    provider: str


def select_plugins(config: RunConfig, plugins: Any = None) -> dict[str, Selected]:
    """Look up each chosen plugin and validate its options (raises ConfigError)."""
    selected, problems = _plugin_selection(config, plugins)
    if problems:
        raise ConfigError("Invalid config:", problems=problems)
    return selected


def _plugin_selection(config: RunConfig, plugins: Any = None) -> tuple[dict[str, Selected], list[str]]:
    """Each chosen plugin that exists and takes its options, and a problem for each that
    does not (and for the model's attention kernel and architecture)."""
    from grpo.core.plugins import get_plugins

    plugins = plugins or get_plugins()
    problems: list[str] = []
    selected: dict[str, Selected] = {}
    for kind, (section, field) in PLUGIN_FIELDS.items():
        sec = getattr(config, section)
        name = getattr(sec, field)
        try:
            plugin = plugins.get(kind, name)
            provider = plugins.registry(kind).entry(name).provider
        except PluginError as err:
            problems.append(f"{section}.{field}: {err}")
            continue
        options_field = OPTION_FIELDS.get(kind, "options")
        try:
            options = plugin.parse_options(getattr(sec, options_field))
        except ValidationError as err:
            problems.extend(validation_problems(err, f"{section}.{options_field}", getattr(plugin, "Options", None)))
            continue
        selected[kind] = Selected(kind=kind, plugin=plugin, options=options, provider=provider)
    problems += _model_problems(config, plugins)
    return selected, problems


_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _touches(problem: str, paths: set[str]) -> bool:
    """Whether ``problem`` names one of the dotted field ``paths``, a field inside one,
    or a section holding one."""
    named = set(_DOTTED.findall(problem)) | {problem.split(":", 1)[0].split("=", 1)[0].strip()}
    return any(n == p or n.startswith(p + ".") or p.startswith(n + ".") for n in named for p in paths)


def _drop(data: dict[str, Any], loc: tuple[Any, ...]) -> bool:
    """Delete the field at ``loc`` (a list, at its first index) from ``data``, so that its
    default stands in; False when there is nothing there to delete."""
    parts = []
    for part in loc:
        if not isinstance(part, str):
            break
        parts.append(part)
    node: Any = data
    for part in parts[:-1]:
        if not isinstance(node, dict) or not isinstance(node.get(part), dict):
            break
        node = node[part]
    else:
        if parts and isinstance(node, dict) and parts[-1] in node:
            del node[parts[-1]]
            return True
    return False


def _stand_in(data: dict[str, Any], err: ValidationError, dropped: set[str]) -> RunConfig | None:
    """The config with every field pydantic refused dropped (defaults standing in), to
    check the rest; None where dropping cannot make it valid. ``dropped`` gains the paths."""
    data = copy.deepcopy(data)
    for _ in range(4):
        locs = [tuple(p for p in e["loc"] if p != "function-after") for e in err.errors()]
        if not all(_drop(data, loc) for loc in locs):
            return None
        dropped |= {_fmt_loc(tuple(p for p in loc if isinstance(p, str))) for loc in locs}
        try:
            return RunConfig.model_validate(data)
        except ValidationError as again:
            err = again
    return None


def config_problems(
    data: dict[str, Any], plugins: Any = None, *, unresolved: tuple[str, ...] = ()
) -> tuple[RunConfig | None, dict[str, Selected], list[str]]:
    """Every problem of a config's ``data`` in one pass: unknown keys and bad values (the
    schema), unknown plugin names and bad plugin options, and the checks across fields.

    Where the schema refuses a field, the rest is checked with that field's default
    standing in, and a later problem that names a refused field is left out: it would be
    about a value the user did not write. ``unresolved`` are the paths of ``${VAR}``
    references that could not be resolved (reported by the caller), treated so.
    Returns ``(config, selected plugins, problems)``; config is None where the schema
    refused it and no stand-in could be made.
    """
    data = copy.deepcopy(data)
    dropped = {p for p in unresolved if _drop(data, tuple(re.sub(r"\[.*", "", p).split(".")))}
    problems: list[str] = []
    try:
        config: RunConfig | None = RunConfig.model_validate(data)
    except ValidationError as err:
        problems += validation_problems(err, model=RunConfig)
        config = _stand_in(data, err, dropped)
    if config is None:
        return None, {}, problems
    selected, later = _plugin_selection(config, plugins)
    later += cross_field_problems(config)
    if "task" in selected:
        later += _reward_turn_problems(config, selected["task"])
    later += _engine_problems(config, selected.get("engine"), selected.get("task"))
    later += _quantization_problems(config, selected.get("engine"))
    later += moe_problems(config, selected.get("task"), selected.get("engine"))
    later += expert_parallel_problems(config)
    later += reward_scoring_problems(config, selected.get("task"), selected.get("engine"))
    later += _truncation_problems(config, selected.get("loss"))
    problems += [p for p in later if not _touches(p, dropped)]
    return config, selected, problems


def _attention_selection(
    model: "ModelConfig", platform: str, plugins: Any = None
) -> tuple[tuple[str, Any, BaseModel] | None, list[str]]:
    """``((name, plugin, options), [])`` of ``model.attention`` on ``platform`` (``auto``
    resolved), or ``(None, problems)`` naming the field."""
    from grpo.core.plugins import get_plugins

    plugins = plugins or get_plugins()
    name = auto_attention(platform) if model.attention == "auto" else model.attention
    try:
        plugin = plugins.get("attention", name)
    except PluginError as err:
        return None, [f"model.attention: {err}"]
    try:
        options = plugin.parse_options(model.attention_options)
    except ValidationError as err:
        return None, validation_problems(err, "model.attention_options", getattr(plugin, "Options", None))
    problems = [f"model.attention={model.attention!r}: {p}" for p in plugin.check(platform=platform, options=options)]
    return (None, problems) if problems else ((name, plugin, options), [])


def attention_plugin(model: "ModelConfig", platform: str, plugins: Any = None) -> tuple[str, Any, BaseModel]:
    """``(name, plugin, options)`` of ``model.attention`` on ``platform`` (``auto``
    resolved); raises ConfigError naming the field for an unknown name, bad options or a
    platform the kernel cannot run on."""
    selection, problems = _attention_selection(model, platform, plugins)
    if problems:
        raise ConfigError("Invalid config:", problems=problems)
    return selection


def _model_problems(config: RunConfig, plugins: Any) -> list[str]:
    """``model.architecture`` names an installed model plugin, and a random preset's
    family when the model is random (a checkpoint's is checked when it is read)."""
    # ``auto`` is checked once the platform is known (resolve_layout, build_model).
    problems = [] if config.model.attention == "auto" else _attention_selection(config.model, "unknown", plugins)[1]
    return problems + _architecture_problems(config, plugins)


def _architecture_problems(config: RunConfig, plugins: Any) -> list[str]:
    name = config.model.architecture
    if name == "auto":
        return []
    try:
        plugins.get("model", name)
    except PluginError as err:
        return [f"model.architecture: {err}"]
    if config.model.source == "random":
        from grpo.models.presets import preset_family

        family = preset_family(config.model.random.preset)
        if family != name:
            return [
                f"model.architecture={name!r} but model.random.preset={config.model.random.preset!r} is a "
                f"{family} model; set model.architecture to {family!r} or 'auto'"
            ]
    return []


def cross_field_problems(config: RunConfig) -> list[str]:
    """Checks across sections that need no devices."""
    problems = []
    seqs = config.sequences_per_step
    mb = config.train.micro_batch_size
    group = "train.down_sampling.keep" if config.train.down_sampling.keep else "rollout.num_generations"
    if mb is not None and seqs % mb:
        problems.append(
            f"train.micro_batch_size={mb} must divide the sequences per step, train.prompts_per_step "
            f"({config.train.prompts_per_step}) x {group} ({config.group_size}) = {seqs}"
        )
    keep = config.train.down_sampling.keep
    if keep is not None and keep > config.rollout.num_generations:
        problems.append(
            f"train.down_sampling.keep={keep} must be at most rollout.num_generations={config.rollout.num_generations} "
            "(it keeps that many of each group's samples)"
        )
    mismatch = config.loss.mismatch
    if config.loss.objective in SEQUENCE_OBJECTIVES and mismatch is not None and mismatch.level == "token":
        problems.append(
            f"loss.mismatch.level=token with loss.objective={config.loss.objective}: GSPO weighs whole sequences (one ratio per "
            "sequence), so a per-token weight would reweigh tokens inside a sequence; use loss.mismatch.level=sequence"
        )
    overlong = config.task.overlong
    if overlong.buffer and overlong.buffer >= config.rollout.max_new_tokens:
        problems.append(
            f"task.overlong.buffer={overlong.buffer} must be < rollout.max_new_tokens={config.rollout.max_new_tokens} "
            "(the penalty starts buffer tokens before the length cap)"
        )
    longest = config.longest_sequence
    bin_length = config.train.packing.bin_length
    if config.train.packing.enabled and bin_length is not None and bin_length < longest:
        problems.append(
            f"train.packing.bin_length={bin_length} is shorter than the longest possible sequence, {longest} tokens "
            f"(rollout.max_prompt_length={config.rollout.max_prompt_length} + rollout.max_new_tokens={config.rollout.max_new_tokens}); a sequence is "
            f"never split, so set it to at least {longest} or leave it unset"
        )
    if config.loss.epsilon_low >= 1.0:
        problems.append(f"loss.epsilon_low={config.loss.epsilon_low} must be < 1 (the ratio's lower clip is 1 - epsilon_low)")
    return problems + _partial_rollout_problems(config)


def _partial_rollout_problems(config: RunConfig) -> list[str]:
    a = config.train.async_
    if not a.partial_rollouts:
        if a.on_weight_change != "continue":
            return [f"train.async.on_weight_change={a.on_weight_change} needs train.async.partial_rollouts=true (only "
                    "partial rollouts keep rows in flight across a weight change)"]
        return []
    if not a.enabled:
        return ["train.async.partial_rollouts=true needs train.async.enabled=true"]
    if config.train.dynamic_sampling.enabled or config.train.down_sampling.keep is not None:
        return ["train.async.partial_rollouts=true does not combine with train.dynamic_sampling or "
                "train.down_sampling (a batch is the first groups to finish)"]
    return []


def _engine_problems(config: RunConfig, engine: Selected | None, task: Selected | None = None) -> list[str]:
    """What the run asks of its rollout engine that the engine's plugin does not offer
    (:attr:`~grpo.core.contracts.RolloutEnginePlugin.streams`), or its rows cannot give:
    partial rollouts stream single-turn rows (a task with tools or an environment of its
    own rolls out multi-turn ones; the run's :class:`~grpo.engine.rollout.partial.PartialRollouts`
    refuses them alike)."""
    if not (config.train.async_.enabled and config.train.async_.partial_rollouts):
        return []
    from grpo.core.contracts import TaskPlugin

    if task is not None and (type(task.plugin).environment is not TaskPlugin.environment
                             or task.plugin.tools(options=task.options)):
        return [f"train.async.partial_rollouts=true needs single-turn rows: task {config.task.name!r} has tools or "
                "an environment of its own (multi-turn rollouts), which the partial-rollouts stream does not carry. "
                "Set train.async.partial_rollouts=false"]
    if engine is not None and not engine.plugin.streams:
        return [f"train.async.partial_rollouts=true needs rollout.engine: continuous, or another engine that streams "
                f"rows (rollout.engine={config.rollout.engine!r} rolls out whole batches)"]
    return []


def _quantization_problems(config: RunConfig, engine: Selected | None) -> list[str]:
    """``rollout.quantization`` against the engine and the LoRA base (grpo.core.config.engine)."""
    from grpo.core.config.engine import quantization_problems

    lora = config.model.lora
    return quantization_problems(config.rollout, None if engine is None else engine.plugin,
                                 base_quantization="none" if lora is None else lora.base_quantization)


def reward_scoring_problems(config: RunConfig, task: Selected | None, engine: Selected | None) -> list[str]:
    """``task.process_rewards`` names the task's rewards and has processes to run in;
    ``task.reward_scoring: overlap`` has an engine that streams rows, single-turn, and no
    partial rollouts (whose batches are scored as they are picked)."""
    t = config.task
    problems = []
    if t.process_rewards and not t.reward_processes:
        problems.append(f"task.process_rewards={t.process_rewards} needs task.reward_processes >= 1 (the child "
                        "processes they run in)")
    if t.reward_processes and not t.process_rewards:
        problems.append(f"task.reward_processes={t.reward_processes} runs nothing: name the rewards that run in "
                        "processes in task.process_rewards")
    if task is not None and t.process_rewards:
        known = list(task.plugin.reward_functions(options=task.options))
        stray = [n for n in t.process_rewards if n not in known]
        if stray:
            problems.append(f"task.process_rewards: task {t.name!r} has no reward named {', '.join(map(repr, stray))}; "
                            f"its rewards are {', '.join(known)}")
    if t.reward_scoring != "overlap":
        return problems
    if engine is not None and not engine.plugin.streams:
        problems.append(f"task.reward_scoring=overlap needs an engine that streams rows (rollout.engine: continuous); "
                        f"rollout.engine={config.rollout.engine!r} finishes a step's rows all at once")
    if config.train.async_.partial_rollouts:
        problems.append("task.reward_scoring=overlap does not combine with train.async.partial_rollouts=true (a "
                        "partial batch is scored as it is picked); use task.reward_scoring=after")
    if task is not None and task.plugin.tools(options=task.options):
        problems.append(f"task.reward_scoring=overlap scores single-turn rows; task {t.name!r} has tools (a multi-turn "
                        "rollout): use task.reward_scoring=after")
    return problems


def _truncation_problems(config: RunConfig, loss: Selected | None) -> list[str]:
    """``loss.truncated_policy`` with a truncating rollout needs a loss that computes
    truncated log-probs (:attr:`~grpo.core.contracts.LossPlugin.supports_truncation`);
    without top-k/top-p it is a no-op, not an error."""
    settings = config.loss_settings
    if loss is None or not settings.truncates or getattr(loss.plugin, "supports_truncation", False):
        return []
    return [f"loss.truncated_policy=true with rollout.top_k={config.rollout.top_k}, rollout.top_p={config.rollout.top_p}: "
            f"loss.impl={config.loss.impl!r} cannot compute log-probs under the truncation (the fused pallas kernel "
            "keeps no logits to filter); use loss.impl=jax, or set loss.truncated_policy=false"]


def _hf_fields(config: RunConfig) -> dict[str, Any] | None:
    """The model's HF config fields: a random preset's, a local checkpoint's config.json, or
    a known hub id's preset (None: another hub id not on disk, known only once downloaded)."""
    model = config.model
    if model.source == "random":
        from grpo.models.presets import preset_hf_dict

        try:
            return preset_hf_dict(model.random.preset, model.random.overrides)
        except Exception:  # noqa: BLE001 (the preset's own check reports it)
            return None
    path = Path(str(model.path)) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None
    if data is None and not path.parent.exists():  # a hub id with a built-in preset (Qwen/Qwen3-30B-A3B)
        from grpo.models.presets import hub_preset, preset_hf_dict

        name = hub_preset(str(model.path))
        return preset_hf_dict(name, {}) if name else None
    return data if isinstance(data, dict) else None


def expert_parallel_problems(config: RunConfig) -> list[str]:
    """``mesh.expert_parallel`` needs a model with experts, and must divide them. A
    checkpoint not on disk is checked when read."""
    ep = config.mesh.expert_parallel
    fields = _hf_fields(config) if ep > 1 else None
    if fields is None:
        return []
    experts = fields.get("num_experts") or fields.get("num_local_experts")
    if not experts:
        where = (f"model.random.preset={config.model.random.preset!r}" if config.model.source == "random"
                 else f"model.path={config.model.path!r}")
        return [f"mesh.expert_parallel={ep} needs a mixture-of-experts model, but {where} is dense (model_type "
                f"{fields.get('model_type')!r}, no experts); set mesh.expert_parallel: 1"]
    if experts % ep:
        return [f"mesh.expert_parallel={ep} does not divide the model's {experts} experts; use a divisor of "
                f"{experts}"]
    return []


def moe_problems(config: RunConfig, task: Selected | None = None, engine: Selected | None = None) -> list[str]:
    """``model.moe`` needs a mixture-of-experts model; router replay (recording the
    rollout's experts) needs an engine that records them
    (:attr:`~grpo.core.contracts.RolloutEnginePlugin.records_routing`: static and
    continuous), in every mode (sync, async, partial rollouts, several processes); with a
    multi-turn task one that records a conversation's (``records_multi_turn_routing``:
    static); the router losses' per-micro-batch weights are exact for
    ``loss.aggregation: token_mean``. A checkpoint not on disk is checked when read."""
    moe = config.model.moe
    if not moe.active:
        return []
    on = [f for f, v in (("router_replay", moe.router_replay != "off"), ("load_balancing_loss", moe.load_balancing_loss > 0),
                         ("router_z_loss", moe.router_z_loss > 0)) if v]
    shown = ", ".join(f"model.moe.{f}={getattr(moe, f)}" for f in on)
    fields = _hf_fields(config)
    if fields is not None and not (fields.get("num_experts") or fields.get("num_local_experts")):
        where = (f"model.random.preset={config.model.random.preset!r}" if config.model.source == "random"
                 else f"model.path={config.model.path!r}")
        return [f"{shown} needs a mixture-of-experts model, but {where} is dense (model_type "
                f"{fields.get('model_type')!r}, no experts); use one with experts (e.g. preset tiny-moe) or turn "
                f"{' and '.join('model.moe.' + f for f in on)} off"]
    problems = []
    if moe.records:
        what = f"model.moe.router_replay={moe.router_replay}"
        if engine is not None and not engine.plugin.records_routing:
            problems.append(f"{what} needs an engine that records the routed experts (rollout.engine: static or "
                            f"continuous; rollout.engine={config.rollout.engine!r} does not)")
        multi_turn = task is not None and bool(task.plugin.tools(options=task.options))
        if multi_turn and engine is not None and engine.plugin.records_routing and \
                not engine.plugin.records_multi_turn_routing:
            problems.append(f"{what} with a multi-turn task (task {config.task.name!r} has tools) needs "
                            f"rollout.engine: static (rollout.engine={config.rollout.engine!r} records the experts "
                            "of single-turn rows only)")
    losses = [f for f in on if f != "router_replay"]
    if losses and config.loss.aggregation != "token_mean":
        problems.append(f"{', '.join('model.moe.' + f for f in losses)} need{'s' if len(losses) == 1 else ''} "
                        f"loss.aggregation: token_mean (got "
                        f"{config.loss.aggregation!r}: the router losses are weighted by each micro-batch's tokens)")
    return problems


def _reward_turn_problems(config: RunConfig, task: Selected) -> list[str]:
    """``train.advantage.reward_turns`` names rewards of the task (or task.overlong's)."""
    named = config.train.advantage.reward_turns
    if not named:
        return []
    known = list(task.plugin.reward_functions(options=task.options)) + ["overlong"]
    known += [m.name for m in config.task.model_rewards]
    stray = sorted(set(named) - set(known))
    if not stray:
        return []
    return [
        f"train.advantage.reward_turns: task {config.task.name!r} has no reward named {', '.join(map(repr, stray))}; "
        f"its rewards are {', '.join(known)}"
    ]

def model_reward_process_problems(config: RunConfig, processes: int) -> list[str]:
    """``task.model_rewards`` over several processes: not run there yet, so refused (a
    synchronous run's ``resolve_layout`` and an asynchronous run split by processes,
    :func:`grpo.engine.parallel.split.check_split`, ask alike)."""
    if processes <= 1 or not config.task.model_rewards:
        return []
    named = ", ".join(f"{m.name!r} ({m.kind})" for m in config.task.model_rewards)
    return [f"task.model_rewards ({named}) run on one process only so far: over several processes ({processes} "
            "here) each would load and run its own copy on its rollout devices, which no test has run; run on one "
            "process, or score with a reward function instead"]


def resolve_layout(config: RunConfig, topology: Topology, *, plugins: Any = None) -> MeshLayout:
    """The mesh layout for this topology, after every topology-dependent check."""
    selected = select_plugins(config, plugins)
    mesh = selected["mesh"]
    try:
        layout = mesh.plugin.resolve(topology, mesh.options)
    except UserError as err:
        raise ConfigError("Invalid config for this topology:", problems=[f"mesh: {err}"]) from None
    problems: list[str] = []
    try:
        layout = layout.with_expert_axis(config.mesh.expert_parallel)
    except ValueError as err:
        problems.append(f"{err} (policy {config.mesh.policy!r}): the expert axis is carved out of fsdp")
    problems += _attention_selection(config.model, topology.platform, plugins)[1]
    from grpo.core.config.engine import quantization_platform_problems

    problems += quantization_platform_problems(config.rollout, topology.platform)
    style = selected["rollout"]
    problems += style.plugin.check(layout=layout, topology=topology, options=style.options)
    loss = selected["loss"]
    problems += loss.plugin.check(layout=layout, options=loss.options)
    shards = style.plugin.rollout_shards(layout=layout, topology=topology, options=style.options)
    seqs = config.rollout_sequences_per_step
    if seqs % shards:
        problems.append(
            f"the rollout batch of {seqs} sequences (train.prompts_per_step={config.train.prompts_per_step} x "
            f"rollout.num_generations={config.rollout.num_generations}) must divide evenly over the {shards} "
            f"rollout shards of rollout.style={config.rollout.style} on mesh {layout.shape}"
        )
    keep = config.train.down_sampling.keep
    if keep is not None and config.sequences_per_step % shards:
        problems.append(
            f"the down-sampled batch of {config.sequences_per_step} sequences (train.prompts_per_step="
            f"{config.train.prompts_per_step} x train.down_sampling.keep={keep}) must divide evenly over the "
            f"{shards} rollout shards of rollout.style={config.rollout.style} on mesh {layout.shape} (it is "
            "gathered in the rollout's layout)"
        )
    # The prompts themselves need not divide over the rollout shards: prefill shards them
    # over the largest part of the batch axes they divide (replicated at worst), and the
    # decode batch of prompts x generations is what is split. Each process feeds its own
    # prompts, though.
    problems += model_reward_process_problems(config, topology.process_count)
    prompts = config.train.prompts_per_step
    if prompts % topology.process_count:
        problems.append(
            f"train.prompts_per_step={prompts} must divide evenly over the {topology.process_count} processes: "
            "each process reads and scores its own prompts"
        )
    train_shards = layout.data
    mb = config.micro_batch_size
    if mb % train_shards:
        problems.append(
            f"the micro-batch of {mb} sequences (train.micro_batch_size, or the whole batch when unset) must "
            f"divide evenly over dp x fsdp{' x ep' if layout.ep > 1 else ''} = {train_shards} devices on mesh "
            f"{layout.shape}"
        )
    if problems:
        raise ConfigError("Invalid config for this topology:", problems=problems)
    return layout
