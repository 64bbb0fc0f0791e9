"""The policy's loading (``grpo.models.policy``)."""

from __future__ import annotations

import threading

import pytest

from grpo.core.config import ModelConfig
from grpo.core.errors import UserError
from grpo.models import loading, policy


def test_the_tokenizer_loads_while_the_model_builds(monkeypatch):
    """Issue 50 (a run's start-up): the tokenizer (importing transformers and torch) loads
    on its own thread while the model builds (XLA compiles its initialisation without the
    GIL), not before it: here the tokenizer waits for the model's build to have started,
    which a serial load never lets happen."""
    building = threading.Event()
    seen = {}

    def tokenizer(cfg):
        seen["tokenizer_thread"] = threading.current_thread().name
        seen["overlapped"] = building.wait(timeout=10)
        return "tok", "dir"

    def build(cfg, mesh, *, seed):
        building.set()
        raise RuntimeError("model build stopped here")

    monkeypatch.setattr(policy, "load_tokenizer", tokenizer)
    monkeypatch.setattr(loading, "build_model", build)
    with pytest.raises(RuntimeError, match="model build stopped here"):
        policy.load_policy(ModelConfig(source="random"), mesh=None, seed=0)
    assert seen == {"tokenizer_thread": seen["tokenizer_thread"], "overlapped": True}
    assert seen["tokenizer_thread"] != threading.current_thread().name


def test_a_tokenizer_error_is_raised_first(monkeypatch):
    """Both failing: the tokenizer's error (a user's, exit 2) is the one raised, as when
    the tokenizer loaded before the model."""
    def tokenizer(cfg):
        raise UserError("Could not load a tokenizer from 'x'")

    def build(cfg, mesh, *, seed):
        raise RuntimeError("model build failed")

    monkeypatch.setattr(policy, "load_tokenizer", tokenizer)
    monkeypatch.setattr(loading, "build_model", build)
    with pytest.raises(UserError, match="Could not load a tokenizer"):
        policy.load_policy(ModelConfig(source="random"), mesh=None, seed=0)
