"""``grpo plan --lengths``: the packed bins of a profile and the packed passes' costs, at
the cost-model level (no compile), against padded layouts of the same work."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from grpo.core.config import load_config
from grpo.core.contracts import MeshLayout
from grpo.engine.planning import packed, profiles
from grpo.engine.planning.costs import padded_work, training_costs
from grpo.engine.planning.tpu import CHIPS
from grpo.models.presets import preset_config


def programs_for(*, preset: str, rows: int, micro: int, prompt: int, cap: int, fsdp: int, impl: str = "jax",
                 beta: float = 0.0):
    """What the cost model and the bin plan read of a RunPrograms: config, layout."""
    config = load_config({
        "model": {"source": "random", "random": {"preset": preset}, "param_dtype": "bfloat16",
                  "compute_dtype": "bfloat16", "remat": "full"},
        "task": {"name": "arithmetic"},
        "rollout": {"num_generations": 8, "max_prompt_length": prompt, "max_new_tokens": cap},
        "train": {"prompts_per_step": rows // 8, "micro_batch_size": rows // micro},
        "loss": {"impl": impl, "beta": beta},
    })
    layout = MeshLayout(dp=1, fsdp=fsdp, tp=1)
    return SimpleNamespace(config=config, layout=layout, lora_dropout=False), preset_config(preset)


def lengths_file(tmp_path, values):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, values)) + "\n")
    return profiles.load_profile(str(path))


def test_two_sequences_a_bin_cost_what_rows_of_their_length_cost(tmp_path):
    """32-token sequences (16 prompt + 16 completion) two to a 64-token bin: the layers and
    a segment-aware attention see exactly the work of padded 32-token rows, and the loss's
    head (on the completion slots only: the head layout) exactly theirs too. XLA's
    attention computes each bin's whole square: twice the pairs."""
    progs, arch = programs_for(preset="tiny", rows=32, micro=1, prompt=16, cap=48, fsdp=4, beta=0.04)
    bp = packed.plan_bins(progs, lengths_file(tmp_path, [16]), prompt_length=16)
    assert (bp.bin_length, bp.max_per, bp.bins) == (64, 8, 16)  # 32 rows of 64 a micro-batch on 4 chips
    assert all(d["efficiency"] == 1.0 and d["bins_used"] == 16 for d in bp.draws)
    assert all((d["micro_batches"], d["per"]) == (1, 4) for d in bp.draws)
    # The accelerators' shape grid (issue 50): 1, 2, 4 or 8 bins per device, each with 4
    # head widths (multiples of a quarter of per x 64 slots)
    assert bp.bin_shapes == 4 and bp.compile_bound == 16
    assert all(d["head"] == 128 for d in bp.draws)  # 8 sequences x 16 completion slots a device
    chip = CHIPS["v6e"]
    got = packed.packed_costs(progs, arch, chip, bp, "splash")
    rows = padded_work(rows=32 / 4, prompt_length=16, max_new_tokens=16)
    want = training_costs(progs, arch, chip, rows)
    assert got["update"].flops == pytest.approx(want["update"].flops)
    assert got["reference"].flops == pytest.approx(want["reference"].flops)
    assert got["update"].bytes == want["update"].bytes  # same weight reads per micro-batch
    xla = packed.packed_costs(progs, arch, chip, bp, "xla")
    attn = 4 * arch.num_attention_heads * arch.head_dim * arch.num_hidden_layers * (16 / 4 * 64 * 64 - 8 * 32 * 32)
    assert xla["reference"].flops - got["reference"].flops == pytest.approx(attn)
    assert xla["update"].flops - got["update"].flops == pytest.approx(4 * attn)  # fwd, bwd x2, remat


def test_sequences_that_fill_their_bins_cost_the_padded_rows(tmp_path):
    """A bin a sequence: the padded rows' work, the head's included (the head layout skips
    the prompt slots); a head width rounded up past the completions costs its slots."""
    progs, arch = programs_for(preset="tiny", rows=32, micro=2, prompt=16, cap=48, fsdp=4)
    bp = packed.plan_bins(progs, lengths_file(tmp_path, [48]), prompt_length=16)
    assert bp.bins == 32 and bp.max_per == 4 and bp.per == 4  # 2 micro-batches of 4 bins x 4 chips
    chip = CHIPS["v6e"]
    got = packed.packed_costs(progs, arch, chip, bp, "splash")["update"]
    want = training_costs(progs, arch, chip, padded_work(rows=8, prompt_length=16, max_new_tokens=48))["update"]
    assert got.flops == pytest.approx(want.flops)
    bp = packed.plan_bins(progs, lengths_file(tmp_path, [44]), prompt_length=16)  # 4 x 44 = 176 -> K = 192
    assert all(d["head"] == 192 for d in bp.draws)
    got = packed.packed_costs(progs, arch, chip, bp, "xla")["update"]  # each bin's whole square, as padded
    want = training_costs(progs, arch, chip, padded_work(rows=8, prompt_length=20, max_new_tokens=44))["update"]
    assert got.flops == pytest.approx(want.flops + 8 * 4 * 3 * 2 * arch.hidden_size * arch.vocab_size)


# One micro-batch (micro 1): the grid rounds 7 bins a device up to 8 (issue 50's coarse
# shape grid: 56 -> 64 bins, 0.43 -> 0.47 of the padded update).
@pytest.mark.parametrize("micro, most", [(1, 0.48), (4, 0.45)])
def test_recipe_update_at_the_builtin_profile(micro, most):
    """Qwen2.5-3B on a v6e-8 (128 sequences, 256 + 1,024 tokens, pallas loss), every prompt
    at its full 256 tokens (the profile's upper bound): about 55 bins of 1,280 tokens hold a
    step, scheduled as m micro-batches of per bins per device (m x 8 x per the smallest at
    least the bins used, per within the configured micro-batch): 56 bins as 7 x 1 (or 1 x 7
    with one micro-batch), not 64."""
    from grpo.engine.training.packing import micro_schedule, per_grid

    progs, arch = programs_for(preset="qwen2.5-3b", rows=128, micro=micro, prompt=256, cap=1024, fsdp=8, impl="pallas")
    bp = packed.plan_bins(progs, profiles.load_profile("gsm8k-qwen25-3b-v6e8"), prompt_length=256)
    pers = per_grid(bp.max_per, "pow2")  # the accelerators' shape grid (issue 50)
    assert bp.max_per == 16 // micro and bp.bin_shapes == len(bp.schedules) <= len(pers)
    assert bp.compile_bound <= 4 * bp.bin_shapes
    for d in bp.draws:
        assert (d["micro_batches"], d["per"]) == micro_schedule(d["bins_used"], devices=8, max_per=bp.max_per,
                                                                pers=pers)
        assert d["bins"] == 8 * d["micro_batches"] * d["per"] >= d["bins_used"]
        if micro == 4:  # per 1 to 4 on the grid 1, 2, 4: no rounding beyond whole bins per device at this profile
            assert d["bins"] == 8 * math.ceil(d["bins_used"] / 8)
    assert all(50 <= d["bins_used"] <= 64 for d in bp.draws)  # 128 x ~527 real tokens / 1,280
    chip = CHIPS["v6e"]
    pack = packed.packed_costs(progs, arch, chip, bp, "splash")["update"]
    pad = training_costs(progs, arch, chip, padded_work(rows=128 / 8, prompt_length=256, max_new_tokens=1024))["update"]
    assert pack.roofline_s <= most * pad.roofline_s
    # Valid tokens: the profile's mean completion per sequence.
    assert abs(bp.mean("valid_tokens") / 128 - 271) < 30
