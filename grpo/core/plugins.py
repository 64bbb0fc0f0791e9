"""The plugin manager: built-ins plus ``grpo`` entry points, one plugin at a time.

- Built-ins are ordinary plugin modules listed in ``DEFAULT_PLUGINS`` and registered
  through the same hooks as third-party ones.
- Entry points (group ``grpo``) are loaded one at a time. A plugin that fails to import,
  implements an unknown hook, or whose hook raises is reported (entry-point name,
  distribution, error) and skipped; ``GRPO_STRICT_PLUGINS=1`` makes that fatal.
- ``GRPO_LOAD_PLUGINS=a,b`` loads only the named entry points (empty: none);
  ``GRPO_DISABLE_PLUGINS=a,b`` skips the named ones. Names are entry-point names or
  distribution names.
- A duplicate name within a kind is an error naming both providers: the later plugin is
  listed as failed, and choosing that name in a config fails with the same message.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata as importlib_metadata
import os
from typing import Any, Iterable

import pluggy

from grpo.core import hookspecs
from grpo.core.contracts import PLUGIN_KINDS
from grpo.core.errors import PluginError
from grpo.core.registry import FailedPlugin, PluginEntry, Registry

ENTRY_POINT_GROUP = "grpo"
BUILTIN = "built-in"

DEFAULT_PLUGINS: tuple[str, ...] = (
    "grpo.plugins.mesh",
    "grpo.plugins.rollout",
    "grpo.plugins.losses",
    "grpo.plugins.objectives",
    "grpo.plugins.tasks",
    "grpo.plugins.models",
    "grpo.plugins.attention",
    "grpo.plugins.engines",
)


def _env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return [s.strip() for s in raw.split(",") if s.strip()]


def _strict_from_env() -> bool:
    return os.environ.get("GRPO_STRICT_PLUGINS", "").strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass
class Plugins:
    """Everything that was loaded: one registry per kind, and what failed."""

    manager: pluggy.PluginManager
    registries: dict[str, Registry]
    failed: list[FailedPlugin]
    conflicts: dict[tuple[str, str], str]

    def registry(self, kind: str) -> Registry:
        return self.registries[kind]

    def get(self, kind: str, name: str) -> Any:
        if (kind, name) in self.conflicts:
            raise PluginError(self.conflicts[(kind, name)])
        return self.registries[kind].get(name)

    def entries(self) -> list[PluginEntry]:
        return [e for kind in PLUGIN_KINDS for e in self.registries[kind]]


class _Loader:
    def __init__(self, *, strict: bool):
        self.strict = strict
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.order: list[tuple[str, str, str]] = []  # (plugin name in pm, provider, ep name)
        self.failed: list[FailedPlugin] = []
        self.registries = {kind: Registry(kind) for kind in PLUGIN_KINDS}
        self.conflicts: dict[tuple[str, str], str] = {}

    def fail(self, *, entry_point: str, provider: str, error: BaseException | str, kind: str | None) -> None:
        if isinstance(error, BaseException):
            text = f"{type(error).__name__}: {error}"
        else:
            text = error
        if self.strict:
            where = f" ({kind})" if kind else ""
            raise PluginError(
                f"Plugin {entry_point!r} from {provider}{where} failed: {text} "
                "(GRPO_STRICT_PLUGINS is set, so this is fatal; unset it to skip the plugin)."
            )
        self.failed.append(FailedPlugin(entry_point=entry_point, provider=provider, error=text, kind=kind))

    def add_module(self, module: Any, *, pm_name: str, provider: str, ep_name: str) -> None:
        try:
            self.pm.register(module, name=pm_name)
            # Checked per plugin so a hook-name typo is pinned on the plugin that made it.
            self.pm.check_pending()
        except Exception as err:  # noqa: BLE001 - third-party code; report and skip
            if self.pm.is_registered(module):
                self.pm.unregister(module)
            self.fail(entry_point=ep_name, provider=provider, error=err, kind=None)
            return
        self.order.append((pm_name, provider, ep_name))

    def collect(self) -> None:
        for pm_name, provider, ep_name in self.order:
            for kind, (hook_name, _base) in PLUGIN_KINDS.items():
                caller = getattr(self.pm.hook, hook_name)
                for impl in caller.get_hookimpls():
                    if impl.plugin_name == pm_name:
                        self._call(impl, kind=kind, provider=provider, ep_name=ep_name)

    def _call(self, impl: Any, *, kind: str, provider: str, ep_name: str) -> None:
        collected: list[Any] = []
        kwargs = {"register": collected.append} if "register" in impl.argnames else {}
        try:
            impl.function(**kwargs)
        except Exception as err:  # noqa: BLE001
            self.fail(entry_point=ep_name, provider=provider, error=err, kind=kind)
            return
        registry = self.registries[kind]
        for plugin in collected:
            name = getattr(plugin, "name", None)
            if isinstance(name, str) and name in registry:
                msg = (
                    f"Duplicate {kind} plugin name {name!r}: provided by both "
                    f"{registry.entry(name).provider} and {provider}. Uninstall one, or skip "
                    "one with GRPO_DISABLE_PLUGINS=<entry point or distribution name>."
                )
                self.conflicts[(kind, name)] = msg
                self.fail(entry_point=ep_name, provider=provider, error=msg, kind=kind)
                continue
            try:
                registry.add(plugin, provider=provider)
            except PluginError as err:
                self.fail(entry_point=ep_name, provider=provider, error=str(err), kind=kind)


def _selected(ep: importlib_metadata.EntryPoint) -> bool:
    names = {ep.name}
    if ep.dist is not None:
        names.add(ep.dist.name)
    allow = _env_list("GRPO_LOAD_PLUGINS")
    deny = _env_list("GRPO_DISABLE_PLUGINS") or []
    if allow is not None and not names & set(allow):
        return False
    return not names & set(deny)


def _provider(ep: importlib_metadata.EntryPoint) -> str:
    if ep.dist is not None:
        return f"{ep.dist.name}=={ep.dist.version}"
    return ep.value.split(":")[0]


def load_plugins(
    *,
    strict: bool | None = None,
    builtins: Iterable[str] = DEFAULT_PLUGINS,
    entry_points: bool = True,
    extra_modules: Iterable[Any] = (),
) -> Plugins:
    """Load built-ins, then entry points, then ``extra_modules`` (tests, embedding)."""
    loader = _Loader(strict=_strict_from_env() if strict is None else strict)
    for modname in builtins:
        module = importlib.import_module(modname)  # a broken built-in is a bug: raise
        loader.add_module(module, pm_name=modname, provider=BUILTIN, ep_name=modname)
    if entry_points:
        seen: set[tuple[str, str]] = set()
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
            provider = _provider(ep)
            if (ep.name, provider) in seen or not _selected(ep):
                continue
            seen.add((ep.name, provider))
            try:
                module = ep.load()
            except Exception as err:  # noqa: BLE001 - report and skip
                loader.fail(entry_point=ep.name, provider=provider, error=err, kind=None)
                continue
            loader.add_module(module, pm_name=f"{provider}:{ep.name}", provider=provider, ep_name=ep.name)
    for i, module in enumerate(extra_modules):
        name = getattr(module, "__name__", f"extra{i}")
        loader.add_module(module, pm_name=f"extra:{name}", provider=name, ep_name=name)
    loader.collect()
    return Plugins(
        manager=loader.pm, registries=loader.registries, failed=loader.failed, conflicts=loader.conflicts
    )


_ENV_KEYS = ("GRPO_STRICT_PLUGINS", "GRPO_LOAD_PLUGINS", "GRPO_DISABLE_PLUGINS")
_CACHE: dict[tuple, Plugins] = {}


def get_plugins() -> Plugins:
    """The process-wide plugin set, loaded on first use (per plugin env-var setting)."""
    key = tuple(os.environ.get(k) for k in _ENV_KEYS)
    if key not in _CACHE:
        _CACHE[key] = load_plugins()
    return _CACHE[key]


def reset_plugins() -> None:
    """Forget the loaded plugins (tests that install or remove plugin packages)."""
    _CACHE.clear()
    importlib.invalidate_caches()
