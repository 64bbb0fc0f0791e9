"""``grpo plan --search train.async.rollout_devices`` (grpo/engine/planning/search.py):
the splits it plans are those the run's own check accepts (issue 51: "the plan proposes
only what runs"), decided without compiling anything."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from conftest import ROOT

from grpo.core.cli import cli
from grpo.core.config import load_config
from grpo.engine.planning.search import split_candidates
from grpo.engine.planning.tpu import parse_topology

# The shipped TPU recipes and the slice each is for (the file name says it).
RECIPES = sorted(p for p in (ROOT / "configs").glob("*.yaml") if re.search(r"_v6e\d+\.yaml$", p.name))


def _topology(path) -> tuple[int, int]:
    return parse_topology("v6e-" + re.search(r"_v6e(\d+)\.yaml$", path.name).group(1)).hosts()


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_split_the_plan_proposes_validates(path):
    """Every split the search would plan for a shipped recipe on its slice passes `grpo
    config validate` for that topology (the run's check), and every split it leaves out
    fails it with the message the search records."""
    processes, per = _topology(path)
    config = load_config(str(path), ["train.async.enabled=true"])
    ok, refused = split_candidates(config, processes, per)
    for k, why in [(k, None) for k in ok] + refused:
        result = CliRunner().invoke(cli, ["config", "validate", str(path), "--processes", str(processes),
                                          "--local-devices", str(per), "--set", "train.async.enabled=true",
                                          "--set", f"train.async.rollout_devices={k}"])
        assert result.exit_code == (0 if why is None else 2), (k, result.output)
        assert why is None or why in result.output
    if processes > 1:  # the v6e-16 recipe: 2 + 2 hosts (1 + 3 and 3 + 1 leave a side its batch does not fit)
        assert ok == [2 * per] and [k for k, _ in refused] == [per, 3 * per]
        assert all("mesh of" in why for _, why in refused)


def test_a_split_the_run_refuses_is_not_a_candidate():
    """The issue's case: the v6e-16 recipe with partial rollouts and the continuous
    engine. Every whole-host split is refused with the run's message (the search says so
    before compiling), and a split inside a host is not tried at all."""
    path = ROOT / "configs" / "gsm8k_qwen25_3b_v6e16.yaml"
    config = load_config(str(path), ["train.async.enabled=true", "train.async.partial_rollouts=true",
                                      "rollout.engine=continuous"])
    ok, refused = split_candidates(config, 4, 4)
    assert ok == [] and [k for k, _ in refused] == [4, 8, 12]
    for k, why in refused:
        assert f"train.async.rollout_devices={k} splits the run by processes" in why
        assert "train.async.partial_rollouts=true" in why
    # One host: the same features run (no process split).
    assert split_candidates(config, 1, 8)[0]
