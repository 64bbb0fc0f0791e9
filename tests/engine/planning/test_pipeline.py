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
    round; 3 + 1: three), over ICI (half the chip's bidirectional figure)."""
    from grpo.engine.planning.pipeline import weight_sync_by_processes

    even = weight_sync_by_processes(sent_bytes=6e9, rollout_chips=8, update_chips=8, bandwidth_bytes_per_s=2e11)
    assert even == {"received_bytes_per_chip": 6e9, "sent_bytes_per_chip": 6e9, "bytes": 6e9, "link": "ici",
                    "seconds": 6e9 / 2e11}
    assert weight_sync_by_processes(sent_bytes=1.0, rollout_chips=12, update_chips=4,
                                    bandwidth_bytes_per_s=1.0)["seconds"] == 3.0
    assert weight_sync_by_processes(sent_bytes=1.0, rollout_chips=4, update_chips=12,
                                    bandwidth_bytes_per_s=1.0)["seconds"] == 1.0


def test_a_weight_sync_between_slices_is_costed_over_the_data_center_network():
    """Issue 51, item 3: the sides paired as the exchange pairs them (rollout device i
    with update device i mod n, and back); one pair on two slices sends the move over DCN
    at the chip's share of its host's NICs (v6e: 4 x 200 Gbps for 8 chips, 12.5 GB/s a
    chip), else over ICI at half the chip's 800 GB/s. 2 + 2 hosts of two v6e-8 slices:
    Qwen2.5-3B's 6.17 GB of bf16 weights take 0.49 s over DCN against 15 ms over ICI."""
    import types

    from grpo.engine.planning.pipeline import sync_link, weight_sync_by_processes
    from grpo.engine.planning.tpu import CHIPS

    def chips(slices):
        return [types.SimpleNamespace(slice_index=s) for s in slices]

    v6e = CHIPS["v6e"]
    assert v6e.dcn_bandwidth == 100e9 / 8 and CHIPS["v5p"].dcn_bandwidth == 50e9 / 8
    assert CHIPS["v5e"].dcn_bandwidth == 25e9 / 8 and all(c.dcn_source for c in CHIPS.values())
    one = sync_link(v6e, chips([0] * 8), chips([0] * 8))
    assert one == {"link": "ici", "bandwidth_bytes_per_s": 400e9}
    two = sync_link(v6e, chips([0] * 8), chips([1] * 8))
    assert two == {"link": "dcn", "bandwidth_bytes_per_s": 12.5e9}
    # Each side on both slices, but every pair within one: ICI.
    assert sync_link(v6e, chips([0, 1]), chips([0, 1]))["link"] == "ici"
    assert sync_link(v6e, chips([0, 0, 1, 1]), chips([0, 1]))["link"] == "dcn"  # rollout 1 pairs with update 1
    weights = 6_171_877_376
    over_dcn = weight_sync_by_processes(sent_bytes=weights, rollout_chips=8, update_chips=8, **two)
    over_ici = weight_sync_by_processes(sent_bytes=weights, rollout_chips=8, update_chips=8, **one)
    assert over_dcn["link"] == "dcn" and over_dcn["seconds"] == pytest.approx(weights / 12.5e9)
    assert round(over_dcn["seconds"], 2) == 0.49 and round(over_ici["seconds"] * 1e3) == 15


def test_collectives_across_slices_are_timed_over_the_data_center_network():
    """Issue 51, item 3: a collective whose group spans two slices is costed at the chip's
    DCN share (was bytes only, no time), and enters the roofline beside ICI."""
    from grpo.engine.planning import hlo
    from grpo.engine.planning.costs import Cost, communication
    from grpo.engine.planning.tpu import CHIPS

    op = hlo.Collective(kind="all-reduce", name="ar", computation="main", loops=(), executions=1,
                        shape="f32[1000]", buffer_bytes=4000, group_size=2, groups=((0, 1),), received_bytes=1e9)
    cost = Cost(flops=0.0, bytes=0.0, roofline_s=0.01)
    apart = communication([op], "test", cost, CHIPS["v6e"], slice_of=[0, 1])
    assert apart["dcn_bytes"] == 1e9 and apart["ici_bytes"] == 0
    assert apart["dcn_s"] == pytest.approx(1e9 / 12.5e9) and apart["roofline_s"] == pytest.approx(0.08)
    together = communication([op], "test", cost, CHIPS["v6e"], slice_of=[0, 0])
    assert together["dcn_bytes"] == 0 and together["dcn_s"] == 0.0
    assert together["roofline_s"] == pytest.approx(max(0.01, 1e9 / 400e9))
