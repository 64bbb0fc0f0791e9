"""``train.compile``: where the persistent compilation cache lives (issue 50)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from conftest import ROOT

from grpo.core.cli import cli
from grpo.core.config import load_config
from grpo.core.config.fingerprint import fingerprint

QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


@pytest.mark.parametrize("value, want", [("auto", "auto"), ("gs://bucket/jax", "gs://bucket/jax"),
                                         ("/tmp/c", "/tmp/c"), ("null", None), ("false", False)])
def test_cache_dir_values(value, want):
    assert load_config(QUICKSTART, [f"train.compile.cache_dir={value}"]).train.compile.cache_dir == want


def test_default_is_auto_and_the_cache_does_not_define_the_run():
    base = load_config(QUICKSTART)
    assert base.train.compile.cache_dir == "auto"
    # A resume with another cache (or none) continues the same run.
    assert fingerprint(load_config(QUICKSTART, ["train.compile.cache_dir=null"])) == fingerprint(base)


@pytest.mark.parametrize("value", ["true", "''", "3"])
def test_a_bad_value_names_the_field_and_exits_2(value):
    res = CliRunner().invoke(cli, ["config", "validate", QUICKSTART, "--set", f"train.compile.cache_dir={value}"])
    assert res.exit_code == 2, res.output
    assert "train.compile.cache_dir: must be `auto`, a directory, a gs:// URL, null or false" in res.output
    assert "Traceback" not in res.output
