"""grpo's public surface, and the check that it does not break without notice:

    python scripts/api_surface.py check     # compare the code with api/public.json (the last release)
    python scripts/api_surface.py dump      # at a release: write the code's surface to api/public.json

The surface is what users and plugin authors build on:

- **python**: every name in ``grpo.__all__``, as griffe sees the object it names
  (signatures, parameters and defaults, class members and bases, attribute types);
- **hookspecs**: the pluggy hooks a plugin implements (``grpo.core.hookspecs``);
- **entry_point_group** and **plugin_kinds**: how a third-party package is found;
- **plugins**: the built-in plugins' names (what a config's ``rollout.engine`` etc. name);
- **config**: every config key with its type and default, the built-in plugins' options too;
- **cli**: every ``grpo`` command with its arguments and options.

``check`` compares the code with the baseline ``api/public.json``, the surface of the
last released version, committed so a fresh clone of main (CI's) has it without tags.
Python objects are compared with griffe's breaking-change finder
(:func:`griffe.find_breaking_changes`, the engine of ``griffe check``), the rest as sets
and values. A removed or changed public name is a breaking change; it passes only when
the ``## [Unreleased]`` section of ``CHANGELOG.md`` names it in backticks (the name or
a dotted/spaced prefix of it: `` `grpo.LossPlugin` `` declares every change inside
``grpo.LossPlugin``). ``dump`` is run at a release, after the changelog's Unreleased
section becomes the release's (CHANGELOG.md, "Releasing").
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "api" / "public.json"
CHANGELOG = ROOT / "CHANGELOG.md"
sys.path.insert(0, str(Path(__file__).resolve().parent))

_DROPPED = ("docstring", "filepath", "relative_filepath", "relative_package_filepath")


def _strip(data: Any) -> Any:
    """griffe's JSON of an object without what is not API (docstrings, files, line numbers)."""
    if isinstance(data, dict):
        return {k: (0 if k in ("lineno", "endlineno") else _strip(v)) for k, v in data.items() if k not in _DROPPED}
    if isinstance(data, list):
        return [_strip(v) for v in data]
    return data


def _public_paths() -> dict[str, str]:
    """Each name of ``grpo.__all__`` (``__version__`` aside) -> the dotted path of the
    object it names (where griffe finds it)."""
    import grpo

    out = {}
    for name in grpo.__all__:
        if name == "__version__":
            continue
        obj = getattr(grpo, name)
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if module and qualname and module.startswith("grpo") and "<" not in qualname:
            out[name] = f"{module}.{qualname}"
        else:
            out[name] = f"grpo.{name}"  # a constant or a type alias: griffe follows the import
    return out


def _griffe_package():
    import griffe

    return griffe.load("grpo", search_paths=[str(ROOT)], resolve_aliases=False, allow_inspection=False)


def _resolve(package: Any, path: str) -> Any:
    obj = package[path.removeprefix("grpo.")] if path != "grpo" else package
    return obj.final_target if getattr(obj, "is_alias", False) else obj


def surface() -> dict[str, Any]:
    """The code's public surface (the shape of ``api/public.json``)."""
    import grpo
    from docs_reference import OPTIONS_KEY, cli_commands, config_fields, plugin_options

    from grpo.core.contracts import PLUGIN_KINDS
    from grpo.core.plugins import ENTRY_POINT_GROUP, load_plugins

    package = _griffe_package()
    python = {name: _strip(json.loads(_resolve(package, path).as_json())) for name, path in _public_paths().items()}
    hooks = package["core.hookspecs"]
    hookspecs = {
        name: _strip(json.loads(member.as_json()))
        for name, member in hooks.members.items()
        if not member.is_alias and member.is_function and any("hookspec" in str(d.value) for d in member.decorators)
    }
    config = {key: _config_entry(f) for key, f, _ in config_fields()}
    for kind, name, options in plugin_options():
        for key, f in options.model_fields.items():
            config[f"{OPTIONS_KEY[kind]}.{key} ({kind} {name})"] = _config_entry(f)
    plugins = load_plugins(entry_points=False)
    cli = {}
    for name, command, ctx in cli_commands():
        cli[name] = sorted(opt for p in command.get_params(ctx) for opt in (*p.opts, *p.secondary_opts))
    return {
        "version": grpo.__version__,
        "entry_point_group": ENTRY_POINT_GROUP,
        "plugin_kinds": {kind: hook for kind, (hook, _) in PLUGIN_KINDS.items()},
        "hookspecs": hookspecs,
        "plugins": sorted(f"{kind} {name}" for kind in PLUGIN_KINDS for name in plugins.registry(kind).names()),
        "python": python,
        "config": config,
        "cli": cli,
    }


def _config_entry(field: Any) -> dict[str, Any]:
    """A config key's type (its Literal choices apart: a new choice breaks nothing) and default."""
    import typing

    choices: list[str] = []

    def shape(t: Any) -> str:
        if typing.get_origin(t) is typing.Literal:
            choices.extend(repr(a) for a in typing.get_args(t))
            return "Literal"
        args = typing.get_args(t)
        if args and typing.get_origin(t) is not None:
            return f"{getattr(typing.get_origin(t), '__name__', typing.get_origin(t))}[{', '.join(map(shape, args))}]"
        return getattr(t, "__name__", repr(t))

    entry = {"type": shape(field.annotation), "default": _default(field)}
    if choices:
        entry["choices"] = sorted(choices)
    return entry


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if hasattr(value, "model_dump") else repr(value)
    return "required" if field.default is PydanticUndefined else repr(field.default)


def _griffe_breakages(module: str, old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str]]:
    """griffe's breaking changes from the baseline's objects ``old`` (public name -> the
    object's JSON) to the code's ``new``, each as (dotted public name, message). Both are
    put in a module called ``module`` that exports them all, so a removed name, a removed
    or changed parameter, a removed class member or base, a changed attribute are found
    as ``griffe check`` finds them in a package."""
    import griffe

    def as_module(objects: dict[str, Any]) -> Any:
        mod = griffe.Module(module)
        for name, data in objects.items():
            mod.set_member(name, json.loads(json.dumps(data), object_hook=griffe.json_decoder))
        mod.exports = list(objects)
        return mod

    out = []
    for b in griffe.find_breaking_changes(as_module(old), as_module(new)):
        where = b.obj.path
        parameter = b.new_value if b.kind.value == "Parameter was added as required" else b.old_value
        if b.kind.value.startswith("Parameter") or "parameter" in b.kind.value:
            where += f"({parameter.name})"
        # griffe's own rendering of the old and new values (what `griffe check` prints)
        old_text, new_text = b._format_old_value(), b._format_new_value()
        out.append((where, b.kind.value + (f" ({old_text} -> {new_text})" if old_text or new_text else "")))
    return out


def breaking_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str]]:
    """Every breaking change from surface ``old`` to surface ``new``: (public name, what
    changed). Additions are not breaking."""
    out: list[tuple[str, str]] = []
    if old["entry_point_group"] != new["entry_point_group"]:
        out.append(("entry point group", f"{old['entry_point_group']!r} -> {new['entry_point_group']!r}"))
    for kind, hook in old["plugin_kinds"].items():
        if new["plugin_kinds"].get(kind) != hook:
            out.append((f"plugin kind {kind}", f"hook {hook} -> {new['plugin_kinds'].get(kind)}"))
    out += _griffe_breakages("grpo.core.hookspecs", old["hookspecs"], new["hookspecs"])
    out += [(f"plugin {p}", "built-in plugin removed") for p in old["plugins"] if p not in new["plugins"]]
    out += _griffe_breakages("grpo", old["python"], new["python"])
    for key, field in old["config"].items():
        now = new["config"].get(key)
        if now is None:
            out.append((key.split(" (")[0], f"config key removed{key[len(key.split(' (')[0]):]}"))
        else:
            changes = [f"{k} {field[k]} -> {now.get(k)}" for k in ("type", "default") if field[k] != now.get(k)]
            gone = sorted(set(field.get("choices", [])) - set(now.get("choices", [])))
            changes += [f"choices removed: {', '.join(gone)}"] if gone else []
            if changes:
                out.append((key.split(" (")[0], f"config key changed: {'; '.join(changes)}"))
    for command, options in old["cli"].items():
        if command not in new["cli"]:
            out.append((command, "command removed"))
            continue
        out += [(f"{command} {o}", "option removed") for o in options if o not in new["cli"][command]]
    return out


DECLARING = ("Changed", "Deprecated", "Removed")
"""The Keep-a-Changelog subsections of ``[Unreleased]`` that declare breaking changes."""


def unreleased_section(text: str) -> str:
    """The ``### Changed`` / ``### Deprecated`` / ``### Removed`` text of the
    ``## [Unreleased]`` section of a Keep-a-Changelog file (empty if none)."""
    m = re.search(r"^## \[Unreleased\][^\n]*\n(.*?)(?=^## \[|\Z)", text, flags=re.S | re.M)
    if not m:
        return ""
    parts = re.split(r"^### +([^\n]*)\n", m.group(1), flags=re.M)
    return "\n".join(body for title, body in zip(parts[1::2], parts[2::2]) if title.strip() in DECLARING)


def released_versions(text: str) -> list[str]:
    """The released versions a Keep-a-Changelog file lists, newest first."""
    return re.findall(r"^## \[(\d+\.\d+\.\d+)\]", text, flags=re.M)


def declared(name: str, section: str) -> bool:
    """Whether a changelog section names ``name`` (or a prefix of it ending at a dot, a
    space or a parenthesis) in backticks."""
    for token in re.findall(r"`([^`\n]+)`", section):
        if name == token or name.startswith((token + ".", token + " ", token + "(")):
            return True
    return False


def undeclared(changes: list[tuple[str, str]], changelog: str) -> list[tuple[str, str]]:
    section = unreleased_section(changelog)
    return [(n, m) for n, m in changes if not declared(n, section)]


def report(changes: list[tuple[str, str]], baseline_version: str) -> str:
    lines = [
        f"{len(changes)} breaking change(s) to grpo's public surface since {baseline_version} (api/public.json) "
        "that CHANGELOG.md's [Unreleased] section does not declare:"
    ]
    lines += [f"  - {name}: {what}" for name, what in changes]
    lines.append(
        "Keep the old name working (a shim that warns, DESIGN.md), or declare the change under "
        "## [Unreleased] (### Removed / ### Changed) naming it in backticks, e.g. `" + changes[0][0] + "`, "
        "and bump the minor version at the release (CHANGELOG.md, \"Versions\")."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "dump"])
    args = parser.parse_args(argv)
    if args.command == "dump":
        BASELINE.parent.mkdir(exist_ok=True)
        BASELINE.write_text(json.dumps(surface(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {BASELINE.relative_to(ROOT)}")
        return 0
    old = json.loads(BASELINE.read_text())
    bad = undeclared(breaking_changes(old, surface()), CHANGELOG.read_text())
    if bad:
        print(report(bad, old["version"]), file=sys.stderr)
        return 1
    print(f"ok: no undeclared breaking change since {old['version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
