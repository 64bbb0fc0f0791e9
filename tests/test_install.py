"""What a base install (``pip install grpo-jax``, no extras) must provide.

CI also runs the README's quickstart in a fresh virtualenv with the base install only
(``.ci/run``); these tests catch a missing dependency before that, from the source.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Imported only through grpo.core.errors.require, which names the extra that installs it.
OPTIONAL = {"libtpu": "plan", "torch": "dev", "peft": "dev", "math_verify": "math"}
# Needed at run time without being imported by name: transformers renders chat
# templates with jinja2 but does not depend on it.
INDIRECT = {"jinja2"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _base_requirements() -> set[str]:
    reqs = md.requires("grpo-jax") or []
    return {_norm(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in reqs if "extra ==" not in r}


def _imported_top_level_modules() -> dict[str, str]:
    """Top-level module -> first file importing it, over every module of the package."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "grpo").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_runtime_import_is_a_base_dependency():
    base = _base_requirements()
    dists = md.packages_distributions()
    missing = []
    for module, where in sorted(_imported_top_level_modules().items()):
        if module in sys.stdlib_module_names or module == "grpo" or module in OPTIONAL:
            continue
        owners = {_norm(d) for d in dists.get(module, [])}
        if not owners:
            missing.append(f"{module} (imported in {where}) is not installed at all")
        elif not owners & base:
            missing.append(f"{module} (imported in {where}) comes from {sorted(owners)}, not a base dependency")
    assert not missing, "\n".join(missing)


def test_indirect_runtime_needs_are_base_dependencies():
    assert INDIRECT <= _base_requirements()


def test_optional_imports_go_through_require():
    """An optional package is imported only inside a function that names its install
    command (or in tests), so a missing one is a clear error, never an ImportError."""
    offenders = []
    for path in sorted((ROOT / "grpo").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for module in OPTIONAL:
            if re.search(rf"^\s*(import {module}\b|from {module}\b)", text, flags=re.M):
                offenders.append(f"{path.relative_to(ROOT)} imports {module} directly")
    assert not offenders, "\n".join(offenders)


def test_require_names_the_install_command():
    from grpo.core.errors import UserError, require

    assert require("json", purpose="x", install="y").__name__ == "json"
    with pytest.raises(UserError) as info:
        require("no_such_module_xyz", purpose="Planning a TPU run", install='pip install "grpo-jax[plan]"')
    text = str(info.value)
    assert "Planning a TPU run" in text and 'pip install "grpo-jax[plan]"' in text and "\n" not in text


def test_wandb_online_without_credentials_is_a_user_error(tmp_path, monkeypatch):
    from grpo.core.config import WandbConfig
    from grpo.core.errors import UserError
    from grpo.engine.runs.metrics import MetricsLogger

    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_SILENT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(UserError) as info:
        MetricsLogger(tmp_path, total_steps=1, start_step=0, is_main=True, wandb_cfg=WandbConfig(mode="online"),
                      run_name="x", progress_bar=False)
    assert "WANDB_API_KEY" in str(info.value) and "offline" in str(info.value)


def test_ci_runs_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert 'readme_command "## Quickstart"' in ci and 'readme_command "## Tests"' in ci
    assert "pip install -e . && grpo run configs/quickstart.yaml" in readme
    assert 'pip install -e ".[dev]" && python -m pytest -q' in readme
