"""``grpo plan --lengths``: the packed bins a step of a length profile needs, and what the
passes over the batch cost on them beside the padded figures.

The bins come from the packing the trainer runs (:mod:`grpo.engine.training.packing`):
first-fit decreasing of each row's real tokens (prompt + completion) into bins of
``bin_length``, the bin count rounded up to a multiple of ``unit`` (micro-batches x the
update's batch shards), so each micro-batch gives every device the same number of bins.
A step's rows are drawn from the profile (:func:`~grpo.engine.planning.profiles.draw`,
seeded) :data:`DRAWS` times; the plan compiles the largest rounded bin count of the
draws (what the run must fit) and counts the costs of each draw (their mean is the
roofline).

Costs are :func:`~grpo.engine.planning.costs.training_costs` on
:func:`~grpo.engine.planning.costs.packed_work`: a packed bin runs all its slots through
the layers and the loss's head, and a segment-aware attention kernel (``splash``,
``pallas_gpu``) computes each sequence's own square only. Weight reads stay one pass per
micro-batch, as padded. Valid tokens are the completion tokens the loss trains on.
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
    unit: int  # the bin count's rounding multiple
    rows: int  # sequences per step
    devices: int  # the update's batch shards
    draws: list[dict[str, Any]]  # per draw: bins_used, bins, real_tokens, valid_tokens, square_sum, efficiency
    compile_bound: int  # how many bin counts a run can compile

    @property
    def bins(self) -> int:
        """The compiled bin count: the largest of the draws."""
        return max(d["bins"] for d in self.draws)

    def mean(self, key: str) -> float:
        return float(np.mean([d[key] for d in self.draws]))


def bin_length(config: Any, prompt_length: int) -> int:
    """The run's bin length (``train.packing.bin_length``, else the longest sequence)."""
    length = getattr(config, "bin_length", None)
    return int(length) if length else prompt_length + config.rollout.max_new_tokens


def plan_bins(programs: Any, profile: LengthProfile, *, prompt_length: int, draws: int = DRAWS,
              seed: int = 0) -> BinPlan:
    """Pack ``draws`` steps of the profile as the trainer packs a step."""
    from grpo.engine.training.packing import bin_count_sizes, first_fit_decreasing, round_bins

    cfg, layout = programs.config, programs.layout
    rows, cap = cfg.sequences_per_step, cfg.rollout.max_new_tokens
    devices = layout.dp * layout.fsdp
    # The trainer's rounding (RunPrograms.bin_unit): micro-batches x the update's batch shards.
    unit = getattr(programs, "bin_unit", None) or cfg.sequences_per_step // cfg.micro_batch_size * devices
    length = bin_length(cfg, prompt_length)
    if length < prompt_length + cap:
        raise UserError(
            f"train.packing.bin_length {length} is below one whole sequence (prompt {prompt_length} + "
            f"rollout.max_new_tokens {cap}): a sequence is never split, so a bin must hold the longest one."
        )
    out = []
    for i in range(draws):
        prompts, completions = draw(profile, rows=rows, cap=cap, prompt_length=prompt_length, seed=seed + i)
        seq = prompts + completions
        used = len(first_fit_decreasing(seq, bin_length=length))
        bins = round_bins(used, unit=unit)
        out.append({
            "bins_used": used, "bins": bins, "real_tokens": int(seq.sum()), "valid_tokens": int(completions.sum()),
            "square_sum": float(np.sum(seq.astype(np.float64) ** 2)),
            "efficiency": float(seq.sum() / (bins * length)),
        })
    return BinPlan(
        profile=summary(profile, cap=cap, prompt_length=prompt_length), bin_length=length, unit=unit, rows=rows,
        devices=devices, draws=out, compile_bound=len(bin_count_sizes(rows=rows, unit=unit)),
    )


def packed_costs(programs: Any, arch: Any, chip: Any, bp: BinPlan, attention: str) -> dict[str, Cost]:
    """The mean over the draws of each packed pass's cost, per device."""
    per_draw = []
    for d in bp.draws:
        work = packed_work(bins=d["bins"] / bp.devices, bin_length=bp.bin_length,
                           square_sum=d["square_sum"] / bp.devices, segment_attention=attention in SEGMENT_KERNELS)
        per_draw.append(training_costs(programs, arch, chip, work))
    return {
        name: Cost(*(float(np.mean([getattr(c[name], f) for c in per_draw])) for f in ("flops", "bytes", "roofline_s")))
        for name in per_draw[0]
    }


def packed_report(bp: BinPlan, *, padded: dict[str, Any], packed: dict[str, Cost], ppo_epochs: int,
                  update_entry: dict[str, Any], update_source: str, hbm: int) -> dict[str, Any]:
    """The ``packing`` section of a plan: the bins, each packed pass beside its padded
    figure, the step's roofline and valid tokens/s both ways, and the packed update's memory.

    ``padded``: the plan's program entries; ``packed``: :func:`packed_costs`;
    ``update_entry``: the compiled packed update's entry (its ``peak_bytes``; its
    communication is the padded update's when it has none of its own)."""
    passes = {}
    for name, cost in packed.items():
        pad = padded[name]
        # Communication: the packed pass gathers the same weights per micro-batch as the
        # padded one (its HLO when compiled, else the padded pass's ICI time).
        ici = update_entry.get("ici_s") if name == "update" and update_entry.get("ici_s") is not None else pad.get("ici_s")
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
    per_micro = bins_chip // (bp.unit // bp.devices)
    # Packing density: sequences per used bin (the rounding's extra bins are empty).
    seqs_per_bin = bp.rows / bp.mean("bins_used")
    return {
        "profile": bp.profile,
        "bin_length": bp.bin_length,
        "bin_unit": bp.unit,
        "compile_bound": bp.compile_bound,
        "draws": [{k: d[k] for k in ("bins_used", "bins", "efficiency", "valid_tokens")} for d in bp.draws],
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
        # One micro-batch of the update on one device, in bins and in sequences (the
        # profile's mean sequences per used bin).
        "micro_batch": {"bins_per_device": per_micro, "bin_length": bp.bin_length,
                        "sequences_per_device": per_micro * seqs_per_bin, "sequences_per_bin": seqs_per_bin},
        "update_program": update_source,
        "update_peak_bytes": peak,
        "update_compiler_error": update_entry.get("compiler_error"),
        "update_fits": peak is not None and peak <= hbm and update_entry.get("compiler_error") is None,
    }


__all__ = ["BinPlan", "DRAWS", "PACKED_PROGRAMS", "bin_length", "packed_costs", "packed_report", "plan_bins"]
