"""Shared test set-up: 8 virtual CPU devices, set before any JAX backend starts."""

from __future__ import annotations

import os

from _xla import CPU_FAST_COMPILE  # noqa: E402  (compile fast; subprocesses inherit it)

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8 "
    + CPU_FAST_COMPILE
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_configure(config):
    """The parity tests compare against PyTorch transformers: without the [dev] extra the
    suite stops at once with the install command instead of failing test by test."""
    from grpo.core.errors import UserError, require

    try:
        require("torch", purpose="The test suite (model parity against transformers)", install='pip install -e ".[dev]"')
    except UserError as err:
        pytest.exit(str(err), returncode=2)
    # pytest-xdist's `--dist loadfile` hands out files with the most tests first, so the
    # few-test files that run whole processes (tests/integration/, the multi-process runs)
    # came last, and one worker finished minutes before the other. The files are handed
    # out in collection order instead, heaviest first (pytest_collection_modifyitems).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _file_weight(items) -> int:
    """A file's expected cost for scheduling: a test that starts JAX processes weighs 100,
    another slow-tier test 10, a fast one 1 (measured: the multi-process runs take 40-100 s
    each on 2 cores, a slow test 10-50 s, most fast tests under a second)."""
    return sum(100 if i.get_closest_marker("multiprocess") else 10 if i.get_closest_marker("slow") else 1
               for i in items)


@pytest.hookimpl(trylast=True)  # after -m/-k deselected theirs: the tests that run
def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    """Files heaviest first (:func:`_file_weight`), each file's tests in their own order:
    with two workers the long runs start early and the short files fill in at the end
    (longest-processing-time-first scheduling). Every worker collects the same order."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(files, key=lambda f: -_file_weight(files[f]))  # stable: ties keep collection order
    items[:] = [item for f in order for item in files[f]]


def _compilation_cache() -> None:
    """A persistent compilation cache for the session (and the CLI subprocesses it starts,
    which inherit the variables): tests that build the same tiny model in several
    trainers compile each program once."""
    import tempfile

    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="grpo-jax-cache-")
    import jax

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # Programs run in the thread that dispatches them: with 8 virtual devices on 2 shared
    # cores, several programs with collectives in flight at once (the CPU client's async
    # dispatch) can starve each other's rendezvous (a suite run hung twice and aborted
    # once that way under -n 2); what the tests check does not depend on the overlap.
    # This alone does not stop it (a program over several devices is still dispatched
    # asynchronously: 300 all-gathers in flight aborted with it as without it); the pool
    # of two threads a device that `import grpo` sets does (grpo/core/cpu.py).
    jax.config.update("jax_cpu_enable_async_dispatch", False)


_compilation_cache()


@pytest.fixture(autouse=True)
def _fresh_plugins():
    """Each test sees plugins loaded from the current environment."""
    from grpo.core.plugins import reset_plugins

    reset_plugins()
    yield
    reset_plugins()


# --------------------------------------------------------------- third-party plugin packages

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent  # the repository root, for test files at any depth
FIXTURES = Path(__file__).parent / "fixtures"


def _pip_install_target(package: str, target: Path) -> Path:
    """Install a fixture package (a real distribution with entry points) into ``target``."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(FIXTURES / package)],
        check=True,
        capture_output=True,
    )
    return target


@pytest.fixture(scope="session")
def example_plugin_dir(tmp_path_factory) -> Path:
    return _pip_install_target("example_plugin", tmp_path_factory.mktemp("site_example"))


@pytest.fixture(scope="session")
def broken_plugin_dir(tmp_path_factory) -> Path:
    return _pip_install_target("broken_plugin", tmp_path_factory.mktemp("site_broken"))


def _on_path(directory: Path, modules: tuple[str, ...]):
    import importlib

    from grpo.core.plugins import reset_plugins

    sys.path.insert(0, str(directory))
    importlib.invalidate_caches()
    reset_plugins()
    try:
        yield directory
    finally:
        sys.path.remove(str(directory))
        for name in list(sys.modules):
            if name.split(".")[0] in modules:
                del sys.modules[name]
        importlib.invalidate_caches()
        reset_plugins()


@pytest.fixture
def example_plugin(example_plugin_dir):
    """The throwaway `grpo-example-plugin` distribution is importable for this test."""
    yield from _on_path(example_plugin_dir, ("grpo_example_plugin",))


@pytest.fixture
def broken_plugin(broken_plugin_dir):
    """The `grpo-broken-plugin` distribution (every entry point fails) for this test."""
    yield from _on_path(broken_plugin_dir, ("grpo_broken_plugin",))
