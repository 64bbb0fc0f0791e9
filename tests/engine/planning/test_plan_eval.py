"""`grpo plan` and evaluation: the eval sampler's programs are compiled and count in the
peak; the byte model of the reference pass and the optimizer. Tiny shapes."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("libtpu")

from grpo.core.config import load_config

pytestmark = pytest.mark.slow

TINY = {
    "model": {"source": "random", "random": {"preset": "tiny"}, "param_dtype": "bfloat16",
              "compute_dtype": "bfloat16", "remat": "full",
              # At the tiny head_dim of 16 Mosaic pads each head to 128 lanes, so splash's
              # eval prefill would outgrow the eval decode whose byte model is tested here.
              "attention": "xla"},
    "task": {"name": "arithmetic"},
    "rollout": {"num_generations": 4, "max_prompt_length": 16, "max_new_tokens": 16},
    "train": {"prompts_per_step": 8, "micro_batch_size": 8},
    "loss": {"impl": "jax"},
}


def _config(*overrides: str):
    return load_config(TINY, list(overrides))


def test_plan_compiles_the_eval_sampler_and_a_large_eval_does_not_fit():
    """Eval batches of 3 prompts x k=3 on 4 chips are padded to 4 prompts (12 rows); the
    eval programs are compiled and in the peak, their time is beside the step's. With a
    limit the training programs fit in, an eval decoding 64 x 64 rows does not fit."""
    from grpo.engine.planning.plan import Planner

    planner = Planner("v6e:2x2")
    base = planner.plan(_config())
    assert set(base["programs"]) - {"sequence_lengths", "pack", "unpack"} == {"prefill", "decode", "row_sums", "to_train",
                                                                               "update"} and base["eval"] is None
    assert base["roofline_eval_s"] is None

    small = planner.plan(_config("eval.every_n_steps=10", "eval.k=3", "eval.greedy=false", "eval.batch_size=3",
                                 "eval.num_examples=7"))
    assert set(small["programs"]) - {"sequence_lengths", "pack", "unpack"} == {
        "prefill", "decode", "row_sums", "to_train", "update", "eval_prefill", "eval_decode"}
    ev = small["eval"]
    assert (ev["prompts_per_batch"], ev["padded_prompts_per_batch"], ev["rows_per_batch"], ev["batches"]) == (
        3, 4, 12, 3)
    for name in ("eval_prefill", "eval_decode"):
        p = small["programs"][name]
        assert p["argument_bytes"] > 0 and p["flops"] > 0 and p["roofline_s"] > 0 and p["compiler_error"] is None
        assert p["peak_bytes"] <= small["peak_bytes_per_device"]
    # 12 rows decoded vs the step's 32, the same cache length: fewer flops.
    assert small["programs"]["eval_decode"]["flops"] < small["programs"]["decode"]["flops"]
    assert small["roofline_step_s"] == pytest.approx(base["roofline_step_s"])
    assert small["roofline_eval_s"] == pytest.approx(3 * ev["roofline_batch_s"])
    assert ev["roofline_batch_s"] == pytest.approx(
        small["programs"]["eval_prefill"]["roofline_s"] + small["programs"]["eval_decode"]["roofline_s"])

    big_eval = _config("eval.every_n_steps=10", "eval.k=64", "eval.greedy=false", "eval.batch_size=64")
    big = planner.plan(big_eval)
    assert big["peak_bytes_per_device"] == big["programs"]["eval_decode"]["peak_bytes"]
    # k and v of 4096 / 4 rows per chip, 16 prompt slots and the decode's, bf16.
    programs, _, arch = planner.build(big_eval)
    slots = 16 + programs.eval_sampler().plan()[-1][1]
    per_slot = arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
    assert big["eval"]["kv_cache_bytes"] == 2 * 1024 * slots * per_slot * 2
    # Against a limit just above the training programs' peak (compiled programs are cached).
    planner.hbm_bytes = int(base["peak_bytes_per_device"] * 1.02)
    assert planner.plan(_config())["fits"] is True
    assert planner.plan(big_eval)["fits"] is False


def _costs(*overrides: str, topology: str = "v6e:2x2"):
    from grpo.engine.planning.costs import program_costs
    from grpo.engine.planning.plan import Planner

    planner = Planner(topology)
    programs, _, arch = planner.build(_config(*overrides))
    return programs, arch, program_costs(programs, arch, planner.topology.chip)


def test_reference_pass_reads_the_weights_once_per_micro_batch():
    beta = ("loss.beta=0.04", "train.prompts_per_step=16")  # 64 sequences
    _, _, one = _costs(*beta, "train.micro_batch_size=64")
    _, _, four = _costs(*beta, "train.micro_batch_size=16")
    assert four["reference"].flops == pytest.approx(one["reference"].flops)
    assert four["reference"].bytes == pytest.approx(4 * one["reference"].bytes)


def test_optimizer_bytes_split_over_fsdp_and_tp_only():
    """dp replicates the optimizer state: on 4 chips dp=2 x fsdp=2 reads and writes twice
    the optimizer bytes per chip that fsdp=4 does (bf16 params and grads, f32 master and
    two moments: 2 x (2 x 2 + 3 x 4) bytes per parameter, read and written)."""
    _, arch, fsdp4 = _costs("mesh.policy=explicit", 'mesh.options={shape: "1,4,1"}')
    _, _, dp2 = _costs("mesh.policy=explicit", 'mesh.options={shape: "2,2,1"}')
    per_param = 2 * (2 * 2 + 3 * 4)
    n = arch.num_params()
    assert dp2["update"].bytes - fsdp4["update"].bytes == pytest.approx(n * per_param * (1 / 2 - 1 / 4))
    assert math.isclose(dp2["prefill"].bytes, fsdp4["prefill"].bytes)
