"""The device split of asynchronous GRPO: sizes and config errors naming the field."""

from __future__ import annotations

import jax
import pytest

from _runs import _config

from grpo.core.errors import ConfigError, UserError
from grpo.engine.parallel.split import async_meshes, split_devices


def test_split_takes_the_first_devices_for_the_rollout():
    devices = jax.devices()  # 8 CPU devices (conftest)
    rollout, update = split_devices(devices, rollout_devices=None)
    assert len(rollout) == len(update) == 4 and not set(rollout) & set(update)
    rollout, update = split_devices(devices, rollout_devices=2)
    assert [d.id for d in rollout] == [0, 1] and [d.id for d in update] == [2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("n, side", [(8, "update"), (9, "update")])
def test_a_side_without_devices_is_a_config_error(n, side):
    with pytest.raises(ConfigError) as err:
        split_devices(jax.devices(), rollout_devices=n)
    assert "train.async.rollout_devices" in str(err.value) and f"{side} mesh without devices" in str(err.value)
    assert err.value.exit_code == 2


def test_the_field_is_bounded_below():
    with pytest.raises(UserError, match="rollout_devices"):
        _config(**{"train.async": {"enabled": True, "rollout_devices": 0}})


def test_meshes_of_a_fitting_split():
    config = _config(**{"train.prompts_per_step": 12, "train.async": {"enabled": True, "rollout_devices": 2}})
    meshes = async_meshes(config)
    assert meshes.rollout.mesh.devices.size == 2 and meshes.update.mesh.devices.size == 6
    assert {d.id for d in meshes.update.mesh.devices.flat} == {2, 3, 4, 5, 6, 7}


@pytest.mark.parametrize("rollout_devices, prompts, side", [(3, 8, "rollout"), (2, 10, "update")])
def test_a_split_the_batch_does_not_divide_names_the_field(rollout_devices, prompts, side):
    # 8 prompts x 2 samples = 16 rows: 3 rollout shards do not divide them; 10 x 2 = 20
    # rows divide the rollout's 2 devices but not the update's 6.
    config = _config(**{"train.prompts_per_step": prompts,
                        "train.async": {"enabled": True, "rollout_devices": rollout_devices}})
    with pytest.raises(ConfigError) as err:
        async_meshes(config)
    msg = str(err.value)
    assert f"train.async.rollout_devices={rollout_devices}" in msg and f"{side} mesh of" in msg


def test_a_split_that_does_not_fit_the_rollout_style():
    # maxtext needs dp == process count on its mesh: an explicit dp=2 mesh cannot be laid
    # over the rollout's devices as the style wants.
    config = _config(**{"rollout.style": "maxtext", "mesh": {"policy": "explicit", "options": {"shape": [2, -1, 1]}},
                        "train.async": {"enabled": True, "rollout_devices": 4}})
    with pytest.raises(ConfigError, match=r"train.async.rollout_devices=4 .* rollout mesh"):
        async_meshes(config)


class _Device:
    """A stand-in for a device of a multi-process run (what the split reads of one)."""

    def __init__(self, process_index: int, id: int):
        self.process_index, self.id = process_index, id

    def __repr__(self):
        return f"dev{self.id}@{self.process_index}"


_TWO_BY_FOUR = [_Device(p, 4 * p + i) for p in (1, 0) for i in range(4)]  # 2 processes x 4, unordered


def test_two_processes_split_one_a_side():
    """2 processes x 4 devices, the default half or 4: process 0's devices roll out,
    process 1's update (grpo/engine/loop/processes.py)."""
    for r in (None, 4):
        rollout, update = split_devices(_TWO_BY_FOUR, rollout_devices=r)
        assert [(d.process_index, d.id) for d in rollout] == [(0, i) for i in range(4)]
        assert [(d.process_index, d.id) for d in update] == [(1, 4 + i) for i in range(4)]


@pytest.mark.parametrize("processes, per, rollout_devices, want", [
    (4, 2, 4, ([0, 1], [2, 3])),  # 2 + 2
    (4, 2, None, ([0, 1], [2, 3])),  # the default: half the processes
    (3, 2, None, ([0], [1, 2])),  # ... rounded down: whole processes (half the devices, 3, would split one)
    (3, 2, 4, ([0, 1], [2])),
    (8, 4, 8, ([0, 1], [2, 3, 4, 5, 6, 7])),  # v6e-32 as 2 + 6 hosts
])
def test_several_processes_a_side(processes, per, rollout_devices, want):
    """Issue 51: any number of whole processes a side (a v6e-16 as 2 + 2 hosts), and the
    default split is whole processes (it was half the devices: 3 of 3 x 2 split a process)."""
    devices = [_Device(p, per * p + i) for p in reversed(range(processes)) for i in range(per)]
    rollout, update = split_devices(devices, rollout_devices=rollout_devices)
    assert (sorted({d.process_index for d in rollout}), sorted({d.process_index for d in update})) == want
    assert [d.id for d in rollout + update] == list(range(processes * per))


@pytest.mark.parametrize("devices, rollout_devices, why", [
    (_TWO_BY_FOUR, 2, "does not split this run's 8 devices (of 2 processes) by whole processes"),
    (_TWO_BY_FOUR, 6, "does not split this run's 8 devices (of 2 processes) by whole processes"),
    ([_Device(p, 2 * p + i) for p in range(4) for i in range(2)], 3,
     "does not split this run's 8 devices (of 4 processes) by whole processes"),
])
def test_other_multiprocess_splits_are_refused_naming_the_field(devices, rollout_devices, why):
    """A process on both sides (2 or 6 of 2 x 4, 3 of 4 x 2): exit status 2, the message
    naming ``train.async.rollout_devices`` and the case."""
    with pytest.raises(ConfigError) as err:
        split_devices(devices, rollout_devices=rollout_devices)
    msg = str(err.value)
    assert err.value.exit_code == 2 and f"train.async.rollout_devices={rollout_devices} " in msg
    assert why in msg and "train.async.enabled=false" in msg


def test_every_feature_but_continuous_multi_turn_runs_over_processes():
    """Issue 51: evaluation, the continuous engine, dynamic sampling, LoRA/QLoRA and now
    partial rollouts (the stream on the rollout processes, its rows in flight crossing
    for the checkpoint: tests/integration/test_asynchronous_processes.py) pass the
    split's check for 2 + 2 processes; partial rollouts were refused before."""
    from grpo.engine.parallel.split import validate_split

    validate_split(_config(**{
        "train.async": {"enabled": True, "max_staleness": 2, "partial_rollouts": True}, "rollout.engine": "continuous",
        "model.lora": {"rank": 4}, "eval.every_n_steps": 2}), 4, 2)
    validate_split(_config(**{"train.async": {"enabled": True}, "train.dynamic_sampling.enabled": True,
                              "rollout.engine": "continuous", "model.lora": {"rank": 4, "base_quantization": "int8"}}),
                   4, 2)


def test_a_side_without_devices_is_reported_before_the_processes():
    with pytest.raises(ConfigError, match="leaves the update mesh without devices"):
        split_devices(_TWO_BY_FOUR, rollout_devices=8)


def test_a_multi_turn_task_runs_over_processes_on_either_engine():
    """Issue 51: a task with tools was refused over processes (its turns' host side
    gathered over every process); the static engine's turns gather over the rollout
    side's processes, and (issue 51, round 8) so do the continuous engine's, whose turn
    scheduler runs on every rollout process over every row's tokens (refused before
    when the rollout side had several processes): validate passes both on 1 + 1 and
    2 + 2 processes."""
    from grpo.engine.parallel.split import validate_split

    config = _config(**{"task": {"name": "lookup"}, "train.async": {"enabled": True}})
    continuous = _config(**{"task": {"name": "lookup"}, "train.async": {"enabled": True},
                            "rollout.engine": "continuous"})
    for c in (config, continuous):
        validate_split(c, 2, 4)
        validate_split(c, 4, 2)
    validate_split(config, 1, 8)
    validate_split(_config(**{"train.async": {"enabled": True}, "eval.every_n_steps": 1}), 2, 4)
