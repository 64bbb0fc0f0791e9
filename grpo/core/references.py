"""Objects named by reference in a config: ``module:attribute`` import paths, and
``session:NAME`` for objects the Python API (:mod:`grpo.api`) handed over in this process.

A config is YAML, so a reward function or an in-memory dataset cannot sit in it. The
file names them instead: ``my_rewards:exact_match`` is imported like an entry point;
``session:reward_0`` is an object :func:`register` keeps in this process's table (the
Python API puts the callables and datasets it was given there, every process of a run
registering its own under the same names, since each runs the same script). A config
holding ``session:`` names is rerun from the same Python code, not from the command line.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any

from grpo.core.errors import UserError

SESSION = "session:"
_OBJECTS: dict[str, Any] = {}
_PATH_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def register(name: str, obj: Any) -> str:
    """Keep ``obj`` under ``session:name`` for this process; returns the reference."""
    if not re.fullmatch(r"[A-Za-z_][\w.-]*", name):
        raise ValueError(f"a session name must be an identifier-like string, got {name!r}")
    _OBJECTS[name] = obj
    return SESSION + name


def forget(reference: str) -> None:
    """Drop a ``session:`` object (no-op for anything else)."""
    if reference.startswith(SESSION):
        _OBJECTS.pop(reference[len(SESSION):], None)


def is_reference(text: Any) -> bool:
    """Whether ``text`` looks like ``module:attribute`` or ``session:name``."""
    return isinstance(text, str) and (text.startswith(SESSION) or bool(_PATH_RE.match(text)))


def resolve(reference: str, *, field: str | None) -> Any:
    """The object ``reference`` names; :class:`UserError` naming ``field`` when it does not
    resolve (a missing module or attribute, an unknown session name, a malformed path);
    ``field=None`` leaves the field out of the message (a pydantic validator adds it)."""
    try:
        return _resolve(reference)
    except UserError as err:
        raise UserError(f"{field}: {err}" if field else str(err)) from None


def _resolve(reference: str) -> Any:
    if not isinstance(reference, str):
        raise UserError(f"expected an import path 'module:function', got {type(reference).__name__}")
    if reference.startswith(SESSION):
        name = reference[len(SESSION):]
        if name not in _OBJECTS:
            raise UserError(
                f"{reference!r} names an object handed to grpo's Python API in another process; it "
                "exists only while that Python session runs. Run this config from the same Python code, or "
                "replace it with an import path 'module:function'."
            )
        return _OBJECTS[name]
    if not _PATH_RE.match(reference):
        raise UserError(
            f"{reference!r} is not an import path; write 'module:function' (e.g. 'my_rewards:exact_match'), "
            "with the module importable from the current directory or the Python path."
        )
    module_name, _, attr = reference.partition(":")
    if "" not in sys.path and "." not in sys.path:
        # `grpo run` is a console script: put the working directory on the path, as
        # `python -m` would, so a module next to the config imports.
        sys.path.insert(0, "")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"{reference!r} does not resolve: cannot import module {module_name!r} ({err}).") from None
    except Exception as err:  # noqa: BLE001 - the user's module raised while importing
        raise UserError(
            f"{reference!r} does not resolve: importing {module_name!r} raised {type(err).__name__}: {err}"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{reference!r} does not resolve: module {module_name!r} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    return obj


__all__ = ["SESSION", "forget", "is_reference", "register", "resolve"]
