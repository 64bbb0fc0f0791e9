"""The defaults the schema fills in fit the rest of the config (issue 49, item 3: "defaults
that fit"): a default never triggers a refusal that names a field the user did not set."""

from __future__ import annotations

import itertools
import re

import pytest
import yaml
from pydantic import BaseModel

from conftest import ROOT

from grpo.core.config import RunConfig, load_config
from grpo.core.errors import ConfigError
from grpo.core.plugins import get_plugins

QUICKSTART = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())


def _schema_paths(model: type[BaseModel] = RunConfig, prefix: str = "") -> set[str]:
    """Every dotted field path of the schema (``async`` by its YAML name)."""
    paths = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}{info.alias or name}"
        paths.add(path)
        annotation = info.annotation
        for sub in getattr(annotation, "__args__", (annotation,)):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                paths |= _schema_paths(sub, path + ".")
    return paths


SCHEMA_PATHS = _schema_paths()


def _leaves(data: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in data.items():
        path = f"{prefix}{key}"
        out |= _leaves(value, path + ".") if isinstance(value, dict) and value else {path}
    return out


def _named_fields(text: str) -> set[str]:
    """The config fields a message names: dotted words that are schema paths, or lie
    inside one (a plugin option such as ``task.options.max_operand``)."""
    words = set(re.findall(r"[A-Za-z_]+(?:\.[A-Za-z_]+)+", text))
    return {w for w in words if w in SCHEMA_PATHS or any(w.startswith(p + ".") for p in SCHEMA_PATHS)}


def _set_by_user(field: str, user: set[str]) -> bool:
    return any(field == u or u.startswith(field + ".") or field.startswith(u + ".") for u in user)


def _sweep():
    plugins = get_plugins()
    objectives = plugins.registry("objective").names()
    engines = plugins.registry("engine").names()
    assert "gspo" in objectives and {"static", "continuous"} <= set(engines)
    engines = [*engines, "auto"]
    for objective, engine, asynchronous, partial in itertools.product(objectives, engines, (False, True), (None, True)):
        knobs = {"loss.objective": objective, "rollout.engine": engine, "train.async.enabled": asynchronous}
        if partial is not None:
            knobs["train.async.partial_rollouts"] = partial
        yield pytest.param(knobs, id="-".join(f"{v}" for v in knobs.values()))


@pytest.mark.parametrize("knobs", list(_sweep()))
def test_defaults_never_refuse_over_a_field_the_user_did_not_set(knobs):
    """Every objective x every engine x async on/off (x partial rollouts unset/on) on top
    of the quickstart: validation passes, or each refusal names only fields the user set
    (the quickstart's and these knobs). Before issue 49 item 3, async under gspo was
    refused over ``loss.mismatch.level``, a default the user never wrote."""
    user = _leaves(QUICKSTART) | set(knobs)
    overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in knobs.items()]
    try:
        load_config(QUICKSTART, overrides)
    except ConfigError as err:
        assert err.problems, str(err)
        for problem in err.problems:
            named = _named_fields(problem)
            assert named, f"the refusal names no field: {problem}"
            stray = sorted(f for f in named if not _set_by_user(f, user))
            assert not stray, f"{knobs}: refused over {stray}, which the user did not set: {problem}"


def test_async_gspo_validates_with_a_sequence_level_default():
    """Issue 49 item 3: async with ``loss.objective: gspo`` validates without the user
    touching ``loss.mismatch``; the default it fills in is sequence-level."""
    config = load_config(QUICKSTART, ["loss.objective=gspo", "train.async.enabled=true"])
    assert config.loss.mismatch.model_dump() == {"level": "sequence", "mode": "truncate", "cap": 2.0}
    # Other objectives keep the token-level default.
    config = load_config(QUICKSTART, ["loss.objective=ppo_clip", "train.async.enabled=true"])
    assert config.loss.mismatch.level == "token"
    # An unset level inside a loss.mismatch the user wrote fits the objective too...
    config = load_config(QUICKSTART, ["loss.objective=gspo", "loss.mismatch.cap=3"])
    assert (config.loss.mismatch.level, config.loss.mismatch.cap) == ("sequence", 3.0)
    # ...and the resolved config (what `grpo config show` prints) loads to the same thing.
    assert load_config(yaml.safe_load(config.to_yaml())) == config


def test_a_level_the_user_wrote_is_still_checked():
    with pytest.raises(ConfigError, match=r"loss\.mismatch\.level=token with loss\.objective=gspo"):
        load_config(QUICKSTART, ["loss.objective=gspo", "train.async.enabled=true", "loss.mismatch.level=token"])


def test_engine_auto_resolves_by_the_cap_and_partial_rollouts():
    """Issue 49 item 7: ``rollout.engine: auto`` is continuous from
    ``AUTO_CONTINUOUS_FROM`` new tokens on and with partial rollouts, else static; the
    resolved config (what `grpo config show` prints) names the engine that runs."""
    from grpo.core.config.engine import AUTO_CONTINUOUS_FROM

    def engine(*sets):
        return load_config(QUICKSTART, ["rollout.engine=auto", *sets]).rollout.engine

    assert engine(f"rollout.max_new_tokens={AUTO_CONTINUOUS_FROM - 1}") == "static"
    assert engine(f"rollout.max_new_tokens={AUTO_CONTINUOUS_FROM}") == "continuous"
    assert engine("train.async.enabled=true", "train.async.partial_rollouts=true") == "continuous"
    config = load_config(QUICKSTART, ["rollout.engine=auto", "rollout.max_new_tokens=512"])
    assert yaml.safe_load(config.to_yaml())["rollout"]["engine"] == "continuous"
    # The continuous engine's pool check applies under auto too (the user set pool_pages).
    with pytest.raises(ConfigError, match=r"rollout\.continuous\.pool_pages=1 cannot hold one row"):
        load_config(QUICKSTART, ["rollout.engine=auto", "rollout.continuous.pool_pages=1"])


def test_engine_auto_shows_resolved_in_config_show():
    from click.testing import CliRunner

    from grpo.core.cli import cli

    out = CliRunner().invoke(cli, ["config", "show", str(ROOT / "configs" / "quickstart.yaml"), "--set", "rollout.engine=auto", "--set",
                                   "rollout.max_new_tokens=256"])
    assert out.exit_code == 0, out.output
    assert yaml.safe_load(out.output)["rollout"]["engine"] == "continuous"
