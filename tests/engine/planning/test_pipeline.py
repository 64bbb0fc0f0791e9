"""The asynchronous split's plan arithmetic (grpo/engine/planning/pipeline.py)."""

from __future__ import annotations

import pytest

from grpo.core.errors import UserError
from grpo.engine.planning.pipeline import async_section, pipelined, split_devices, weight_sync


def test_split_defaults_to_half_and_whole_hosts():
    assert split_devices(devices=8, per_process=8, processes=1, rollout_devices=None) == (4, 4)
    assert split_devices(devices=8, per_process=8, processes=1, rollout_devices=6) == (6, 2)
    assert split_devices(devices=16, per_process=4, processes=4, rollout_devices=None) == (8, 8)
    assert split_devices(devices=12, per_process=4, processes=3, rollout_devices=None) == (4, 8)


@pytest.mark.parametrize("kw, needle", [
    (dict(devices=8, per_process=8, processes=1, rollout_devices=8), "leave devices to both sides"),
    (dict(devices=16, per_process=4, processes=4, rollout_devices=6), "whole hosts"),
])
def test_a_split_without_devices_or_across_a_host_names_the_field(kw, needle):
    with pytest.raises(UserError, match="train.async.rollout_devices") as err:
        split_devices(**kw)
    assert needle in str(err.value)


def test_weight_sync_is_the_larger_side_over_half_the_ici():
    # 4 rollout chips of 1.5 GB each from 2 update chips: 3 GB sent by each, at 400 GB/s.
    ws = weight_sync(rollout_bytes_per_chip=1.5e9, rollout_chips=4, update_chips=2, ici_bandwidth=800e9)
    assert ws == {"received_bytes_per_chip": 1.5e9, "sent_bytes_per_chip": 3e9, "seconds": pytest.approx(3e9 / 400e9),
                  "moves": "weights", "full_bytes_per_chip": 1.5e9, "share": 1.0}


def test_a_lora_weight_sync_moves_the_adapters_alone():
    """Issue 51 (LoRA: adapter-only sync): the step's transfer is the adapters' bytes; the
    whole weights' are kept beside it for the share."""
    ws = weight_sync(rollout_bytes_per_chip=1.5e9, rollout_chips=4, update_chips=2, ici_bandwidth=800e9,
                     adapter_bytes_per_chip=3e7)
    assert ws["moves"] == "adapters" and ws["received_bytes_per_chip"] == 3e7 and ws["sent_bytes_per_chip"] == 6e7
    assert ws["seconds"] == pytest.approx(6e7 / 400e9) and ws["share"] == pytest.approx(0.02)
    assert ws["full_bytes_per_chip"] == 1.5e9


def test_pipelined_step_and_section():
    assert pipelined(rollout_s=2.0, update_s=0.5, sync_s=0.1) == 2.0
    assert pipelined(rollout_s=0.3, update_s=0.5, sync_s=0.1) == pytest.approx(0.6)
    a = async_section(split=(4, 4), synchronous_s=2.0, rollout={"whole_s": 1.2, "steady_s": 0.4, "slots": 64},
                      update_s=0.6, sync={"seconds": 0.1, "received_bytes_per_chip": 1, "sent_bytes_per_chip": 1},
                      valid_tokens=1000.0, update_fits=True, rollout_fits=True)
    assert a["pipelined_step_s"] == pytest.approx(1.2) and a["ratio"] == pytest.approx(0.6)
    assert a["pipelined_partial_step_s"] == pytest.approx(0.7) and a["partial_ratio"] == pytest.approx(0.35)
    assert a["valid_tokens_per_s_partial"] == pytest.approx(1000 / 0.7) and a["fits"]
    assert (a["rollout_engine"], a["rollout_costed_as"]) == (None, None)  # not said: not claimed


def test_the_section_says_how_the_rollout_side_was_costed():
    """The rollout side is costed as the synchronous headline costs the rollout: the
    config's engine, its simulated schedule or the programs at the cap."""
    from grpo.engine.planning.report import format_async

    sync = {"seconds": 0.004, "received_bytes_per_chip": 1.5e9, "sent_bytes_per_chip": 1.5e9}
    for engine, how, text in (("continuous", "schedule", "the continuous engine's simulated schedule"),
                              ("static", "programs", "the static engine's programs (every row to the cap)")):
        a = async_section(split=(8, 8), synchronous_s=1.2, rollout={"whole_s": 1.1, "engine": engine,
                                                                     "costed_as": how},
                          update_s=0.1, sync=sync, valid_tokens=None, update_fits=True, rollout_fits=True)
        assert (a["rollout_engine"], a["rollout_costed_as"]) == (engine, how)
        assert a["pipelined_step_s"] == 1.1 and a["ratio"] == pytest.approx(1.1 / 1.2)
        lines = format_async({**a, "rollout_mesh": {"tp": 4}, "update_mesh": {"fsdp": 8}, "rollout_peak_bytes": 1,
                              "update_peak_bytes": 1})
        assert f"  rollout side costed as {text}" in lines


def test_the_weight_sync_between_hosts_is_costed_as_the_run_moves_it():
    """Issue 51: split by hosts the sent tree arrives whole on every rollout chip, each
    update chip sending it once a round (2 + 2 hosts of a v6e-16: one round; 1 + 3: one
    round; 3 + 1: three), over ICI."""
    from grpo.engine.planning.pipeline import weight_sync_by_processes

    even = weight_sync_by_processes(sent_bytes=6e9, rollout_chips=8, update_chips=8, ici_bandwidth=4e11)
    assert even == {"received_bytes_per_chip": 6e9, "sent_bytes_per_chip": 6e9, "bytes": 6e9, "seconds": 6e9 / 2e11}
    assert weight_sync_by_processes(sent_bytes=1.0, rollout_chips=12, update_chips=4, ici_bandwidth=2.0)["seconds"] == 3.0
    assert weight_sync_by_processes(sent_bytes=1.0, rollout_chips=4, update_chips=12, ici_bandwidth=2.0)["seconds"] == 1.0
