"""The CLI surface: every lazy command resolves; help stays import-light."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from grpo.core.cli import LAZY_BENCH, LAZY_COMMANDS, LAZY_HELP, cli


@pytest.mark.parametrize("path", [[n] for n in LAZY_COMMANDS] + [["bench", n] for n in LAZY_BENCH],
                         ids=lambda p: " ".join(p))
def test_every_lazy_command_resolves(path):
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    assert LAZY_HELP[path[-1]]


def test_top_level_help_does_not_import_jax():
    probe = subprocess.run(
        [sys.executable, "-c",
         "import sys; from grpo.core.cli import main\n"
         "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
         "print('JAX' if 'jax' in sys.modules else 'NOJAX')"],
        capture_output=True, text=True, check=True,
    )
    assert probe.stdout.strip().endswith("NOJAX")
    assert "run      Train with a config" in probe.stdout


def test_user_errors_exit_2_without_traceback(tmp_path):
    result = CliRunner().invoke(cli, ["run", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and "does not exist" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["export", str(tmp_path), str(tmp_path / "out")])
    assert result.exit_code == 2 and "not a grpo run directory" in result.output
    result = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert result.exit_code == 2 and "no metrics.jsonl" in result.output
