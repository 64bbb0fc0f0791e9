"""Judge parsers: a generative judge's reply -> a score, by name (``task.model_rewards[i].parser``).

A parser is ``fn(text: str) -> float | None``; None means the reply could not be read (a
parse failure: the row scores 0 for that judge and counts in
``reward/<name>/parse_failures``). Built in:

- ``number``: the first number in the reply (``-3``, ``0.5``, ``1,234``, ``7/10`` as
  0.7), as is;
- ``yes_no``: 1.0 for a reply whose first word is yes (or ``true``, ``correct``), 0.0
  for no (``false``, ``incorrect``); case and punctuation ignored;
- ``score_0_10``: the first number in the reply if it lies in [0, 10] (``7/10`` reads
  7), divided by 10; anything out of range fails.

Any other ``module:function`` import path names a parser of your own.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from grpo.core.errors import UserError

Parser = Callable[[str], "float | None"]

_NUMBER = re.compile(r"(?<![\w.])([-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+]?\d+(?:\.\d+)?|[-+]?\.\d+)(?:\s*/\s*(\d+(?:\.\d+)?))?")
_YES = {"yes", "y", "true", "correct"}
_NO = {"no", "n", "false", "incorrect", "wrong"}


def _first_number(text: str, *, fraction: bool) -> float | None:
    match = _NUMBER.search(text)
    if match is None:
        return None
    value = float(match.group(1).replace(",", ""))
    if fraction and match.group(2) is not None:
        den = float(match.group(2))
        return value / den if den else None
    return value


def parse_number(text: str) -> float | None:
    """The first number of ``text`` (a fraction ``a/b`` as its value), or None."""
    return _first_number(text, fraction=True)


def parse_yes_no(text: str) -> float | None:
    """1.0 if the first word is yes/true/correct, 0.0 if no/false/incorrect/wrong, else None."""
    words = re.findall(r"[a-z]+", text.lower())
    if not words:
        return None
    if words[0] in _YES:
        return 1.0
    if words[0] in _NO:
        return 0.0
    return None


def parse_score_0_10(text: str) -> float | None:
    """The first number of ``text`` in [0, 10] (``7/10`` reads 7), divided by 10; else None."""
    value = _first_number(text, fraction=False)
    if value is None or not 0.0 <= value <= 10.0:
        return None
    return value / 10.0


PARSERS: dict[str, Parser] = {
    "number": parse_number,
    "yes_no": parse_yes_no,
    "score_0_10": parse_score_0_10,
}
"""The built-in parsers by name."""


def get_parser(name: str, *, field: str | None = None) -> Parser:
    """The parser ``name`` names: a built-in, or a function by import path. UserError
    (naming ``field``) otherwise."""
    if name in PARSERS:
        return PARSERS[name]
    if ":" in name:
        from grpo.core.references import resolve

        fn: Any = resolve(name, field=field)
        if not callable(fn):
            raise UserError(f"{field + ': ' if field else ''}{name!r} is a {type(fn).__name__}, not a function")
        return fn
    where = f"{field}: " if field else ""
    raise UserError(f"{where}unknown parser {name!r}; the built-in parsers are {', '.join(PARSERS)}, or name a "
                    "function text -> float | None by import path 'module:function'")


def check_parser(name: str) -> None:
    """ValueError (for a pydantic validator) unless ``name`` resolves to a parser."""
    try:
        get_parser(name)
    except UserError as err:
        raise ValueError(str(err)) from None


__all__ = ["PARSERS", "Parser", "check_parser", "get_parser", "parse_number", "parse_score_0_10", "parse_yes_no"]
