"""Pieces shared by the built-in tasks: reward-weight validation, row errors."""

from __future__ import annotations

import math
from typing import Any, Mapping, TypeVar

from pydantic import BaseModel

from grpo.core.errors import UserError


O = TypeVar("O", bound=BaseModel)


def coerce_options(cls: type[O], options: Any) -> O:
    """A task's options as its ``Options`` model: an instance as it is, a mapping (or None:
    the defaults) validated; anything else is a TypeError."""
    if isinstance(options, cls):
        return options
    if options is None or isinstance(options, Mapping):
        return cls.model_validate(dict(options or {}))
    raise TypeError(f"expected {cls.__name__}, got {type(options).__name__}")


class UnparseableAnswer(UserError):
    """A row's ground truth cannot be read (skippable with ``skip_unparseable``)."""


def merge_weights(given: Mapping[str, float] | None, defaults: Mapping[str, float]) -> dict[str, float]:
    """The defaults with ``given`` on top; unknown names and non-finite weights refused.

    Raises ValueError (pydantic turns it into a field error naming the option).
    """
    given = dict(given or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(
            f"unknown reward name(s) {', '.join(map(repr, unknown))}; this task's rewards are "
            + ", ".join(map(repr, defaults))
        )
    out = dict(defaults)
    for name, weight in given.items():
        weight = float(weight)
        if not math.isfinite(weight) or abs(weight) > 1e6:
            raise ValueError(f"reward weight {name!r} must be a finite number within +-1e6, got {weight}")
        out[name] = weight
    return out


def require_text(record: Mapping[str, Any], field: str, where: str) -> str:
    """``record[field]`` as a string, or a UserError naming ``where`` and the field."""
    if not isinstance(record, Mapping):
        raise UserError(f"{where}: expected a JSON object with the task's fields, got {type(record).__name__}")
    if field not in record or record[field] is None:
        have = ", ".join(sorted(map(str, record))) or "none"
        raise UserError(f"{where}: the {field!r} field is missing (fields present: {have})")
    value = record[field]
    if not isinstance(value, str):
        raise UserError(f"{where}: the {field!r} field must be a string, got {type(value).__name__} {value!r:.80}")
    return value


def shorten(text: str, limit: int = 160) -> str:
    """``text`` cut to about ``limit`` characters for an error message (keeps the end)."""
    return text if len(text) <= limit else "..." + text[-(limit - 3):]
