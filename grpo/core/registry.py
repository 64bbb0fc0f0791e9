"""One table per plugin kind: name -> plugin, with who provided it."""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Generic, Iterator, TypeVar

from pydantic import BaseModel

from grpo.core.contracts import PLUGIN_KINDS
from grpo.core.errors import PluginError

P = TypeVar("P")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_.\-]*$")


@dataclasses.dataclass(frozen=True)
class PluginEntry:
    kind: str
    name: str
    plugin: Any
    provider: str  # "built-in" or "distribution==version" or the plugin module
    description: str = ""


@dataclasses.dataclass(frozen=True)
class FailedPlugin:
    """A plugin that could not be loaded or whose hook raised."""

    entry_point: str
    provider: str
    error: str
    kind: str | None = None


class Registry(Generic[P]):
    """Plugins of one kind by name."""

    def __init__(self, kind: str):
        if kind not in PLUGIN_KINDS:
            raise ValueError(f"unknown plugin kind {kind!r}")
        self.kind = kind
        self._entries: dict[str, PluginEntry] = {}

    def add(self, plugin: Any, *, provider: str) -> PluginEntry:
        base = PLUGIN_KINDS[self.kind][1]
        name = getattr(plugin, "name", None)
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise PluginError(
                f"{provider} registered a {self.kind} plugin with an invalid name {name!r}: "
                "names are lower-case, start with a letter and use [a-z0-9_.-]."
            )
        if not isinstance(plugin, base):
            raise PluginError(
                f"{provider} registered {self.kind} plugin {name!r} of type "
                f"{type(plugin).__qualname__}, which is not a grpo.{base.__name__}."
            )
        options = getattr(plugin, "Options", None)
        if not (isinstance(options, type) and issubclass(options, BaseModel)):
            raise PluginError(
                f"{provider}: {self.kind} plugin {name!r} has no pydantic `Options` model."
            )
        if name in self._entries:
            other = self._entries[name].provider
            raise PluginError(
                f"Duplicate {self.kind} plugin name {name!r}: provided by both {other} and "
                f"{provider}. Uninstall one of them, or disable one with "
                "GRPO_DISABLE_PLUGINS=<entry point name>."
            )
        entry = PluginEntry(
            kind=self.kind,
            name=name,
            plugin=plugin,
            provider=provider,
            description=getattr(plugin, "description", "") or "",
        )
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> P:
        return self.entry(name).plugin

    def entry(self, name: str) -> PluginEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise PluginError(self.unknown_message(name)) from None

    def unknown_message(self, name: Any) -> str:
        choices = ", ".join(sorted(self._entries)) or "(none installed)"
        hint = difflib.get_close_matches(str(name), list(self._entries), n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        return f"Unknown {self.kind} plugin {name!r}. Available: {choices}.{did_you_mean}"

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[PluginEntry]:
        return iter(self._entries[n] for n in sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
