"""The plan's text report: the all-to-all line (issue 54, expert parallelism)."""

from __future__ import annotations

from grpo.engine.planning.report import all_to_all_text


def _program(a2a: float, per_token: float | None = None) -> dict:
    kinds = {"all-gather": 5.0, "all-to-all": a2a}
    return {"collective_bytes": kinds,
            "collective_bytes_per_step": None if per_token is None else {"all-gather": 1.0, "all-to-all": per_token}}


def test_all_to_all_line_lists_the_programs_with_all_to_all_and_decode_per_token():
    programs = {"prefill": _program(3.5e6), "decode": _program(2.0e9, per_token=7.5e6), "row_sums": _program(0.0),
                "update": _program(1.25e10)}
    assert all_to_all_text(programs) == (
        "all-to-all (experts' dispatch and combine), GB per chip per program run: prefill 0.0035, decode 2, "
        "update 12.5; decode per generated token 0.0075")


def test_no_all_to_all_no_line():
    assert all_to_all_text({"update": _program(0.0), "decode": {"collective_bytes": None}}) is None
