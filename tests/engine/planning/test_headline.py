"""The plan's headline step roofline costs the rollout with the config's engine
(:func:`grpo.engine.planning.headline.rollout_headline`): pure arithmetic on a report, no
compiler."""

from __future__ import annotations

import pytest

from grpo.engine.planning.headline import rollout_headline, synchronous_step
from grpo.engine.planning.report import format_packing, step_rollout_text


def _report(engine_section: dict | None, packing: bool = True) -> dict:
    # The programs at the cap: decode 1.6 s (1.5 s without ICI), prefill 0.04 s; a step of
    # 2.5 s (2.3 s without communication), packed 2.1 s (padded 2.5 s), 1,000 valid tokens.
    rep = {
        "programs": {"decode": {"roofline_s": 1.6, "roofline_no_comm_s": 1.5},
                     "prefill": {"roofline_s": 0.04, "roofline_no_comm_s": 0.04}},
        "roofline_step_s": 2.5, "roofline_step_no_comm_s": 2.3,
    }
    if packing:
        rep["packing"] = {"roofline_step_padded_s": 2.5, "roofline_step_packed_s": 2.1, "valid_tokens_per_step": 1000.0,
                          "valid_tokens_per_s_padded": 400.0, "valid_tokens_per_s_packed": 1000 / 2.1}
    if engine_section is not None:
        rep["rollout_engine"] = engine_section
    return rep


def test_the_continuous_schedule_replaces_the_programs_decode_and_prefill():
    """Simulated decode 1.1 s (1.0 s without ICI) + prefill 0.03 s in place of 1.6 + 0.04:
    every step total drops by 0.51 s (0.51 s without communication: 1.03 against 1.54)."""
    en = {"decode_roofline_s": 1.1, "decode_roofline_no_comm_s": 1.0, "prefill_roofline_s": 0.03}
    rep = rollout_headline(_report(en), engine="continuous")
    assert rep["roofline_step_s"] == pytest.approx(2.5 - 0.51)
    assert rep["roofline_step_no_comm_s"] == pytest.approx(2.3 - 0.51)
    pk = rep["packing"]
    assert pk["roofline_step_padded_s"] == pytest.approx(1.99) and pk["roofline_step_packed_s"] == pytest.approx(1.59)
    assert pk["valid_tokens_per_s_packed"] == pytest.approx(1000 / 1.59)
    assert pk["valid_tokens_per_s_padded"] == pytest.approx(1000 / 1.99)
    sr = rep["step_rollout"]
    assert (sr["engine"], sr["costed_as"], sr["decode_s"], sr["prefill_s"]) == ("continuous", "schedule", 1.1, 0.03)
    assert (sr["programs_step_s"], sr["programs_step_packed_s"]) == (2.5, 2.1)
    # The async plan's synchronous step is the headline (packed), not substituted twice.
    assert synchronous_step(rep) == pytest.approx(1.59)
    text = step_rollout_text(sr)
    assert text.startswith("continuous engine: its schedule simulated at the length profile (decode + prefill), ")
    assert "1.100 + 0.030 s in place of the programs' 1.600 + 0.040 s (step 2.50 s at the cap)" in text
    step = next(ln for ln in format_packing(_packing_for_text(pk), 1 << 30, rollout=sr) if ln.startswith("step"))
    assert "packed 1.59 s" in step and step.endswith("rollout: the continuous engine's simulated schedule")
    # Without a profile (no packing section) only the step itself changes.
    alone = rollout_headline(_report(en, packing=False), engine="continuous")
    assert alone["roofline_step_s"] == pytest.approx(1.99) and "packing" not in alone


def _packing_for_text(pk: dict) -> dict:
    """The fields format_packing reads beyond the step's."""
    return {**pk, "profile": {"name": "p", "mean_completion": 4, "cap": 16, "quantiles": {"p50": 4, "p90": 4},
                              "at_cap": 0.0, "prompts": "x"},
            "bins": 8, "bin_length": 80, "bins_per_device": 2, "max_bins_per_device": 8, "compile_bound": 8, "bin_shapes": 1,
            "draws": [{"bins_used": 8, "micro_batches": 1, "per": 2}], "efficiency": 1.0, "passes": {},
            "micro_batch": {"bins_per_device": 2, "bin_length": 80, "sequences_per_device": 8, "sequences_per_bin": 4},
            "update_peak_bytes": 1, "update_program": "u", "peak_bytes_per_device": 1, "fits": True}


@pytest.mark.parametrize("engine, section, note", [
    ("static", None, ""),
    ("continuous", {"engine": "continuous", "slots": 8}, " (no --lengths: no schedule to simulate)"),
])
def test_without_a_schedule_the_programs_figures_stay(engine, section, note):
    """The static engine, or the continuous one without ``--lengths`` (its section then has
    no simulated schedule): the headline is the programs' (every row to the cap)."""
    before = _report(section)
    rep = rollout_headline(before, engine=engine)
    assert rep["roofline_step_s"] == 2.5 and rep["packing"] == before["packing"]
    assert rep["step_rollout"] == {"engine": engine, "costed_as": "programs",
                                   "description": "the programs, every row to the cap" + note}
    assert synchronous_step(rep) == 2.1
