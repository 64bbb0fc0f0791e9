"""``grpo plan --lengths``: the packed bins a step of a length profile needs, and what the
passes over the batch cost on them beside the padded figures.

The bins come from the packing the trainer runs (:mod:`grpo.engine.training.packing`):
first-fit decreasing of each row's real tokens (prompt + completion) into bins of
``bin_length``, then the step's micro-batch schedule
(:func:`~grpo.engine.training.packing.micro_schedule`): ``m`` micro-batches of ``per``
bins per device, ``m x devices x per`` the smallest at least the bins used with ``per``
within the configured micro-batch's memory. A step's rows are drawn from the profile
(:func:`~grpo.engine.planning.profiles.draw`, seeded) :data:`DRAWS` times; the plan
compiles the update at the widest ``per`` of the draws (what the run must fit: memory
depends on ``per``, not ``m``) and counts the costs of each draw's own schedule (their
mean is the roofline). Each ``per`` of the schedule space and each head width ``K`` of
it (:func:`~grpo.engine.training.packing.head_widths`) is one compiled shape of each
packed pass: the compile bound.

Costs are :func:`~grpo.engine.planning.costs.training_costs` on
:func:`~grpo.engine.planning.costs.packed_work`: a packed bin runs all its slots through
the layers, the loss's head runs on the draw's head layout (``m x K`` slots a device: the
slots that predict a completion token, rounded up), and a segment-aware attention kernel (``splash``,
``pallas_gpu``) computes each sequence's own square only. Weight reads (and the FSDP
gathers in the compiled update's micro-batch loop) are one pass per micro-batch of the
draw's schedule. Valid tokens are the completion tokens the loss trains on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from grpo.core.errors import UserError
from grpo.engine.planning.costs import Cost, packed_work, training_costs
from grpo.engine.planning.profiles import LengthProfile, draw, summary

DRAWS = 8
SEGMENT_KERNELS = ("splash", "pallas_gpu")  # attention kernels that skip the blocks between segments
PACKED_PROGRAMS = ("reference", "policy_logprobs", "update")  # the passes over a finished batch


@dataclasses.dataclass(frozen=True)
class BinPlan:
    """The bins of a profile's steps for one config."""

    profile: dict[str, Any]  # profiles.summary
    bin_length: int
    max_per: int  # the most bins per device per micro-batch (the configured micro-batch's memory)
    rows: int  # sequences per step
    devices: int  # the update's batch shards
    # per draw: bins_used, bins (computed: m x devices x per), micro_batches, per,
    # real_tokens, valid_tokens, square_sum, efficiency
    draws: list[dict[str, Any]]
    schedules: dict[int, list[tuple[int, int]]]  # the schedule space by per (packing.schedule_shapes)
    micro_batches: int  # the config's (the padded update's)
    head_buckets: int = 8  # head widths per per (the run's shape grid: RunPrograms.shape_grid)

    @property
    def bin_shapes(self) -> int:
        """How many bin layouts a run can compile: one per ``per``."""
        return len(self.schedules)

    @property
    def compile_bound(self) -> int:
        """How many shapes of each packed pass a run can compile: one per ``per`` and head
        width ``K`` of it (at most ``head_buckets`` per ``per``)."""
        from grpo.engine.training.packing import head_widths

        return sum(len(head_widths(slots=per * self.bin_length, buckets=self.head_buckets)) for per in self.schedules)

    @property
    def per(self) -> int:
        """The widest micro-batch of the draws, in bins per device (the compiled update's)."""
        return max(d["per"] for d in self.draws)

    @property
    def bins(self) -> int:
        """The most bins a draw computes."""
        return max(d["bins"] for d in self.draws)

    def mean(self, key: str) -> float:
        return float(np.mean([d[key] for d in self.draws]))


def bin_length(config: Any, prompt_length: int) -> int:
    """The run's bin length (``train.packing.bin_length``, else the longest sequence)."""
    length = getattr(config, "bin_length", None)
    return int(length) if length else prompt_length + config.rollout.max_new_tokens


def plan_bins(programs: Any, profile: LengthProfile, *, prompt_length: int, draws: int = DRAWS,
              seed: int = 0) -> BinPlan:
    """Pack ``draws`` steps of the profile and schedule their micro-batches as the trainer
    does (:meth:`~grpo.engine.programs.RunPrograms.pack_plan`)."""
    from grpo.engine.training.packing import max_bins_per_device, schedule_packing, schedule_shapes, shape_grid

    cfg, layout = programs.config, programs.layout
    rows, cap = cfg.sequences_per_step, cfg.rollout.max_new_tokens
    devices = layout.data
    length = bin_length(cfg, prompt_length)
    if length < prompt_length + cap:
        raise UserError(
            f"train.packing.bin_length {length} is below one whole sequence (prompt {prompt_length} + "
            f"rollout.max_new_tokens {cap}): a sequence is never split, so a bin must hold the longest one."
        )
    max_per = max_bins_per_device(micro_batch_size=cfg.micro_batch_size, devices=devices,
                                  sequence_length=prompt_length + cap, bin_length=length)
    # The run's shape grid (on the plan's target, an accelerator) at this prompt length's max_per.
    pers, buckets = shape_grid(cfg.train.packing, max_per=max_per, cpu=False)
    out = []
    for i in range(draws):
        prompts, completions = draw(profile, rows=rows, cap=cap, prompt_length=prompt_length, seed=seed + i)
        seq = prompts + completions
        plan = schedule_packing(seq, bin_length=length, devices=devices, max_per=max_per, rows=rows,
                                completions=completions, pers=pers, head_buckets=buckets)
        m, per, bins = plan.micro_batches, plan.per, plan.bins
        out.append({
            "bins_used": plan.used, "bins": bins, "micro_batches": m, "per": per, "head": plan.head,
            "head_tokens": m * devices * plan.head, "real_tokens": int(seq.sum()),
            "valid_tokens": int(completions.sum()), "square_sum": float(np.sum(seq.astype(np.float64) ** 2)),
            "efficiency": float(seq.sum() / (bins * length)),
        })
    return BinPlan(
        profile=summary(profile, cap=cap, prompt_length=prompt_length), bin_length=length, max_per=max_per,
        rows=rows, devices=devices, draws=out,
        schedules=schedule_shapes(rows=rows, devices=devices, max_per=max_per, pers=pers),
        micro_batches=rows // cfg.micro_batch_size, head_buckets=buckets,
    )


def packed_costs(programs: Any, arch: Any, chip: Any, bp: BinPlan, attention: str) -> dict[str, Cost]:
    """The mean over the draws of each packed pass's cost, per device, each draw at its
    own schedule (its bins, and one weight read per pass per micro-batch)."""
    per_draw = []
    for d in bp.draws:
        work = packed_work(bins=d["bins"] / bp.devices, bin_length=bp.bin_length,
                           square_sum=d["square_sum"] / bp.devices, segment_attention=attention in SEGMENT_KERNELS,
                           micro_batches=d["micro_batches"], head_tokens=d["head_tokens"] / bp.devices)
        per_draw.append(training_costs(programs, arch, chip, work))
    return {
        name: Cost(*(float(np.mean([getattr(c[name], f) for c in per_draw])) for f in ("flops", "bytes", "roofline_s")))
        for name in per_draw[0]
    }


def scheduled_collectives(collectives: list[Any] | None, *, micro_batches: float) -> list[Any] | None:
    """A packed pass's compiled collectives at ``micro_batches`` micro-batches: those in
    its micro-batch loop (a traced trip count, which the HLO reader counts once:
    :attr:`~grpo.engine.planning.hlo.Collective.unknown_trips`) run once per micro-batch,
    the rest once. None without HLO."""
    if collectives is None:
        return None
    return [dataclasses.replace(op, executions=op.executions * micro_batches) if op.unknown_trips else op
            for op in collectives]


def scheduled_ici_s(collectives: list[Any] | None, *, micro_batches: float, chip: Any,
                    slice_of: list[int]) -> float | None:
    """The packed update's ICI time at ``micro_batches`` micro-batches
    (:func:`scheduled_collectives`); None without HLO."""
    from grpo.engine.planning import hlo

    ops = scheduled_collectives(collectives, micro_batches=micro_batches)
    if ops is None:
        return None
    return sum(op.total_bytes for op in ops if not hlo.crosses(op, slice_of)) / (chip.ici_bandwidth / 2)


def packed_report(bp: BinPlan, *, padded: dict[str, Any], packed: dict[str, Cost], ppo_epochs: int,
                  update_entry: dict[str, Any], update_source: str, hbm: int) -> dict[str, Any]:
    """The ``packing`` section of a plan: the bins, each packed pass beside its padded
    figure, the step's roofline and valid tokens/s both ways, and the packed update's memory.

    ``padded``: the plan's program entries; ``packed``: :func:`packed_costs`;
    ``update_entry``: the compiled packed update's entry (its ``peak_bytes``, and its
    ``ici_s`` at the draws' micro-batches: :func:`scheduled_ici_s`)."""
    passes = {}
    for name, cost in packed.items():
        pad = padded[name]
        # Communication: the packed pass gathers the same weights per micro-batch as the
        # padded one, once per micro-batch of the schedule (the update: its compiled HLO,
        # scheduled_ici_s; else the padded pass's ICI time scaled to the micro-batches).
        ici = update_entry.get("ici_s") if name == "update" else None
        if ici is None and pad.get("ici_s") is not None:
            ici = pad["ici_s"] * bp.mean("micro_batches") / bp.micro_batches
        roof = max(cost.roofline_s, ici or 0.0)
        passes[name] = {
            "padded_flops": pad["flops"], "packed_flops": cost.flops,
            "padded_roofline_s": pad["roofline_s"], "packed_roofline_s": roof,
            "ratio": roof / pad["roofline_s"] if pad["roofline_s"] else None,
        }
    times = {n: ppo_epochs if n == "update" else 1 for n in passes}
    padded_step = sum(p["roofline_s"] * (ppo_epochs if n == "update" else 1) for n, p in padded.items()
                      if n not in ("eval_prefill", "eval_start", "eval_decode", "eval_append"))
    packed_step = padded_step - sum(times[n] * (p["padded_roofline_s"] - p["packed_roofline_s"])
                                    for n, p in passes.items())
    valid = bp.mean("valid_tokens")
    peak = update_entry.get("peak_bytes")
    bins_chip = bp.bins // bp.devices
    per_micro = bp.per
    # Packing density: sequences per used bin (the schedule's extra bins are empty).
    seqs_per_bin = bp.rows / bp.mean("bins_used")
    return {
        "profile": bp.profile,
        "bin_length": bp.bin_length,
        "max_bins_per_device": bp.max_per,
        "compile_bound": bp.compile_bound,
        "bin_shapes": bp.bin_shapes,
        "schedules": {str(per): [list(s) for s in pairs] for per, pairs in bp.schedules.items()},
        "draws": [{k: d[k] for k in ("bins_used", "bins", "micro_batches", "per", "head", "efficiency",
                                     "valid_tokens")}
                  for d in bp.draws],
        "bins": bp.bins,
        "bins_per_device": bins_chip,
        "efficiency": bp.mean("real_tokens") / (bp.mean("bins") * bp.bin_length),
        "valid_tokens_per_step": valid,
        "passes": passes,
        "roofline_step_padded_s": padded_step,
        "roofline_step_packed_s": packed_step,
        "valid_tokens_per_s_padded": valid / padded_step if padded_step else None,
        "valid_tokens_per_s_packed": valid / packed_step if packed_step else None,
        "update_valid_tokens_per_s_padded": valid / (ppo_epochs * passes["update"]["padded_roofline_s"]),
        "update_valid_tokens_per_s_packed": valid / (ppo_epochs * passes["update"]["packed_roofline_s"]),
        # The widest micro-batch of the update on one device, in bins and in sequences
        # (the profile's mean sequences per used bin).
        "micro_batch": {"bins_per_device": per_micro, "bin_length": bp.bin_length,
                        "sequences_per_device": per_micro * seqs_per_bin, "sequences_per_bin": seqs_per_bin},
        "update_program": update_source,
        "update_peak_bytes": peak,
        "update_compiler_error": update_entry.get("compiler_error"),
        "update_fits": peak is not None and peak <= hbm and update_entry.get("compiler_error") is None,
    }


__all__ = ["BinPlan", "DRAWS", "PACKED_PROGRAMS", "bin_length", "packed_costs", "packed_report", "plan_bins",
           "scheduled_collectives", "scheduled_ici_s"]
