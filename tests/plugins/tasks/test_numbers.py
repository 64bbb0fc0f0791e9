"""Number extraction and exact comparison: the tables rewards are built on."""

from __future__ import annotations

from fractions import Fraction

import pytest

from grpo.plugins.tasks._numbers import (
    MAX_DIGITS,
    canonical,
    find_numbers,
    last_number,
    only_number,
    parse_number,
    same_value,
)

BIG = "123456789012345678901234567890"

# text -> value when the text is exactly one number, else None
PARSE_TABLE = [
    ("18", 18),
    ("1,234", 1234),
    ("1,234,567", 1234567),
    ("$18", 18),
    ("18.00", 18),
    ("-3", -3),
    ("\u22123", -3),  # unicode minus
    ("\uff0d5", -5),  # full-width hyphen-minus
    ("$1,234.50", Fraction(2469, 2)),
    ("18.", 18),  # sentence period
    ("25%", 25),
    ("25 %.", 25),
    ("$ 18", 18),
    (" 7 \n", 7),
    ("-$3", -3),
    ("$-3", -3),
    ("0.5", Fraction(1, 2)),
    (".5", Fraction(1, 2)),
    ("-0", 0),
    ("007", 7),
    ("1{,}234", 1234),  # LaTeX thousands separator
    ("1\u202f234", 1234),  # narrow no-break space groups digits
    ("1\u2009234", 1234),  # thin space groups digits
    (BIG, int(BIG)),
    ("-" + BIG + ".5", -(int(BIG) + Fraction(1, 2))),
    ("18 apples", None),
    ("3 4", None),
    ("1 234", None),  # ordinary spaces never group digits
    ("", None),
    ("   ", None),
    ("abc", None),
    ("1,23", None),  # not a thousands group: two numbers
    ("0,125", None),
    ("3/4", None),  # fractions are two numbers
    ("1e3", None),  # no scientific notation
    ("\u2212", None),
    ("--3", None),
    ("1.2.3", None),
    ("\uff15", None),  # full-width digit: not a digit here
    ("\u20133", None),  # en dash is never a minus
]


@pytest.mark.parametrize("text,expected", PARSE_TABLE)
def test_parse_number(text, expected):
    got = parse_number(text)
    if expected is None:
        assert got is None
    else:
        assert got == Fraction(expected)
        assert isinstance(got, Fraction)


# (a, b, equal by value?)
COMPARE_TABLE = [
    ("1,234", "1234", True),
    ("$18", "18", True),
    ("18.00", "18", True),
    ("-3", "3", False),
    ("\u22123", "-3", True),
    ("0.50", ".5", True),
    ("1,000", "1000.0", True),
    ("25%", "25", True),
    ("18", "18.01", False),
    ("0.1", "0.10000000000000001", False),  # floats would call these equal
    ("-0", "0", True),
    ("$1,234.5", "1234.50", True),
    ("9" * 50, "9" * 49 + "8", False),
    (BIG, BIG + ".000", True),
    ("1,0", "10", False),  # "1,0" is not one number
    ("x", "x", False),  # no value equals nothing, not even itself
]


@pytest.mark.parametrize("a,b,equal", COMPARE_TABLE)
def test_same_value(a, b, equal):
    assert same_value(parse_number(a), parse_number(b)) is equal
    assert same_value(parse_number(b), parse_number(a)) is equal


# free text -> its last number (what flexible extraction reads)
LAST_TABLE = [
    ("The answer is 42.", 42),
    ("3 + 4 = 7", 7),
    ("no numbers here", None),
    ("", None),
    ("It costs $1,234.56 in total", Fraction(123456, 100)),
    ("from 5 down to -3", -3),
    ("the temperature fell to \u221212 degrees", -12),
    ("she has 5-3=2 left", 2),
    ("10 - 3", 3),  # subtraction, not a negative number
    ("- 3 apples", 3),  # a bullet, not a sign
    ("x = -3", -3),
    ("(\u22125)", -5),
    ("range 3\u20135", 5),
    ("so the total is 1 234", 234),
    ("1e5", 5),
    ("Answer: 18.\n\nHope this helps!", 18),
    ("\\boxed{1{,}234}", 1234),
    ("\\$18", 18),
    ("40% of them", 40),
    ("He made 1,200 and then 3,4,5", 5),
    ("total 12,3456", 3456),
    ("huge " + BIG + "0000 end", int(BIG + "0000")),
    ("<<16-3-4=9>>9 eggs", 9),
    ("version 1.2.3", 3),
]


@pytest.mark.parametrize("text,expected", LAST_TABLE)
def test_last_number(text, expected):
    tok = last_number(text)
    if expected is None:
        assert tok is None
    else:
        assert tok is not None and tok.value == Fraction(expected)


def test_find_numbers_lists_every_number_in_order():
    found = find_numbers("Janet sells 16 - 3 - 4 = 9 eggs at $2, making $18; a loss of -$1,250.50?")
    assert [t.value for t in found] == [16, 3, 4, 9, 2, 18, Fraction(-125050, 100)]
    assert found[-1].text == "-$1,250.50"


def test_only_number_needs_exactly_one():
    assert only_number("about 18 dollars").value == 18
    assert only_number("3 + 4 = 7") is None
    assert only_number("none") is None


def test_too_many_digits_is_a_number_without_value():
    long = "7" * (MAX_DIGITS + 1)
    tok = last_number(f"first 5 then {long}")
    assert tok is not None and tok.value is None  # still the last number: it hides the 5
    assert parse_number(long) is None
    assert parse_number("7" * MAX_DIGITS) == int("7" * MAX_DIGITS)
    # far beyond Python's int-from-str limit (4300 digits) must not raise
    assert last_number("9" * 50_000).value is None


@pytest.mark.parametrize("text", ["0", "-1234", "0.75", "-0.001", BIG, "1234.5", "18"])
def test_canonical_round_trips(text):
    value = parse_number(text)
    assert canonical(value) == text
    assert parse_number(canonical(value)) == value


def test_canonical_normalises():
    assert canonical(parse_number("$1,234.50")) == "1234.5"
    assert canonical(parse_number("\u221218.00")) == "-18"
    with pytest.raises(ValueError):
        canonical(Fraction(1, 3))
