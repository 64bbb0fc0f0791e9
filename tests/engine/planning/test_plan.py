"""`grpo plan`: the run's programs compiled by the TPU compiler (libtpu) for a pod this
machine does not have. Tiny shapes: each plan compiles in seconds."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from click.testing import CliRunner

pytest.importorskip("libtpu")

from conftest import ROOT  # noqa: E402
from grpo.core.cli import cli  # noqa: E402

pytestmark = pytest.mark.slow

TINY = {
    "model": {"source": "random", "random": {"preset": "tiny"}, "param_dtype": "bfloat16",
              "compute_dtype": "bfloat16", "remat": "full"},
    "task": {"name": "arithmetic"},
    "rollout": {"num_generations": 4, "max_prompt_length": 16, "max_new_tokens": 16},
    "train": {"prompts_per_step": 8, "micro_batch_size": 8},
    "loss": {"impl": "jax"},
}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def plan(*args: str) -> tuple[int, dict | str]:
    res = CliRunner().invoke(cli, ["plan", *args], catch_exceptions=False)
    if res.exit_code == 0 and "--json" in args:
        return 0, json.loads(res.stdout)
    return res.exit_code, res.output  # stdout and stderr together


KEYS = {"topology", "processes", "devices", "mesh", "hbm_bytes_per_device", "programs", "peak_bytes_per_device",
        "fits", "margin_bytes", "compiler_error"}
PROGRAM_KEYS = {"argument_bytes", "output_bytes", "temp_bytes", "flops", "bytes_accessed", "roofline_s"}


def test_tiny_plan_fits_and_update_memory_grows_with_micro_batch(tiny_config, tmp_path):
    # 528-token sequences: the attention scores dominate the update's temps (at a few
    # dozen tokens XLA's buffers are all about the same size).
    # Padded (train.packing off): the update's micro-batch is rows of the cap, and the plan
    # skips packing's glue programs (the packed update's plan: test_plan_under_a_length_profile...).
    wide = ["--set", "rollout.max_new_tokens=512", "--set", "model.remat=none", "--set", "train.packing.enabled=false",
            "--set", "model.attention=xla"]
    code, small = plan(tiny_config, "--topology", "v6e:2x2", "--json", "--set", "train.micro_batch_size=8", *wide)
    assert code == 0, small
    code, big = plan(tiny_config, "--topology", "v6e:2x2", "--json", "--set", "train.micro_batch_size=32", *wide)
    assert code == 0, big
    # model.attention auto is splash on TPU: Mosaic compiles its forward and backward
    # kernels for v6e, and the update's temporaries lose the [rows, heads, T, T] scores.
    code, splash = plan(tiny_config, "--topology", "v6e:2x2", "--json", "--set", "train.micro_batch_size=32",
                        *wide[:-2], "--dump-hlo", str(tmp_path / "hlo"))
    assert code == 0, splash
    # The Mosaic kernels are in the compiled programs that use them, and only there.
    mosaic = {f.name.split(".")[0]: 'custom_call_target="tpu_custom_call"' in f.read_text()
              for f in (tmp_path / "hlo").glob("*.hlo.txt")}
    # The step's glue programs (row_sums, to_train) move arrays: no kernel of any kind.
    assert mosaic == {"prefill": True, "decode": False, "row_sums": False, "to_train": False, "update": True}, mosaic
    assert splash["attention"]["name"] == "splash" and big["attention"]["name"] == "xla"
    assert splash["attention"]["programs"] == {"prefill": "splash", "decode": "xla", "update": "splash"}
    assert splash["fits"] is True and splash["compiler_error"] is None
    assert splash["programs"]["update"]["temp_bytes"] < 0.5 * big["programs"]["update"]["temp_bytes"]
    for rep in (small, big):
        assert KEYS <= set(rep)
        assert rep["processes"] == 1 and rep["devices"] == 4
        assert rep["mesh"] == {"dp": 1, "fsdp": 4, "tp": 1}
        assert rep["fits"] is True and rep["compiler_error"] is None
        assert rep["margin_bytes"] == rep["hbm_bytes_per_device"] - rep["peak_bytes_per_device"] > 0
        assert set(rep["programs"]) == {"prefill", "decode", "row_sums", "to_train", "update"}  # beta = 0: no reference
        for name, p in rep["programs"].items():
            assert PROGRAM_KEYS <= set(p)
            # row_sums, to_train and packing's glue move arrays (their cost is bytes alone).
            assert p["argument_bytes"] > 0 and p["roofline_s"] > 0 and (
                p["flops"] > 0 or name in ("row_sums", "to_train", "sequence_lengths", "pack", "unpack"))
    # What the TPU compiler took for each program on this host (issue 50), and the shapes a
    # run compiles of it (padded: one update shape).
    c = small["compile"]
    assert c["programs"] == 5 and set(c["by_program"]) == set(small["programs"]) and c["shapes"] == 5
    assert all(p["compile_cpu_s"] > 0 and p["lower_s"] > 0 for p in c["by_program"].values())
    assert c["compile_cpu_s"] == pytest.approx(sum(p["compile_cpu_s"] for p in c["by_program"].values()))
    s, b = small["programs"]["update"], big["programs"]["update"]
    assert b["temp_bytes"] > s["temp_bytes"]
    assert big["peak_bytes_per_device"] >= small["peak_bytes_per_device"]
    # The rollout does not depend on the micro-batch.
    assert small["programs"]["decode"]["temp_bytes"] == big["programs"]["decode"]["temp_bytes"]
    # 4 times the rows per micro-batch, the same step: the same flops.
    assert s["flops"] == pytest.approx(b["flops"])
    assert b["temp_bytes"] > 2 * s["temp_bytes"]


def test_down_sampling_plans_the_rollout_and_the_update_rows_apart(tiny_config):
    """``train.down_sampling.keep``: the rollout of prompts x num_generations rows, the
    update of prompts x keep. Rolling out 8 of each prompt and training on 4 compiles the
    decode of an 8-sample run and the update of a 4-sample one."""
    args = (tiny_config, "--topology", "v6e:2x2", "--json")
    code, down = plan(*args, "--set", "rollout.num_generations=8", "--set", "train.down_sampling.keep=4")
    assert code == 0, down
    code, wide = plan(*args, "--set", "rollout.num_generations=8")
    assert code == 0, wide
    code, narrow = plan(*args)  # 4 samples per prompt
    assert code == 0, narrow
    assert (down["shape"]["sequences_per_step"], down["shape"]["rollout_sequences_per_step"]) == (32, 64)
    for name in ("prefill", "decode"):
        assert down["programs"][name]["flops"] == wide["programs"][name]["flops"]
        assert down["programs"][name]["temp_bytes"] == wide["programs"][name]["temp_bytes"]
    assert down["programs"]["update"]["flops"] == pytest.approx(narrow["programs"]["update"]["flops"])
    assert down["programs"]["update"]["flops"] < 0.6 * wide["programs"]["update"]["flops"]


def test_multi_host_plan_with_reference_pass(tiny_config):
    code, rep = plan(tiny_config, "--topology", "v6e:4x4", "--json", "--set", "train.prompts_per_step=16",
                     "--set", "train.micro_batch_size=16", "--set", "loss.beta=0.04")
    assert code == 0, rep
    assert rep["processes"] == 4 and rep["devices"] == 16
    assert rep["mesh"] == {"dp": 1, "fsdp": 16, "tp": 1}
    assert rep["fits"] is True
    assert set(rep["programs"]) - {"sequence_lengths", "pack", "unpack"} == {"prefill", "decode", "row_sums", "to_train", "reference", "update"}
    assert rep["state_bytes_per_device"]["reference_parameters"] == rep["state_bytes_per_device"]["parameters"]


# --------------------------------------------------------------------------- LoRA


def _tiny_dims():
    from grpo.models.presets import preset_config

    c = preset_config("tiny")
    return c, (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
               c.num_key_value_heads, c.head_dim)


def _projections():
    """(elements, input size along the quantization axis, in + out) of each projection of
    the tiny preset, from its HF dims (o_proj is [L, heads, head_dim, hidden]: its
    blocked axis is the heads)."""
    _, (L, D, F, H, Hk, E) = _tiny_dims()
    return {
        "q_proj": (L * D * H * E, D, D + H * E), "k_proj": (L * D * Hk * E, D, D + Hk * E),
        "v_proj": (L * D * Hk * E, D, D + Hk * E), "o_proj": (L * H * E * D, H, H * E + D),
        "gate_proj": (L * D * F, D, D + F), "up_proj": (L * D * F, D, D + F), "down_proj": (L * F * D, F, F + D),
    }


def test_lora_plan_state_is_the_adapters_f32_moments_and_the_bf16_base(tiny_config):
    # One chip: per-device bytes are the whole model's, so they follow from the shapes.
    r = 4
    code, rep = plan(tiny_config, "--topology", "v6e:1x1", "--json", "--set", "loss.beta=0.04",
                     "--set", f"model.lora={{rank: {r}, alpha: {2 * r}}}")
    assert code == 0, rep
    arch, (L, *_) = _tiny_dims()
    adapters = sum(L * r * io for _, _, io in _projections().values())  # A [L, in, r] + B [L, r, out]
    assert rep["trainable_params"] == adapters
    assert rep["frozen_params"] == arch.num_params()
    state = rep["state_bytes_per_device"]
    # AdamW's two f32 moments of the adapters (no master copy: the adapters are f32) and
    # two int32 step counters (the moments' and the schedule's).
    assert state["optimizer_state"] == 2 * 4 * adapters + 2 * 4
    assert state["parameters"] == 2 * arch.num_params() + 4 * adapters  # bf16 base, f32 adapters
    # The reference pass runs the policy's base with the adapters off: no second copy.
    assert state["reference_parameters"] == 0
    assert set(rep["programs"]) - {"sequence_lengths", "pack", "unpack"} == {"prefill", "decode", "row_sums", "to_train", "reference", "update"}
    assert rep["programs"]["reference"]["resident_bytes"] == state["optimizer_state"]
    assert rep["programs"]["update"]["resident_bytes"] == 0
    assert rep["lora"]["rank"] == r and rep["lora"]["alpha"] == 2 * r
    assert rep["lora"]["targets"] == list(_projections()) and rep["lora"]["base_quantization"] == "none"
    assert rep["lora"]["adapter_bytes"] + rep["lora"]["base_bytes"] == state["parameters"]
    assert rep["fits"] is True


def test_merged_lora_sampling_counts_a_copy_of_the_targeted_projections(tiny_config):
    """model.lora.sampler=merged: the rollout holds a merged copy of each targeted
    projection beside the base (no compile needed to count it)."""
    from grpo.core.config import load_config
    from grpo.engine.planning.memory import merged_projection_bytes
    from grpo.engine.planning.plan import Planner

    planner = Planner("v6e:1x1")
    sets = ["model.lora={rank: 4, alpha: 8, targets: [q_proj, down_proj], sampler: merged}"]
    programs, full, _ = planner.build(load_config(tiny_config, sets))
    assert programs.merged_sampling and not programs.sampler().lora_adapters
    proj = _projections()
    assert merged_projection_bytes(full) == 2 * (proj["q_proj"][0] + proj["down_proj"][0])  # bf16
    programs, full, _ = planner.build(load_config(tiny_config, [sets[0].replace("merged", "adapters")]))
    assert not programs.merged_sampling and programs.sampler().lora_adapters


def test_qlora_nf4_base_is_4_bit_codes_and_f32_block_scales(tiny_config):
    base = ["--topology", "v6e:1x1", "--json", "--set", "model.lora={rank: 4, alpha: 8}"]
    code, bf16 = plan(tiny_config, *base)
    assert code == 0, bf16
    code, nf4 = plan(tiny_config, *base, "--set", "model.lora.base_quantization=nf4")
    assert code == 0, nf4
    # Every projection (targeted or not) is quantized in blocks of 64 along its input
    # axis, or of gcd(64, size) where 64 does not divide it (o_proj's 4 heads: blocks of 4).
    proj = sum(n for n, _, _ in _projections().values())
    scales = sum(n // math.gcd(64, k) for n, k, _ in _projections().values())
    assert nf4["lora"]["quantization_scales"] == scales
    assert sorted(nf4["lora"]["quantized"]) == sorted(_projections())
    saved = proj * 2 - (proj // 2 + 4 * scales)  # bf16 -> uint4 codes + f32 scales
    p16, p4 = bf16["state_bytes_per_device"]["parameters"], nf4["state_bytes_per_device"]["parameters"]
    assert p16 - p4 == saved > 0
    assert nf4["trainable_params"] == bf16["trainable_params"] and nf4["frozen_params"] == bf16["frozen_params"]
    assert nf4["state_bytes_per_device"]["optimizer_state"] == bf16["state_bytes_per_device"]["optimizer_state"]
    assert nf4["fits"] is True


def test_the_tpu_compiler_stores_uint4_codes_packed_as_the_plan_counts_them():
    # The plan counts an nf4 base's uint4 codes at 4 bits; libtpu's own argument size for
    # a program taking them must agree (1 byte per code would double the base).
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from grpo.engine.planning.memory import bytes_per_device
    from grpo.engine.planning.tpu import parse_topology

    devices = parse_topology("v6e:2x2").devices()
    mesh = Mesh(np.array(devices).reshape(4), ("fsdp",))
    for dtype in (jnp.uint4, jnp.int8, jnp.bfloat16):
        codes = jax.ShapeDtypeStruct((4, 1024, 768), dtype, sharding=NamedSharding(mesh, P(None, "fsdp")))
        compiled = jax.jit(lambda w: w.astype(jnp.float32).sum(axis=1)).lower(codes).compile()
        assert compiled.memory_analysis().argument_size_in_bytes == bytes_per_device(codes)
    assert bytes_per_device(codes.update(dtype=jnp.uint4)) == 4 * 1024 * 768 // 2 // 4


def test_pallas_loss_compiles_with_mosaic_for_the_mesh_platform(tiny_config):
    # On this CPU host jax.default_backend() is cpu; the kernels must compile for the TPU
    # mesh (Mosaic, not interpret mode) at several block sizes.
    for bt, bv in ((16, 128),):
        code, rep = plan(tiny_config, "--topology", "v6e:2x2", "--json", "--set", "loss.impl=pallas",
                         "--set", f"loss.options={{block_t: {bt}, block_v: {bv}}}")
        assert code == 0, rep
        assert rep["fits"] is True and rep["compiler_error"] is None
        assert rep["programs"]["update"]["temp_bytes"] is not None


def test_a_config_too_large_for_the_chip_is_a_successful_plan_that_does_not_fit(tiny_config):
    # 2 layers with a 64M-wide MLP: ~26 G parameters, far beyond 4 x 31 GiB.
    code, rep = plan(tiny_config, "--topology", "v6e:2x2", "--json",
                     "--set", "model.random.overrides={intermediate_size: 67108864}")
    assert code == 0, rep
    assert rep["fits"] is False
    assert rep["margin_bytes"] is None or rep["margin_bytes"] < 0
    assert rep["compiler_error"] is None or "memory" in rep["compiler_error"].lower() or "hbm" in rep["compiler_error"].lower()
    if rep["compiler_error"] is None:
        assert rep["peak_bytes_per_device"] > rep["hbm_bytes_per_device"]


def test_search_returns_the_boundary(tiny_config):
    # Against a 12 MiB budget (--hbm-limit) the boundary lies inside the valid
    # micro-batches (multiples of the 4 devices dividing 96 sequences) at shapes that
    # compile in seconds; with the chip's 31 GiB it would take shapes that compile slowly.
    args = [tiny_config, "--topology", "v6e:2x2", "--json", "--search", "train.micro_batch_size",
            "--hbm-limit", str(12 / 1024), "--set", "model.remat=none", "--set", "rollout.max_new_tokens=256",
            "--set", "train.prompts_per_step=24", "--set", "train.micro_batch_size=8", "--set", "model.attention=xla",
            "--set", "train.packing.enabled=false"]  # padded rows: no packing glue to compile per candidate
    code, rep = plan(*args)
    assert code == 0, rep
    assert rep["hbm_bytes_per_device"] == 12 << 20
    s = rep["search"]
    assert s["field"] == "train.micro_batch_size"
    candidates = [m for m in range(4, 97, 4) if 96 % m == 0]
    tried = dict((v, ok) for v, ok in s["tried"])
    best = s["max_fitting"]
    assert best in candidates and tried[best] is True
    nxt = candidates[candidates.index(best) + 1]
    assert tried[nxt] is False  # the next valid value up was tried and does not fit
    assert all(ok == (v <= best) for v, ok in s["tried"])
    assert rep["shape"]["micro_batch_size"] == best and rep["fits"] is True


def test_unknown_topology_lists_the_valid_ones(tiny_config):
    code, out = plan(tiny_config, "--topology", "v7x-9")
    assert code == 2
    assert "Unknown TPU topology 'v7x-9'" in out and "v6e-8" in out and "v6e:2x4" in out
    assert "Traceback" not in out


def test_topology_the_mesh_policy_cannot_lay_out(tiny_config):
    code, out = plan(tiny_config, "--topology", "v6e:2x2", "--set", "mesh.policy=explicit",
                     "--set", "mesh.options={shape: '1,3,1'}")
    assert code == 2
    assert "v6e:2x2" in out and "mesh" in out and "Traceback" not in out


def test_without_libtpu_plan_exits_2_with_the_install_command(tiny_config, monkeypatch):
    import grpo.engine.planning.tpu as tpu

    monkeypatch.setattr(tpu, "libtpu_available", lambda: False)
    code, out = plan(tiny_config, "--topology", "v6e-8")
    assert code == 2
    assert "pip install libtpu" in out and "grpo-jax" not in out and "Traceback" not in out  # issue 52: no unpublished name
    assert len([ln for ln in out.strip().splitlines() if ln.strip()]) == 1  # one paragraph


def test_topology_names():
    from grpo.core.errors import UserError
    from grpo.engine.planning.tpu import parse_topology

    t = parse_topology("v6e-8")
    assert t.raw == "v6e:2x4" and t.chips == 8 and dict(t.kwargs)["chips_per_host_bounds"] == (2, 4, 1)
    assert parse_topology("v6e-16").raw == "v6e:4x4" and parse_topology("v6e-16").kwargs == ()
    assert parse_topology("v5p-8").raw == "v5p:2x2x1" and parse_topology("v5p-8").chips == 4
    assert parse_topology("v4-8").raw == "v4:2x2x1"
    assert parse_topology("v6e:2x4").chips == 8
    with pytest.raises(UserError, match="two dimensions"):
        parse_topology("v6e:2x2x2")


@pytest.mark.parametrize("name,processes,per_process", [("v6e-8", 1, 8), ("v6e-16", 4, 4), ("v5p-8", 1, 4)])
def test_topology_devices(name, processes, per_process):
    from grpo.engine.planning.tpu import parse_topology

    t = parse_topology(name)
    devices = t.devices()
    assert t.processes(devices) == (per_process,) * processes
    assert all(d.platform == "tpu" for d in devices)


def test_known_hub_ids_resolve_to_presets_without_downloads():
    from grpo.core.config import ModelConfig
    from grpo.core.errors import UserError
    from grpo.models.loading import model_architecture as architecture
    from grpo.models.presets import preset_config

    arch = architecture(ModelConfig(source="hf", path="Qwen/Qwen2.5-3B-Instruct"))
    assert arch == preset_config("qwen2.5-3b")
    with pytest.raises(UserError, match="model.source=random"):
        architecture(ModelConfig(source="hf", path="someone/unknown-model"))


# --------------------------------------------------------------------------- Mosaic


def _mosaic_compile(cfg, *, n=512, d=256, v=4096):
    """value+grad of the fused log-probs compiled by the TPU compiler for one v6e chip."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from grpo.engine.planning.tpu import parse_topology
    from grpo.plugins.losses import _pallas

    devices = parse_topology("v6e:1x1").devices()
    rep = NamedSharding(Mesh(np.array(devices).reshape(1, 1, 1), ("dp", "fsdp", "tp")), P())

    def step(h, w, t):
        def f(h, w):
            lp, _ = _pallas.fused_token_logprobs(hidden=h, head_weight=w, targets=t, temperature=0.9, config=cfg)
            return lp.sum()

        return jax.value_and_grad(f, argnums=(0, 1))(h, w)

    args = (jax.ShapeDtypeStruct((1, n, d), jnp.bfloat16, sharding=rep),
            jax.ShapeDtypeStruct((d, v), jnp.bfloat16, sharding=rep),
            jax.ShapeDtypeStruct((1, n), jnp.int32, sharding=rep))
    compiled = jax.jit(step).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()  # Mosaic kernels, not interpret-mode loops
    return compiled


@pytest.mark.parametrize("bt,bv", [(16, 128), (256, 512), (128, 1024)])
def test_pallas_kernels_compile_with_mosaic(bt, bv):
    import jax.numpy as jnp

    from grpo.plugins.losses import PallasLossOptions, _pallas

    cfg = _pallas.resolve_config(PallasLossOptions(block_t=bt, block_v=bv), dtype=jnp.bfloat16, hidden_size=256,
                                 backend="tpu")
    assert not cfg.interpret
    _mosaic_compile(cfg)


def test_block_sizes_mosaic_rejects_are_refused_before_compiling():
    import jax.numpy as jnp

    from grpo.core.errors import UserError
    from grpo.plugins.losses import PallasLossOptions, _pallas

    opts = PallasLossOptions(block_t=4096, block_v=8192)
    with pytest.raises(UserError, match="VMEM"):
        _pallas.resolve_config(opts, dtype=jnp.bfloat16, hidden_size=256, backend="tpu")
    with pytest.raises(UserError, match="multiple of 16"):
        _pallas.resolve_config(PallasLossOptions(block_t=24), dtype=jnp.bfloat16, hidden_size=256, backend="tpu")
    # Mosaic's own verdict on such a size (CompileTimeScopedVmemOom) takes minutes to
    # reach on 2 cores, so it is recorded in _pallas.VMEM_CAP's comment, not re-run here.


def test_libtpu_does_not_change_the_backend_grpo_run_picks():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "cpu"


def test_multi_turn_task_plans_the_turn_decode_and_the_append(tiny_config):
    """A task with tools rolls out conversations: ``decode`` is one turn's loop over the
    whole multi-turn cache and ``append`` writes the replies between turns."""
    code, rep = plan(tiny_config, "--topology", "v6e:2x2", "--json", "--set", 'task={"name": "lookup"}',
                     "--set", "rollout.max_turns=3")
    assert code == 0, rep
    assert set(rep["programs"]) - {"sequence_lengths", "pack", "unpack"} == {"prefill", "start", "decode", "append", "row_sums", "to_train", "update"}
    assert rep["fits"] is True and rep["compiler_error"] is None
    p = rep["programs"]["append"]
    assert p["argument_bytes"] > 0 and p["flops"] > 0 and p["roofline_s"] > 0
    # The cache holds the prompt and max_turns x max_new_tokens slots (+ one turn's spare):
    # 32 rows of 16 + 3 x 16 + 16 slots, 2 layers x 2 KV heads x 16 dims, k and v, bf16,
    # split over the 4 chips.
    assert rep["state_bytes_per_device"]["kv_cache"] == 2 * 2 * 32 * (16 + 48 + 16) * 2 * 16 * 2 // 4


def test_plan_under_a_length_profile_compiles_the_update_at_the_bins(tiny_config, tmp_path):
    """``--lengths``: the step's 32 sequences (16 prompt + 4 completion tokens of a 64 cap)
    packed four to an 80-token bin: the update compiled at those 8 bins needs less memory
    than at one row a sequence, and counts fewer FLOPs."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("4\n")
    args = (tiny_config, "--topology", "v6e:2x2", "--set", "rollout.max_new_tokens=64", "--set", "model.remat=none",
            "--set", "model.attention=xla", "--set", "train.micro_batch_size=32", "--lengths", str(lengths))
    code, rep = plan(*args, "--json")
    assert code == 0, rep
    pk = rep["packing"]
    assert pk["bin_length"] == 80 and pk["max_bins_per_device"] == 8  # 32 rows of 80 over 4 devices
    assert pk["bins"] == 8 and pk["efficiency"] == 1.0 and pk["bins_per_device"] == 2
    assert pk["micro_batch"]["sequences_per_device"] == 8 and pk["bin_shapes"] == 4  # per 1, 2, 4, 8: the accelerator's pow2 grid
    assert pk["profile"]["prompts"].startswith("every prompt at the config's prompt length, 16")
    up = pk["passes"]["update"]
    assert up["packed_flops"] < 0.5 * up["padded_flops"] and up["ratio"] < 1
    assert pk["update_program"] and pk["update_peak_bytes"] < rep["programs"]["update"]["peak_bytes"]
    assert pk["fits"] is True and pk["valid_tokens_per_s_packed"] > pk["valid_tokens_per_s_padded"]
    assert pk["valid_tokens_per_step"] == 32 * 4
    from grpo.engine.planning.report import format_report

    text = format_report(rep)
    assert "packed: at most 8 bins of 80 tokens" in text and "valid tokens/s: padded" in text
    # The static engine: the headline costs the rollout as its programs (every row to the cap).
    assert rep["step_rollout"] == {"engine": "static", "costed_as": "programs",
                                   "description": "the programs, every row to the cap"}
    assert "rollout costed as static engine: the programs, every row to the cap" in text
    assert pk["draws"][0]["micro_batches"] == 1 and pk["draws"][0]["per"] == 2


def test_engine_check_refuses_multi_turn_only_for_single_turn_engines():
    """Both built-in engines sample multi-turn tasks; an engine that does not declare
    ``multi_turn`` (the contract's default) refuses one, naming ``rollout.engine`` (the
    run exits 2 before anything compiles)."""
    from grpo.core.contracts import NoOptions, RolloutEnginePlugin
    from grpo.plugins.engines import ContinuousEngine, StaticEngine

    assert ContinuousEngine().check(multi_turn=True, options=NoOptions()) == []
    assert StaticEngine().check(multi_turn=True, options=NoOptions()) == []

    class SingleTurn(RolloutEnginePlugin):
        name = "single"

        def build(self, context, options):
            raise NotImplementedError

    [problem] = SingleTurn().check(multi_turn=True, options=NoOptions())
    assert "rollout.engine='single' samples single-turn tasks only" in problem
    assert SingleTurn().check(multi_turn=False, options=NoOptions()) == []
