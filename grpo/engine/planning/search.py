"""``grpo plan --search FIELD``: the largest value of a config field whose plan fits.

Under a length profile (``--lengths``) a plan fits when it fits packed (its ``packing``
section's ``fits``: the update compiled at the profile's bins): the micro-batch searched
is then a number of bins, reported in sequences through the profile.

Doubling over the field's valid values (those the topology can lay out), then bisection
between the last that fits and the first that does not; each try is one
:meth:`~grpo.engine.planning.plan.Planner.plan` (its compiled programs are cached, so a
try recompiles only the programs the field changes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo.core.config import RunConfig, load_config, resolve_layout
from grpo.core.errors import ConfigError, UserError

if TYPE_CHECKING:
    from grpo.engine.planning.plan import Planner

SEARCH_FIELDS = ("train.micro_batch_size", "train.prompts_per_step", "train.async.rollout_devices")


def split_candidates(config: RunConfig, processes: int, per_process: int) -> tuple[list[int], list[list[Any]]]:
    """The splits ``--search train.async.rollout_devices`` plans for ``config`` on
    ``processes`` x ``per_process`` devices: every one the run's own check accepts
    (:func:`~grpo.engine.parallel.split.validate_split`: whole processes, the features a
    split by processes carries, both sides laid out), and ``[[k, why], ...]`` for those it
    refuses, with the run's message."""
    from grpo.engine.parallel.split import validate_split

    n = processes * per_process
    ok, refused = [], []
    for k in range(1, n):
        if processes > 1 and k % per_process:
            continue  # a process on both sides: never a candidate
        a = config.train.async_.model_copy(update={"enabled": True, "rollout_devices": k})
        try:
            validate_split(config.model_copy(update={"train": config.train.model_copy(update={"async_": a})}),
                           processes, per_process)
        except UserError as err:
            refused.append([k, str(err)])
            continue
        ok.append(k)
    return ok, refused


def search_split(config_path: str, overrides: list[str], planner: Planner, lengths: Any = None) -> dict[str, Any]:
    """``--search train.async.rollout_devices``: every split the topology allows (whole
    hosts on several hosts) planned with ``train.async.enabled``; the best is the one with
    the shortest pipelined step (with partial rollouts where the plan has them). A split a
    side cannot lay out, or that the run would refuse (its own check,
    :func:`~grpo.engine.parallel.split.check_split`), is skipped (``tried`` says why)."""
    from grpo.engine.planning.plan import synchronous

    base = load_config(config_path, list(overrides) + ["train.async.enabled=true"])
    n, per = len(planner.devices), planner.topo.local_device_count
    values, tried = split_candidates(base, planner.topo.process_count, per)
    if not values:  # the run would refuse every split: said before compiling anything
        raise UserError(f"--search train.async.rollout_devices: no split of {planner.topology.name}'s {n} devices can "
                        "run this config: " + "; ".join(str(t[1]) for t in tried))
    sync = synchronous(base)
    report = planner.plan(sync, lengths)  # compiled once for every split
    sections: dict[int, dict[str, Any]] = {}
    for k in values:
        try:
            sec = planner.plan_async(sync, lengths, report, rollout_devices=k, checked=base)
        except UserError as err:
            tried.append([k, str(err)])
            continue
        sections[k] = sec
        tried.append([k, sec.get("pipelined_partial_step_s", sec["pipelined_step_s"])])
    if not sections:
        raise UserError(f"--search train.async.rollout_devices: no split of {planner.topology.name}'s {n} devices can "
                        "run this config: " + "; ".join(str(t[1]) for t in tried))
    best = min(sections, key=lambda k: sections[k].get("pipelined_partial_step_s", sections[k]["pipelined_step_s"]))
    plan = dict(report)
    plan["async"] = sections[best]
    return {"field": "train.async.rollout_devices", "max_fitting": best, "best": best, "tried": tried,
            "candidates": values, "plan": plan}


def _candidates_micro(config: RunConfig, planner: Planner) -> list[int]:
    seqs = config.sequences_per_step
    out = []
    for mb in range(1, seqs + 1):
        if seqs % mb:
            continue
        try:
            resolve_layout(config.model_copy(update={"train": config.train.model_copy(update={"micro_batch_size": mb})}),
                           planner.topo)
        except ConfigError:
            continue
        out.append(mb)
    return out


def search(config_path: str, overrides: list[str], field: str, planner: Planner,
           limit: int = 1 << 16, lengths: Any = None) -> dict[str, Any]:
    """The largest value of ``field`` whose plan fits (packed under the length profile
    ``lengths``): doubling over the valid values, then bisection between the last that
    fits and the first that does not."""
    if field not in SEARCH_FIELDS:
        raise UserError(f"--search {field!r}: searchable fields are {', '.join(SEARCH_FIELDS)}.")
    if field == "train.async.rollout_devices":
        return search_split(config_path, overrides, planner, lengths)
    base = load_config(config_path, overrides)
    reports: dict[int, dict[str, Any]] = {}
    tried: list[list[Any]] = []

    def valid(value: int) -> RunConfig | None:
        try:
            cfg = load_config(config_path, list(overrides) + [f"{field}={value}"])
            resolve_layout(cfg, planner.topo)
            return cfg
        except ConfigError:
            return None

    def fits(value: int) -> bool:
        cfg = valid(value)
        rep = planner.plan(cfg, lengths)
        reports[value] = rep
        ok = rep["packing"]["fits"] if lengths is not None else rep["fits"]
        tried.append([value, ok])
        return ok

    if field == "train.micro_batch_size":
        values = _candidates_micro(base, planner)
    else:
        values = [p for p in range(1, limit + 1) if valid_prompts(base, p, planner)][:4096]
    if not values:
        raise UserError(f"--search {field}: no value is valid for this config on {planner.topology.name}.")
    # Start at the config's value; double up while it fits (halve down while it does not),
    # then bisect between the last value that fits and the first that does not.
    current = base.micro_batch_size if field == "train.micro_batch_size" else base.train.prompts_per_step
    i = values.index(current) if current in values else 0
    lo: int | None = None  # index of the largest value known to fit
    hi: int | None = None  # index of the smallest value known not to fit
    if fits(values[i]):
        lo = i
        while hi is None and lo < len(values) - 1:
            j = next((k for k in range(lo + 1, len(values)) if values[k] >= 2 * values[lo]), len(values) - 1)
            if fits(values[j]):
                lo = j
            else:
                hi = j
    else:
        hi = i
        while lo is None and hi > 0:
            j = max((k for k in range(hi) if values[k] <= values[hi] // 2), default=0)
            if fits(values[j]):
                lo = j
            else:
                hi = j
    if lo is not None and hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(values[mid]):
                lo = mid
            else:
                hi = mid
    best = values[lo] if lo is not None else None
    return {
        "field": field,
        "max_fitting": best,
        "tried": tried,
        "candidates": values,
        "plan": reports[best] if best is not None else reports[values[0]],
    }


def valid_prompts(config: RunConfig, prompts: int, planner: Planner) -> bool:
    cfg = config.model_copy(update={"train": config.train.model_copy(update={"prompts_per_step": prompts})})
    mb = cfg.train.micro_batch_size
    if mb is not None and cfg.sequences_per_step % mb:
        return False
    try:
        resolve_layout(cfg, planner.topo)
    except ConfigError:
        return False
    return True


__all__ = ["SEARCH_FIELDS", "search", "search_split", "valid_prompts"]
