"""Reading a run config: YAML, ``${VAR}`` interpolation, ``--set`` overrides (and the
options they switch away from), then :func:`load_config`, which validates the result.

Behaviour is configured in the file; nothing reads hidden environment variables except
explicit ``${VAR}`` references.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from grpo.core.config.schema import RunConfig
from grpo.core.config.validate import OPTION_FIELDS, PLUGIN_FIELDS, config_problems
from grpo.core.errors import ConfigError, UserError

_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _interpolate(node: Any, path: str, problems: list[str], env: Mapping[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: _interpolate(v, f"{path}.{k}" if path else str(k), problems, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, f"{path}[{i}]", problems, env) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:
        def sub(m: re.Match) -> str:
            var = m.group(1)
            if var not in env:
                problems.append(f"{path}: environment variable ${{{var}}} is not set")
                return m.group(0)
            return env[var]

        out = _VAR_RE.sub(sub, node)
        # A whole-value reference keeps YAML typing (e.g. ${STEPS} -> 10).
        if _VAR_RE.fullmatch(node) and node[2:-1] in env:
            try:
                return yaml.safe_load(out)
            except yaml.YAMLError:
                return out
        return out
    return node


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=value"`` -> (["a", "b"], yaml-parsed value)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. --set train.steps=10")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as err:
        raise UserError(f"--set {text!r}: the value is not valid YAML ({err.__class__.__name__})") from None
    if value.strip() == "":
        parsed = ""
    return key.split("."), parsed


SWITCHABLE: dict[str, tuple[str, str, str]] = {
    **{kind: (section, field, OPTION_FIELDS.get(kind, "options")) for kind, (section, field) in PLUGIN_FIELDS.items()},
    "attention": ("model", "attention", "attention_options"),
}
"""kind -> (section, name field, options field) of every plugin ``--set`` may switch."""


def _default_name(section: str, field: str) -> Any:
    info = RunConfig.model_fields[section]
    model = info.annotation if isinstance(info.annotation, type) else None
    return model.model_fields[field].default if model is not None and field in model.model_fields else None


def drop_switched_options(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> list[str]:
    """Where ``--set`` switches a plugin (``--set rollout.style=legacy`` on a file that
    says ``serving``), the file's options for that plugin belong to the old one: they are
    dropped from ``data`` (in place) and named in the returned notes. Options set in the
    same command stay, and are validated strictly against the new plugin."""
    parsed = [parse_override(text) for text in overrides]
    notes = []
    for section, field, options_field in SWITCHABLE.values():
        names = [value for parts, value in parsed if parts == [section, field]]
        sec = data.get(section)
        if not names or not isinstance(sec, dict):
            continue
        old = sec.get(field, _default_name(section, field))
        options = sec.get(options_field)
        if names[-1] == old or not isinstance(options, dict) or not options:
            continue
        del sec[options_field]
        given = sorted({".".join(parts[2:]) for parts, _ in parsed if parts[:2] == [section, options_field]} - {""})
        dropped = ", ".join(sorted(options))
        kept = f"; the {', '.join(given)} given with --set stay" if given else ""
        notes.append(
            f"note: --set {section}.{field}={names[-1]} switches from {old!r}: the file's {section}.{options_field} "
            f"for {old!r} ({dropped}) are dropped{kept}"
        )
    return notes


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(
                    f"--set {text!r}: {'.'.join(parts[: i + 1])} holds a value ({type(child).__name__}), not a section"
                )
            node = child
        node[parts[-1]] = value
    return data


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise UserError(f"Config file {str(p)!r} does not exist.")
    if p.is_dir():
        raise UserError(f"Config path {str(p)!r} is a directory, not a YAML file.")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"Config file {str(p)!r} could not be read: {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"Config file {str(p)!r} is not valid YAML{where}: {problem}.") from None
    if data is None:
        raise UserError(f"Config file {str(p)!r} is empty; it needs at least a `model` and a `task` section.")
    if not isinstance(data, dict):
        raise UserError(
            f"Config file {str(p)!r} must be a mapping of sections (model:, task:, ...), "
            f"not a {type(data).__name__}."
        )
    return data


def load_config(
    source: str | os.PathLike | Mapping[str, Any],
    overrides: list[str] | tuple[str, ...] = (),
    *,
    plugins: Any = None,
    env: Mapping[str, str] | None = None,
) -> RunConfig:
    """Read, interpolate, override and validate a run config.

    Plugin options are replaced by the plugin's validated options with defaults filled
    in, so the resolved config shows every setting.
    """
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        data = read_yaml(source)
    problems: list[str] = []
    data = _interpolate(data, "", problems, os.environ if env is None else env)
    unresolved = tuple(p.split(":", 1)[0] for p in problems)
    for note in drop_switched_options(data, overrides):
        logging.getLogger("grpo.config").warning(note)
    data = apply_overrides(data, overrides)
    config, selected, found = config_problems(data, plugins, unresolved=unresolved)
    problems += found
    if problems or config is None:
        raise ConfigError("Invalid config:", problems=problems)
    updates: dict[str, Any] = {}
    for kind, (section, _field) in PLUGIN_FIELDS.items():
        sec = updates.get(section, getattr(config, section))
        options = selected[kind].options.model_dump(mode="json")
        updates[section] = sec.model_copy(update={OPTION_FIELDS.get(kind, "options"): options})
    return config.model_copy(update=updates)
