"""Errors meant for people.

``UserError`` is bad input (config, data, flags): the CLI prints its message as one
paragraph and exits with status 2, without a traceback. Anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user. ``str(err)`` is the whole message shown to them."""

    exit_code = 2

    def __init__(self, message: str, *, problems: list[str] | None = None):
        self.problems = list(problems or [])
        if self.problems:
            message = message.rstrip() + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class PluginError(UserError):
    """A plugin could not be loaded or registered, or a plugin name is unknown."""


class ConfigError(UserError):
    """The run config is invalid. ``problems`` holds one line per field."""


def require(module: str, *, purpose: str, install: str) -> object:
    """Import an optional dependency, or raise a :class:`UserError` that says what needs
    it and the command that installs it (``install``, e.g. ``pip install "grpo-jax[plan]"``)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise UserError(
            f"{purpose} needs the Python package {module!r}, which is not installed in this environment "
            f"({err}). Install it with: {install}"
        ) from None
