"""The one place a mode is chosen (grpo/engine/loop/factory.py): each mode's source x
weight sync, and the loop's ledger advancing once a step (a fake trainer: no compile)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from _runs import _config

from grpo.core.errors import UserError
from grpo.engine.loop.buffer import Buffered
from grpo.engine.loop.factory import build_loop
from grpo.engine.loop.loop import Loop
from grpo.engine.loop.sources import BackgroundSource, InlineSource, PartialSource, RolloutSource
from grpo.engine.loop.sync import OtherMesh, SameDevices, WeightSync


def test_a_synchronous_run_draws_in_line_on_its_own_devices():
    engine = object()
    trainer = types.SimpleNamespace(meshes=None, collector=types.SimpleNamespace(sampler=engine), programs=object(),
                                    frozen=None, config=_config(), data_position=0)
    loop = build_loop(trainer, trainer.programs)
    assert type(loop) is Loop and loop.max_staleness is None
    assert type(loop.source) is InlineSource and type(loop.sync) is SameDevices
    assert loop.sync.engine is engine  # the weights enter the engine the source draws with
    assert loop.source.lead == 0 and not loop.source.checkpoints_buffer


@pytest.mark.parametrize("partial", [False, True])
def test_a_one_process_async_run_draws_in_the_background_on_another_mesh(monkeypatch, partial):
    import grpo.engine.loop.factory as factory

    monkeypatch.setattr(factory, "processes", lambda meshes: 1)
    monkeypatch.setattr(factory, "OtherMesh", lambda programs, engine, params, frozen: OtherMesh.__new__(OtherMesh))
    monkeypatch.setattr(PartialSource, "__init__", lambda self, c, update, max_staleness: setattr(self, "lead", 1))
    monkeypatch.setattr(BackgroundSource, "__init__", lambda self, c, update, max_staleness: setattr(self, "lead", 2))
    monkeypatch.setattr(PartialSource, "reset", lambda self, ledger: None)
    config = _config(**{"train.async": {"enabled": True, "max_staleness": 2}})
    config.train.async_.partial_rollouts = partial
    trainer = types.SimpleNamespace(meshes=object(), collector=types.SimpleNamespace(sampler=object()),
                                    programs=object(), params=None, frozen=None, config=config, data_position=0)
    loop = build_loop(trainer, object())
    assert type(loop.source) is (PartialSource if partial else BackgroundSource) and type(loop.sync) is OtherMesh
    assert loop.max_staleness == 2


class _Drawn(RolloutSource):
    """Whole batches of 3 prompts (2 rows each) drawn in line, as a synchronous run's."""

    def draw(self, *, step, position, version, sample_group):
        rollout = types.SimpleNamespace(prompts_drawn=3, group=None, rollout_s=0.0,
                                        output=types.SimpleNamespace(tokens=np.zeros((6, 4))))
        return Buffered(step=step, position=position, versions=np.full(6, version), rollout=rollout)


class _Synced(WeightSync):
    def __init__(self):
        self.versions = []

    def sync(self, params, version):
        self.versions.append(version)


class _Trainer:
    """The trainer's stages, recorded."""

    def __init__(self):
        self.config = types.SimpleNamespace(group_size=2, logging=types.SimpleNamespace(every_n_steps=1))
        self.step, self.data_position, self.is_main, self.params = 0, 0, True, "weights"
        self.trained, self.observed, self.rewards_fail_at = [], [], ()

    def advantages(self, rollout):
        return np.zeros(6)

    def selection_scalars(self, rollout, advantages):
        return {}

    def update_batch(self, rollout, advantages):
        return rollout

    def optimize(self, batch):
        self.trained.append((self.step, self.data_position))
        return [], None

    def row_logprobs(self, logprobs, shape):
        return logprobs

    def observe_rewards(self, rollout):
        self.observed.append(self.step)
        if self.step in self.rewards_fail_at:  # a reward function failed on every row of this step
            raise UserError(f"reward function 'r' failed on every completion of step {self.step + 1}")
        return {"reward/r/not_applicable": 1.0}

    def metrics_row(self, rollout, epochs, logprobs, times, selection, not_applicable=None):
        return {"step": self.step, **(not_applicable or {})}


def test_the_loop_advances_the_step_ledger_and_weights_once_a_step():
    trainer, sync = _Trainer(), _Synced()
    loop = Loop(trainer, _Drawn(), sync, max_staleness=None)
    rows = [loop.step() for _ in range(3)]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert trainer.trained == [(0, 0), (1, 3), (2, 6)]  # each step trained at the ledger's position
    assert (trainer.step, trainer.data_position, loop.ledger.frontier) == (3, 9, 9)
    assert sync.versions == [0, 1, 2, 3]  # the start's weights, then once after every update
    assert not loop.buffer
    assert trainer.observed == [0, 1, 2] and rows[0]["reward/r/not_applicable"] == 1.0


class _Ahead(_Drawn):
    """A source that draws one step ahead while the update trains (as the asynchronous
    ones do), recording when it was asked to."""

    lead = 1

    def __init__(self):
        self.asked = []

    def ahead(self, loop):
        self.asked.append(loop.cursor()["step"])
        return None


@pytest.mark.parametrize("source", [_Drawn, _Ahead])
def test_a_step_whose_reward_failed_everywhere_stops_before_its_update(source):
    """Issue 49 item 8: a reward function failing on every row of a step stopped the run
    only in the metrics row, after that step's optimizer step had trained on its zero
    rewards. Now the loop reads the failures before the update (and before drawing
    ahead): step 2 stops with nothing of it trained, in every mode (one loop)."""
    trainer, src = _Trainer(), source()
    trainer.rewards_fail_at = (1,)
    loop = Loop(trainer, src, _Synced(), max_staleness=None if source is _Drawn else 1)
    loop.step()
    with pytest.raises(UserError, match="step 2"):
        loop.step()
    assert trainer.trained == [(0, 0)]  # step 1's update only
    assert (trainer.step, trainer.data_position) == (1, 3)
    if source is _Ahead:
        assert src.asked == [1]  # asked once, while step 1 trained; not by the failed step 2
