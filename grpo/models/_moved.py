"""Module-level shims for names that moved in 0.2: the old module warns
(``DeprecationWarning``, naming the new import) and forwards for one minor version."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable, Mapping


def forwarder(old: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for module ``old`` whose names ``moved`` (name -> new
    module) now live elsewhere."""

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(f"{old}.{name} is deprecated and goes in grpo 0.3: use `from {moved[name]} import {name}`.",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(moved[name]), name)

    return __getattr__
