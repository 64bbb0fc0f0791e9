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


LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension -> the ``datasets`` builder that reads it."""


def open_split(
    split: str,
    *,
    dataset: str | None,
    config_name: str | None,
    data_files: Mapping[str, str | list[str]] | None,
    task: str,
    example_files: str,
) -> tuple[Any, str]:
    """``(rows, label)`` of ``split``: local files from ``data_files`` (jsonl/json/parquet/
    csv, through ``datasets``), else the hub dataset ``dataset``. ``label`` names the split
    and its source for messages; every failure is a :class:`UserError` naming the option."""
    from pathlib import Path

    try:
        import datasets
    except ImportError as err:  # pragma: no cover - a declared dependency
        raise UserError(f"The {task} task needs the `datasets` package: {err}") from None
    if data_files is not None:
        if split not in data_files:
            raise UserError(
                f"task.options.data_files has no {split!r} split (it has: {', '.join(data_files)}). "
                f"Add one, e.g. --set task.options.data_files.{split}=path/to/{split}.jsonl"
            )
        raw = data_files[split]
        paths = [raw] if isinstance(raw, str) else list(raw)
        builders = set()
        for p in paths:
            path = Path(p).expanduser()
            if not path.is_file():
                raise UserError(f"task.options.data_files[{split!r}]: {p!r} is not a file.")
            suffix = path.suffix.lower()
            if suffix not in LOCAL_BUILDERS:
                raise UserError(
                    f"task.options.data_files[{split!r}]: {p!r} has an unsupported extension; "
                    f"use one of {', '.join(LOCAL_BUILDERS)}."
                )
            builders.add(LOCAL_BUILDERS[suffix])
        if len(builders) > 1:
            raise UserError(f"task.options.data_files[{split!r}] mixes file types: {paths}")
        try:
            ds = datasets.load_dataset(
                builders.pop(), data_files={split: [str(Path(p).expanduser()) for p in paths]}, split=split
            )
        except Exception as err:  # noqa: BLE001 - the user's file; say which and why
            raise UserError(
                f"Could not read task.options.data_files[{split!r}] ({', '.join(paths)}): "
                f"{type(err).__name__}: {shorten(str(err), 400)}"
            ) from None
        return ds, f"split {split!r} ({', '.join(paths)})"
    if not dataset:
        raise UserError(f"The {task} task needs task.options.dataset (a hub id) or task.options.data_files (local files).")
    try:
        ds = datasets.load_dataset(dataset, config_name, split=split)
    except Exception as err:  # noqa: BLE001 - network, hub or cache trouble
        raise UserError(
            f"Could not load dataset {dataset!r} (config {config_name!r}, split {split!r}): "
            f"{type(err).__name__}: {shorten(str(err), 300)}. Without access to the Hugging Face hub, "
            f"point the task at local files: set task.options.data_files, e.g. {example_files}."
        ) from None
    return ds, f"split {split!r} of {dataset}"
