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
    config = load_config(str(path), ["train.async.enabled=true"])  # every recipe runs async (router replay too)
    ok, refused = split_candidates(config, processes, per)
    for k, why in [(k, None) for k in ok] + refused:
        result = CliRunner().invoke(cli, ["config", "validate", str(path), "--processes", str(processes),
                                          "--local-devices", str(per), "--set", "train.async.enabled=true",
                                          "--set", f"train.async.rollout_devices={k}"])
        assert result.exit_code == (0 if why is None else 2), (k, result.output)
        assert why is None or why in result.output
    if processes > 1:  # v6e-16: 2 + 2 hosts, v6e-32: 4 + 4 (other splits leave a side its batch does not fit)
        assert ok == [processes // 2 * per]
        assert [k for k, _ in refused] == [k for k in range(per, processes * per, per) if k not in ok]
        assert all("mesh of" in why for _, why in refused)


@pytest.mark.parametrize("name, processes", [("gsm8k_qwen25_3b_v6e16.yaml", 4), ("gsm8k_qwen25_3b_v6e32.yaml", 8)])
def test_partial_rollouts_over_processes_are_a_candidate(name, processes):
    """The issue's case: the v6e-16 recipe (and the v6e-32 one) with partial rollouts and
    the continuous engine. Every whole-host split was refused ("splits the run by
    processes"); partial rollouts now run over processes, so the half-and-half split is
    a candidate and passes the run's check, and a split inside a host is not tried."""
    config = load_config(str(ROOT / "configs" / name), ["train.async.enabled=true", "train.async.partial_rollouts=true",
                                                        "rollout.engine=continuous"])
    ok, refused = split_candidates(config, processes, 4)
    assert ok == [processes // 2 * 4]
    assert not any("splits the run by processes" in why for _, why in refused)
    assert split_candidates(config, 1, 8)[0]  # one host: no process split
