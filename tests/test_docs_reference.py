"""The site's reference pages against the code (issue 52, "Reference"): the CLI and config
pages are what ``scripts/docs_reference.py`` generates (every command and option, every
config field with its type, default, bounds and description), every config field and
plugin option has a description, and every public name of ``grpo`` is on the API or
plugin-contract page (mkdocstrings renders it from its docstring). No mkdocs needed: the
strict build itself runs in CI (``mkdocs build --strict``)."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from pydantic import BaseModel, Field

import grpo
from _scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"


docs_reference = load_script("docs_reference")


def test_the_cli_and_config_pages_are_generated_from_the_code():
    stale = docs_reference.stale_pages()
    assert not stale, f"{stale} page(s) differ from the code: run `python scripts/docs_reference.py` and commit"


def _undescribed(fields) -> list[str]:
    return [key for key, field, *_ in fields if not (field.description or "").strip()]


def test_every_config_field_and_plugin_option_has_a_description():
    """A field without a description fails here, in the schema or in a built-in plugin's
    Options (the page would show an empty cell)."""
    missing = _undescribed(docs_reference.config_fields())
    for kind, name, options in docs_reference.plugin_options():
        missing += [f"{kind} {name}: {k}" for k, f in options.model_fields.items() if not (f.description or "").strip()]
    assert missing == [], f"fields without a description: {missing}"

    class Bare(BaseModel):  # the check itself sees a missing description
        described: int = Field(1, description="Has one.")
        bare: int = 1

    assert _undescribed((k, f) for k, f in Bare.model_fields.items()) == ["bare"]


def _page_keys(page: str) -> list[str]:
    """The full keys of the config page: each table's first column below the section its
    heading names (the heading's last code span; none at the top level)."""
    keys, prefix = [], ""
    for line in page.splitlines():
        if line.startswith("#"):
            spans = re.findall(r"`([^`]+)`", line)
            prefix = spans[-1] if spans else ""
        m = re.match(r"^\| `([^`]+)` \|", line)
        if m:
            keys.append(f"{prefix}.{m.group(1)}" if prefix else m.group(1))
    return keys


def test_the_config_page_has_every_key_and_only_real_ones():
    page = (REFERENCE / "config.md").read_text()
    documented = _page_keys(page)
    schema = [key for key, *_ in docs_reference.config_fields()]
    schema += [f"{docs_reference.OPTIONS_KEY[kind]}.{k}" for kind, _, options in docs_reference.plugin_options()
               for k in options.model_fields]
    assert set(schema) - set(documented) == set(), "schema fields missing from docs/reference/config.md"
    assert set(documented) - set(schema) == set(), "docs/reference/config.md documents fields the schema lacks"
    assert "train.async.max_staleness" in documented and "`train.async_" not in page  # the YAML spelling


def test_the_cli_page_has_every_command_and_option():
    page = (REFERENCE / "cli.md").read_text()
    for name, command, ctx in docs_reference.cli_commands():
        assert f"# `{name}`\n" in page, f"{name} has no heading on docs/reference/cli.md"
        section = page.split(f"# `{name}`\n", 1)[1].split("\n#", 1)[0]
        for param in command.get_params(ctx):
            if isinstance(param, click.Option):
                assert all(opt in section for opt in param.opts), f"{name} {param.opts} is not on the page"
            else:
                assert param.human_readable_name in section
    assert "`grpo run`" in page and "`--resume-changed`" in page  # a lazily imported command's options


def _targets(*pages: str) -> set[str]:
    return {t for p in pages for t in re.findall(r"^::: ([\w.]+)", (REFERENCE / p).read_text(), flags=re.M)}


def test_every_public_name_is_on_the_api_or_plugins_page():
    """Each name of ``grpo.__all__`` is a mkdocstrings block (``::: grpo.Name`` or the
    module that defines it), and every block names something real."""
    api_surface = load_script("api_surface")
    paths = api_surface._public_paths()
    targets = _targets("api.md", "plugins.md")
    missing = [n for n, path in paths.items() if f"grpo.{n}" not in targets and path not in targets]
    assert missing == [], f"public names with no reference block: {missing}"
    hooks = (REFERENCE / "plugins.md").read_text()
    from grpo.core.contracts import PLUGIN_KINDS

    assert all(f"- {hook}" in hooks for hook, _ in PLUGIN_KINDS.values())
    import importlib

    for target in targets:
        module, _, name = target.rpartition(".")
        if target.startswith("grpo.") and module == "grpo":
            assert hasattr(grpo, name), target
        else:
            try:
                obj = importlib.import_module(target)
            except ImportError:
                obj = getattr(importlib.import_module(module), name, None)
            assert obj is not None, f"::: {target} names nothing"


@pytest.mark.parametrize("page", ["cli.md", "config.md", "api.md", "plugins.md", "metrics.md"])
def test_reference_pages_exist_with_a_title(page):
    assert (REFERENCE / page).read_text().startswith("# ")
