"""The plan's headline: one step's roofline (:func:`step_roofline`, every program of a step
once, the update ``ppo_epochs`` times), the rollout in it costed the way the config's
engine runs (:func:`rollout_headline`), and a synchronous step's figure an asynchronous
split is compared with (:func:`synchronous_step`).
"""

from __future__ import annotations

from typing import Any

from grpo.engine.planning.costs import Cost
from grpo.engine.planning.quantized import quantization_headline

EVAL_PROGRAMS = ("eval_prefill", "eval_start", "eval_decode", "eval_append", "eval_quantize")


def step_roofline(programs: dict[str, Any], costs: dict[str, Cost], ppo_epochs: int) -> tuple[float, float]:
    """One step's roofline with communication and without: every program but the eval
    ones once, the update ``ppo_epochs`` times."""
    with_comm = sum(
        p["roofline_s"] * (ppo_epochs if n == "update" else 1) for n, p in programs.items() if n not in EVAL_PROGRAMS
    )
    no_comm = sum(
        costs[n].roofline_s * (ppo_epochs if n == "update" else 1) for n in programs if n not in EVAL_PROGRAMS
    )
    return with_comm, no_comm


def synchronous_step(report: dict[str, Any]) -> float:
    """One synchronous step's roofline, as the plan's headline costs it
    (:func:`rollout_headline`): packed under a length profile, the rollout at the config's
    engine."""
    return report["packing"]["roofline_step_packed_s"] if report.get("packing") else report["roofline_step_s"]


def rollout_headline(report: dict[str, Any], *, engine: str) -> dict[str, Any]:
    """``report`` with its step roofline (``roofline_step_s``, and under a length profile
    the padded and packed steps and their valid tokens/s) costing the rollout with the
    config's ``engine``, and ``step_rollout`` saying how.

    The programs' costs model every row to the cap. The continuous engine's rows do not
    run to the cap: under a length profile its section (``rollout_engine``) costs the
    schedule its own host scheduler runs, so that schedule's decode and prefill replace
    the ``decode`` and ``prefill`` programs' figures in every step total (the figure
    without communication takes the schedule without the decode's ICI). Without a
    schedule (the static engine, or no ``--lengths``) the programs' figures stay. An engine
    that is not planned (the plan's ``not_planned``): the step leaves the rollout out."""
    if report.get("not_planned"):
        why = "not planned: the step's figures leave the rollout out"
        return {**report, "step_rollout": {"engine": engine, "costed_as": "not planned", "description": why}}
    en = report.get("rollout_engine") or {}
    if "decode_roofline_s" not in en:
        why = "the programs, every row to the cap" + (" (no --lengths: no schedule to simulate)"
                                                      if engine != "static" else "")
        return {**report, "step_rollout": {"engine": engine, "costed_as": "programs", "description": why}}
    p = report["programs"]
    delta = en["decode_roofline_s"] + en["prefill_roofline_s"] - p["decode"]["roofline_s"] - p["prefill"]["roofline_s"]
    delta_nc = (en["decode_roofline_no_comm_s"] + en["prefill_roofline_s"] - p["decode"]["roofline_no_comm_s"]
                - p["prefill"]["roofline_no_comm_s"])
    out = {**report, "roofline_step_s": report["roofline_step_s"] + delta,
           "roofline_step_no_comm_s": report["roofline_step_no_comm_s"] + delta_nc}
    out["step_rollout"] = {
        "engine": engine, "costed_as": "schedule",
        "description": "its schedule simulated at the length profile (decode + prefill)",
        "decode_s": en["decode_roofline_s"], "prefill_s": en["prefill_roofline_s"],
        "programs_decode_s": p["decode"]["roofline_s"], "programs_prefill_s": p["prefill"]["roofline_s"],
        "programs_step_s": report["roofline_step_s"],
    }
    pk = report.get("packing")
    if pk:
        valid = pk["valid_tokens_per_step"]
        padded, packed = pk["roofline_step_padded_s"] + delta, pk["roofline_step_packed_s"] + delta
        out["packing"] = {**pk, "roofline_step_padded_s": padded, "roofline_step_packed_s": packed,
                          "valid_tokens_per_s_padded": valid / padded, "valid_tokens_per_s_packed": valid / packed}
        out["step_rollout"]["programs_step_packed_s"] = pk["roofline_step_packed_s"]
    quantization_headline(out)  # the low-precision variants' steps (grpo.engine.planning.quantized)
    return out


__all__ = ["EVAL_PROGRAMS", "rollout_headline", "step_roofline", "synchronous_step"]
