"""The metrics glossary, docs/reference/metrics.md (issue 52: "the metrics glossary is
tested both ways"). The runs that already exist in the suite check their rows against it
(``_glossary.assert_glossary``: every logged key is documented, every key of the sections
they cover is logged); this file checks the page and that every section is covered by
such a run, or says what logs it. No run here: the checks read the page and the tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import _glossary
from _glossary import AWAITING_MERGE, LOGGED_ELSEWHERE, SECTION_RUNS, assert_glossary, entries, sections

ROOT = Path(__file__).resolve().parents[3]


def test_the_page_has_unique_keys_each_with_a_unit_and_a_meaning():
    glossary = entries()
    keys = [e.key for e in glossary]
    assert len(keys) > 80 and len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    assert [e.key for e in glossary if not e.unit or not e.meaning] == []
    assert {"reward/mean", "loss", "time/train/step_s", "eval/pass@<k>", "async/staleness_max"} <= set(keys)


def test_every_section_is_checked_by_a_run_or_says_what_logs_it():
    assert set(SECTION_RUNS).isdisjoint(LOGGED_ELSEWHERE)
    assert set(sections()) == set(SECTION_RUNS) | set(LOGGED_ELSEWHERE)


def _function_source(nodeid: str) -> str:
    path, name = nodeid.split("::")
    text = (ROOT / path).read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node)
    raise AssertionError(f"{nodeid}: no such test")


@pytest.mark.parametrize("section", sorted(SECTION_RUNS))
def test_each_section_s_run_checks_it(section):
    """The run named for a section calls assert_glossary with that section: its rows must
    log every key of the section (the "every documented key is logged" direction)."""
    source = _function_source(SECTION_RUNS[section])
    assert "assert_glossary(" in source and f'"{section}"' in source, \
        f"{SECTION_RUNS[section]} does not check the glossary section {section!r}"


def _code() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "grpo").rglob("*.py")))


def test_keys_no_fixture_run_logs_are_awaiting_the_code_that_logs_them():
    """A key of a section no fixture run covers is in AWAITING_MERGE while the code does not
    log it; once the code has it, this fails: move it to the section of the run that logs
    it (and out of AWAITING_MERGE)."""
    elsewhere = [e.key for e in entries() if e.section in LOGGED_ELSEWHERE]
    assert set(elsewhere) == AWAITING_MERGE
    code = _code()
    logged_now = sorted(k for k in AWAITING_MERGE if f'"{k}"' in code or f"'{k}'" in code)
    assert logged_now == [], f"the code logs {logged_now} now: move them to their run's section of the glossary"


PAGE = """# t

## A

| Key | Unit | Meaning |
|---|---|---|
| `reward/<name>/mean` | reward | per function |
| `loss` | loss | the loss |

## B

| Key | Unit | Meaning |
|---|---|---|
| `async/hist/<name>` | fraction | per staleness |
"""


def test_pattern_keys_match_one_segment_and_both_directions_can_fail():
    glossary = entries(PAGE)
    assert [(e.section, e.key) for e in glossary] == [("A", "reward/<name>/mean"), ("A", "loss"), ("B", "async/hist/<name>")]
    assert _glossary.undocumented(["reward/correct/mean", "loss", "async/hist/0"], glossary) == []
    assert _glossary.undocumented(["reward/mean", "reward/a/b/mean", "lossy"], glossary) == \
        ["lossy", "reward/a/b/mean", "reward/mean"]
    assert _glossary.unlogged(["reward/x/mean"], ["A"], glossary) == ["loss"]
    assert _glossary.unlogged(["reward/x/mean"], ["B"], glossary) == ["async/hist/<name>"]


def test_assert_glossary_refuses_an_undocumented_or_a_missing_key():
    row = {e.key.replace("<k>", "1").replace("<name>", "x"): 0.0 for e in entries() if e.section == "Every step"}
    assert_glossary(row, "Every step")
    with pytest.raises(AssertionError, match="not in docs/reference/metrics.md: \\['made/up'\\]"):
        assert_glossary({**row, "made/up": 1.0}, "Every step")
    with pytest.raises(AssertionError, match="does not log them"):
        assert_glossary({k: v for k, v in row.items() if k != "grad_norm"}, "Every step")
    with pytest.raises(AssertionError, match="no such glossary section"):
        assert_glossary(row, "Every stepp")
