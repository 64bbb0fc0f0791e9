"""The public surface (issue 52, "a public API that is checked"): the code against the last
release's ``api/public.json``, with griffe's breaking-change finder for the Python names
(``scripts/api_surface.py``); a removed or changed public name fails unless CHANGELOG.md's
``[Unreleased]`` section declares it. griffe is in the [dev] extra, so CI runs it."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

import grpo
from _scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


api_surface = load_script("api_surface")


@pytest.fixture(scope="module")
def code_surface():
    pytest.importorskip("griffe", reason='the API check needs griffe (pip install -e ".[dev]")')
    return api_surface.surface()


@pytest.fixture(scope="module")
def baseline():
    return json.loads((ROOT / "api" / "public.json").read_text())


def test_no_undeclared_breaking_change_since_the_last_release(code_surface, baseline):
    changes = api_surface.breaking_changes(baseline, code_surface)
    bad = api_surface.undeclared(changes, (ROOT / "CHANGELOG.md").read_text())
    assert not bad, api_surface.report(bad, baseline["version"])


def test_the_surface_covers_every_declared_part(code_surface):
    """Every name of ``grpo.__all__``, every hook spec and plugin kind, and the config and
    CLI are in the surface the check compares."""
    from grpo.core.contracts import PLUGIN_KINDS

    assert set(code_surface["python"]) == set(grpo.__all__) - {"__version__"}
    assert set(code_surface["hookspecs"]) == {hook for hook, _ in PLUGIN_KINDS.values()}
    assert code_surface["entry_point_group"] == "grpo"
    assert {"train.steps", "train.async.enabled", "loss.mismatch.cap", "task.options.max_operand (task arithmetic)"} \
        <= set(code_surface["config"])
    assert "--set" in code_surface["cli"]["grpo run"] and "grpo plugins list" in code_surface["cli"]
    assert code_surface["python"]["train"]["kind"] == "function"  # a lazily imported name, found in grpo.api


def test_the_baseline_is_the_last_release():
    """api/public.json is regenerated at each release: its version is the newest released
    section of CHANGELOG.md, and the code's version is not older."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    released = api_surface.released_versions(changelog)
    version = json.loads((ROOT / "api" / "public.json").read_text())["version"]
    assert released and released[0] == version, f"CHANGELOG.md's newest release {released[:1]} is not api/public.json's {version}"
    as_tuple = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:3])  # noqa: E731
    assert as_tuple(grpo.__version__) >= as_tuple(version)


CHANGELOG = """# Changelog

## [Unreleased]

### Added

- `{added}` (a mention under Added declares nothing)

### Removed

{removed}

## [0.2.0] - 2026-11-27
"""


def test_a_deliberate_break_fails_and_a_declared_one_passes(baseline):
    """A removed public name, a changed signature, a removed member of a plugin contract,
    a removed config key, a changed default, a removed CLI option and a removed hook are
    each reported, with the name to declare; declared under [Unreleased] (Removed), they
    pass; mentioned only under Added, they do not."""
    pytest.importorskip("griffe", reason='the API check needs griffe (pip install -e ".[dev]")')
    new = copy.deepcopy(baseline)
    del new["python"]["sequence_sum"]
    params = new["python"]["train"]["parameters"]
    params[:] = [p for p in params if p["name"] != "overrides"]  # a keyword removed from grpo.train
    del new["python"]["LossPlugin"]["members"]["compute"]
    del new["config"]["loss.beta"]
    new["config"]["train.steps"]["default"] = "200"
    new["cli"]["grpo run"].remove("--resume")
    del new["hookspecs"]["register_losses"]
    new["config"]["train.new_key"] = {"type": "int", "default": "0"}  # an addition breaks nothing
    new["config"]["model.random.preset"]["choices"].append("'qwen9-1b'")  # so does a new choice
    new["config"]["train.optimizer.name"]["choices"].remove("'lion'")
    changes = dict(api_surface.breaking_changes(baseline, new))
    assert set(changes) == {
        "grpo.sequence_sum", "grpo.train(overrides)", "grpo.LossPlugin.compute", "loss.beta", "train.steps",
        "grpo run --resume", "grpo.core.hookspecs.register_losses", "train.optimizer.name",
    }, changes
    assert changes["grpo.train(overrides)"] == "Parameter was removed"
    assert changes["grpo.sequence_sum"] == "Public object was removed"
    assert changes["grpo.LossPlugin.compute"] == "Public object was removed"
    assert changes["train.steps"] == "config key changed: default 100 -> 200"
    assert changes["train.optimizer.name"] == "config key changed: choices removed: 'lion'"
    assert api_surface.breaking_changes(baseline, baseline) == []

    names = sorted(changes)
    undeclared = api_surface.undeclared(list(changes.items()), CHANGELOG.format(added=names[0], removed=""))
    assert sorted(n for n, _ in undeclared) == names
    message = api_surface.report(undeclared, "0.2.0")
    assert "8 breaking change(s)" in message and "grpo.LossPlugin.compute: Public object was removed" in message
    removed = "\n".join(f"- `{n}`" for n in names if n != "grpo.LossPlugin.compute") + "\n- `grpo.LossPlugin`: reworked"
    assert api_surface.undeclared(list(changes.items()), CHANGELOG.format(added="x", removed=removed)) == []


def test_a_declaration_names_the_change_or_a_prefix_of_it():
    section = "- `grpo.LossPlugin` reworked; `grpo run` lost options; `loss.beta`"
    assert api_surface.declared("grpo.LossPlugin.compute", section)
    assert api_surface.declared("grpo run --resume", section)
    assert api_surface.declared("loss.beta", section)
    assert not api_surface.declared("grpo.LossPluginX", section)  # a prefix ends at a dot or a space
    assert not api_surface.declared("loss.beta_max", section)
    assert not api_surface.declared("grpo.train", section)
    assert api_surface.declared("grpo.train(overrides)", "`grpo.train`")


def test_py_typed_ships_in_the_package():
    """PEP 561: ``grpo/py.typed`` exists and setuptools' package data includes it (a wheel
    built from pyproject.toml carries it)."""
    from setuptools.config.pyprojecttoml import read_configuration

    assert (ROOT / "grpo" / "py.typed").is_file()
    config = read_configuration(ROOT / "pyproject.toml")
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["grpo"]
