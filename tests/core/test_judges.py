"""Judge parsers: a generative judge's reply -> a score (issue 55, the judge's parser)."""

from __future__ import annotations

import pytest

from grpo.core.errors import UserError
from grpo.core.judges import PARSERS, get_parser, parse_number, parse_score_0_10, parse_yes_no


@pytest.mark.parametrize("text, want", [
    ("7", 7.0), (" -3 points", -3.0), ("Score: 0.5.", 0.5), ("1,234 apples", 1234.0), ("7/10", 0.7),
    ("it is 3 or 4", 3.0), (".25", 0.25), ("+2", 2.0), ("x2", None), ("no number", None), ("", None),
    ("1/0", None),
])
def test_number(text, want):
    assert parse_number(text) == pytest.approx(want) if want is not None else parse_number(text) is None


@pytest.mark.parametrize("text, want", [
    ("Yes", 1.0), ("yes, it is right", 1.0), ("TRUE.", 1.0), ("Correct!", 1.0), ("no", 0.0), ("No.", 0.0),
    ("false", 0.0), ("incorrect: 3 != 4", 0.0), ("maybe yes", None), ("", None), ("42", None),
])
def test_yes_no(text, want):
    assert parse_yes_no(text) == want


@pytest.mark.parametrize("text, want", [
    ("7", 0.7), ("10", 1.0), ("0", 0.0), ("8/10", 0.8), ("Rating: 3.5", 0.35), ("11", None), ("-1", None),
    ("none", None),
])
def test_score_0_10(text, want):
    got = parse_score_0_10(text)
    assert got == pytest.approx(want) if want is not None else got is None


def test_names_and_import_paths():
    assert set(PARSERS) == {"number", "yes_no", "score_0_10"}
    assert get_parser("yes_no") is parse_yes_no
    assert get_parser("grpo.core.judges:parse_number") is parse_number
    with pytest.raises(UserError, match=r"task.model_rewards\[0\].parser: unknown parser 'yesno'"):
        get_parser("yesno", field="task.model_rewards[0].parser")
    with pytest.raises(UserError, match=r"not a function"):
        get_parser("grpo.core.judges:PARSERS")
