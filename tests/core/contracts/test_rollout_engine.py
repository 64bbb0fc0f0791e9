"""The weights side of the rollout-engine contract (grpo/core/contracts/engine.py), with no
JAX: ``update_weights`` records the trained params and prepares nothing; the first read
of ``weights`` prepares them once (``prepare``); ``release``/``end`` drop the prepared
copy (it is freed) and keep the params; handing an engine its own ``weights`` back does
not prepare them twice; an engine that overrides ``update_weights`` without ``super()``
gets the params as they are; an engine written before the contract is wrapped and
handed what it is given."""

from __future__ import annotations

import gc
import weakref

import pytest

from grpo import RolloutEngine
from grpo.core.contracts.engine import _Wrapped, as_engine


class Prepared:
    """A prepared copy (a resharded or merged state): weak-referenceable."""

    def __init__(self, params):
        self.params = params


class Engine(RolloutEngine):
    def __init__(self):
        self.sampling = None
        self.prepared: list = []
        self.prepare = self._prepare

    def _prepare(self, params):
        self.prepared.append(params)
        return Prepared(params)

    def sample(self, params, prompt_tokens, prompt_mask, rng, examples):
        return params


def test_update_weights_prepares_nothing_until_the_weights_are_read():
    engine = Engine()
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.weights
    engine.update_weights("v0", 0)
    assert engine.prepared == [] and engine.version == 0
    first = engine.weights
    assert isinstance(first, Prepared) and first.params == "v0" and engine.weights is first
    assert engine.prepared == ["v0"]  # one preparation per version, however often it is read
    engine.update_weights("v1", 1)
    assert engine.version == 1 and engine.prepared == ["v0"]  # the old copy is dropped, the new one not made
    assert engine.weights.params == "v1" and engine.prepared == ["v0", "v1"]


@pytest.mark.parametrize("done", ["release", "end"])
def test_the_prepared_copy_is_freed_when_the_draw_is_done(done):
    engine = Engine()
    engine.update_weights("v0", 3)
    copy = weakref.ref(engine.weights)
    getattr(engine, done)()
    gc.collect()
    assert copy() is None  # the engine held the only reference
    assert engine.__dict__["_prepared"] is None and engine.version == 3
    assert engine.weights.params == "v0" and engine.prepared == ["v0", "v0"]  # the params stay: prepared again


def test_handing_an_engine_its_own_weights_back_prepares_nothing_twice():
    """A wrapper's ``sample`` may call ``update_weights(params)`` with the ``weights`` it
    was given (the public plugin's ``CountingEngine``): nothing is prepared twice."""
    engine = Engine()
    engine.update_weights("v0", 0)
    w = engine.weights
    engine.update_weights(w, 0)
    assert engine.weights is w and engine.prepared == ["v0"]


def test_without_a_preparation_the_params_are_read_as_they_are():
    class Plain(Engine):
        prepare = None

        def __init__(self):
            self.sampling = None

    engine = Plain()
    params = object()
    engine.update_weights(params, 2)
    assert engine.weights is params


def test_an_engine_that_does_not_call_super_gets_the_raw_params():
    class Pushing(Engine):
        def update_weights(self, params, version=0):
            self.pushed = (params, version)  # e.g. to an external server

    engine = Pushing()
    engine.update_weights("trained", 5)
    assert engine.pushed == ("trained", 5) and engine.prepared == []


def test_an_engine_written_before_the_contract_is_handed_what_it_is_given():
    class Legacy:
        sampling = None

        def sample(self, params, prompt_tokens, prompt_mask, rng, examples):
            return params

    with pytest.warns(DeprecationWarning):
        engine = as_engine(Legacy(), name="legacy")
    assert isinstance(engine, _Wrapped) and engine.prepare is None
    engine.prepare = Prepared  # what the program builder gives an engine that has none
    engine.update_weights("v0", 1)
    w = engine.weights
    assert engine.sample(w, None, None, None, []) is w and w.params == "v0"
