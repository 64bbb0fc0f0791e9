"""Issue 55: math answers checked by Hugging Face's math-verify (the [math] extra; CI
installs it): fractions, decimals, LaTeX and units are one answer, what differs is not;
and the strict check's normal form beside it."""

from __future__ import annotations

import threading

import pytest

from grpo.plugins.tasks._verify import last_boxed, normalize

SAME = [
    ("1/2", "0.5"), ("\\frac{1}{2}", "0.5"), ("0.5", "\\dfrac12"), ("\\frac{3}{4}", "3/4"), ("0.75", "3/4"),  # fractions
    ("3.5", "\\frac72"), ("5", "5.0"), ("0.1", "10\\%"), ("-1234", "-1,234"), ("1000", "1{,}000"),  # decimals
    ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}"), ("x^2+2x+1", "(x+1)^2"), ("[1,3)", "[1, 3)"), ("x=2", "2"),  # LaTeX
    ("2", "2\\text{ cm}"), ("12", "12 \\text{ inches}"), ("90^\\circ", "90"), ("18", "\\$18"),  # units
]
DIFFERENT = [("1/2", "0.25"), ("10", "9.9999999"), ("5\\sqrt{2}", "5\\sqrt{3}"), ("(1,2)", "[1,2]"), ("3", "-3"),
             ("2", "")]


@pytest.mark.parametrize("gold, answer", SAME)
def test_math_verify_accepts_equal_answers_in_any_form(gold, answer):
    pytest.importorskip("math_verify")
    from grpo.plugins.tasks._verify import equivalent

    assert equivalent(gold, answer) and equivalent(answer, gold)


@pytest.mark.parametrize("gold, answer", DIFFERENT)
def test_math_verify_refuses_different_answers(gold, answer):
    pytest.importorskip("math_verify")
    from grpo.plugins.tasks._verify import equivalent

    assert not equivalent(gold, answer)


def test_math_verify_runs_on_a_worker_thread():
    """Its signal-based timeouts are off (they raise off the main thread), so a reward can
    call it on the reward pool's threads."""
    pytest.importorskip("math_verify")
    from grpo.plugins.tasks._verify import equivalent, equivalent_text

    out = []
    t = threading.Thread(target=lambda: out.append((equivalent("1/2", "0.5"), equivalent_text("2", "so x = $2$."))))
    t.start()
    t.join(30)
    assert out == [(True, True)]


def test_strict_normal_form_and_the_last_boxed_answer():
    assert last_boxed("first \\boxed{1}, then \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{7}") == "7" and last_boxed("no box") is None and last_boxed("\\boxed{1") is None
    assert normalize("\\left( 1, \\dfrac{1}{2} \\right).") == "(1,\\frac{1}{2})"
    assert normalize("$3\\,000$") == "3000" and normalize("1/2") != normalize("\\frac{1}{2}")
