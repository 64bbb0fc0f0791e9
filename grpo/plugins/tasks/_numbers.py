"""Finding numbers in model output and comparing them by value, exactly.

Rewards decide what the model learns, so the rules here are deliberate and listed in
one place. Values are :class:`fractions.Fraction` (exact: ``18.00 == 18``, no float
rounding); a reward compares two values with ``==``.

What counts as a number
-----------------------
- ASCII digits only (``0-9``), with an optional fractional part: ``18``, ``18.5``,
  ``.5``. A trailing period is sentence punctuation: ``18.`` is 18.
- Thousands separators: a comma, or a thin space / narrow no-break space (U+2009,
  U+202F), between groups of exactly three digits after a first group of 1-3 digits
  that does not start with 0: ``1,234`` = ``1,234,567.5`` style. ``1,23`` and
  ``0,125`` are two numbers each; ``12,345`` is always 12345 (a list written without
  spaces after the commas is read as one number — GSM8K text never does that).
  LaTeX's ``1{,}234`` is read as ``1,234``.
- Ordinary spaces never group digits: ``1 234`` is the two numbers 1 and 234, because
  in model output a space between digit runs separates numbers far more often than it
  groups them.
- A minus sign — ``-``, the unicode minus ``−`` (U+2212), or its small/full-width forms
  (U+FE63, U+FF0D) — makes the number negative when it is glued to the digits (or to a
  currency symbol before them: ``-$3``, ``$-3``) and is not itself glued to something
  before it that ends an operand (a digit, letter, ``.``, ``)``, ``]``, ``}``). So
  ``-3``, ``x = -3``, ``(−3)`` are negative, while ``5-3``, ``10 - 3`` and the bullet
  ``- 3 apples`` hold a positive 3. The en dash ``–`` is never a minus (it writes ranges).
- Currency symbols (``$ € £ ¥ ₹``) and a percent sign are decoration and do not change
  the value: ``$18`` = 18 and ``25%`` = 25 (GSM8K states percentages as bare numbers).
- Not supported, on purpose: scientific notation (``1e3`` is 1 and 3), fractions
  (``3/4`` is 3 and 4; GSM8K answers are never fractions), number words (``seven``),
  digits of other scripts.
- A number with more than :data:`MAX_DIGITS` digits is still a number (it can be "the
  last number"), but its value is ``None``: it equals nothing. This bounds the work a
  degenerate completion can cause.

Whole-string parsing (:func:`parse_number`) accepts exactly one such number, optionally
surrounded by whitespace and followed by a ``%`` and/or a period; it is how ground truths
(the text after GSM8K's ``####``) are read.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

MAX_DIGITS = 1000
"""Numbers with more digits than this have no value (see the module docstring)."""

MINUS_SIGNS = "-\u2212\ufe63\uff0d"
CURRENCY_SYMBOLS = "$\u20ac\u00a3\u00a5\u20b9"
_GROUP_SEPARATORS = ",\u2009\u202f"

_NUMBER_RE = re.compile(
    rf"""
    (?:
        (?<![0-9A-Za-z_.)\]}}])          # not a subtraction: nothing operand-like before it
        (?P<sign>[{MINUS_SIGNS}])
        [{CURRENCY_SYMBOLS}]?            # -$3
    )?
    (?:
        (?P<int>
            [1-9][0-9]{{0,2}}(?:,[0-9]{{3}})+(?![0-9])
          | [1-9][0-9]{{0,2}}(?:\u2009[0-9]{{3}})+(?![0-9])
          | [1-9][0-9]{{0,2}}(?:\u202f[0-9]{{3}})+(?![0-9])
          | [0-9]+
        )
        (?P<frac>\.[0-9]+)?
      | (?<![0-9])(?P<frac_only>\.[0-9]+)
    )
    """,
    re.VERBOSE,
)


@dataclasses.dataclass(frozen=True)
class NumberToken:
    """One number found in a text: what was written, and its exact value.

    ``value`` is None when the number has more than :data:`MAX_DIGITS` digits.
    """

    text: str
    value: Fraction | None


def _normalise(text: str) -> str:
    return text.replace("{,}", ",")


def _value(match: re.Match[str]) -> Fraction | None:
    int_part = match.group("int") or ""
    frac_part = (match.group("frac") or match.group("frac_only") or "")[1:]
    for sep in _GROUP_SEPARATORS:
        int_part = int_part.replace(sep, "")
    if len(int_part) + len(frac_part) > MAX_DIGITS:
        return None
    value = Fraction(int(int_part or "0"))
    if frac_part:
        value += Fraction(int(frac_part), 10 ** len(frac_part))
    return -value if match.group("sign") else value


def find_numbers(text: str) -> list[NumberToken]:
    """Every number in ``text``, left to right (rules in the module docstring)."""
    text = _normalise(text)
    return [NumberToken(m.group(0), _value(m)) for m in _NUMBER_RE.finditer(text)]


def last_number(text: str) -> NumberToken | None:
    """The last number in ``text``, or None when there is none."""
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def only_number(text: str) -> NumberToken | None:
    """The number in ``text`` when it holds exactly one, else None (none or ambiguous)."""
    numbers = find_numbers(text)
    return numbers[0] if len(numbers) == 1 else None


def parse_number(text: str) -> Fraction | None:
    """The value of ``text`` when it is exactly one number, else None.

    Surrounding whitespace, a currency symbol, a trailing ``%`` and a trailing period
    are allowed: ``" $1,234.50. "`` -> 2469/2; ``"18 apples"``, ``"3 4"``, ``""`` -> None.
    """
    body = _normalise(text).strip()
    if body.endswith("."):
        body = body[:-1].rstrip()
    if body.endswith("%"):
        body = body[:-1].rstrip()
    for sym in CURRENCY_SYMBOLS:
        if body.startswith(sym):
            body = body[1:].lstrip()
            break
    match = _NUMBER_RE.fullmatch(body)
    if match is None:
        return None
    return _value(match)


def same_value(a: Fraction | None, b: Fraction | None) -> bool:
    """Exact equality of two values; None (no value) equals nothing, not even None."""
    return a is not None and b is not None and a == b


def canonical(value: Fraction) -> str:
    """A plain decimal string for a value that came from a decimal: ``-1234``, ``0.75``.

    ``parse_number(canonical(v)) == v`` for every value :func:`parse_number` returns.
    """
    sign = "-" if value < 0 else ""
    value = abs(value)
    whole, rest = divmod(value.numerator, value.denominator)
    if rest == 0:
        return f"{sign}{whole}"
    digits = []
    seen = 0
    while rest and seen <= MAX_DIGITS:
        rest *= 10
        digit, rest = divmod(rest, value.denominator)
        digits.append(str(digit))
        seen += 1
    if rest:
        raise ValueError(f"{value} has no finite decimal expansion")
    return f"{sign}{whole}.{''.join(digits)}"


__all__ = [
    "CURRENCY_SYMBOLS",
    "MAX_DIGITS",
    "MINUS_SIGNS",
    "NumberToken",
    "canonical",
    "find_numbers",
    "last_number",
    "only_number",
    "parse_number",
    "same_value",
]
