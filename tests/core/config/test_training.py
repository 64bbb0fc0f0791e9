"""The ``train`` sub-sections' new knobs of issue 50 ("Compile once"): when the packed
passes compile (``train.compile.ahead``) and the shape grid they compile on
(``train.packing.bins_per_device``, ``head_buckets``)."""

from __future__ import annotations

import pytest

from grpo.core.config import load_config
from grpo.core.config.fingerprint import fingerprint
from grpo.core.errors import ConfigError

BASE = {"model": {"source": "random", "random": {"preset": "tiny"}}, "task": {"name": "arithmetic"}}


def test_defaults():
    cfg = load_config(BASE)
    assert cfg.train.compile.ahead == "auto"
    assert cfg.train.packing.bins_per_device == "auto" and cfg.train.packing.head_buckets is None


@pytest.mark.parametrize("field, value", [
    ("train.compile.ahead", "sometimes"),
    ("train.packing.bins_per_device", "odd"),
    ("train.packing.head_buckets", 0),
    ("train.packing.head_buckets", 65),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(BASE, [f"{field}={value}"])


def test_when_and_on_what_grid_a_run_compiles_is_not_its_identity():
    """A resume may change them: they change which shapes compile, not what trains."""
    cfg = load_config(BASE)
    other = load_config(BASE, ["train.compile.ahead=lazy", "train.packing.bins_per_device=exact",
                               "train.packing.head_buckets=8"])
    assert fingerprint(other) == fingerprint(cfg)
