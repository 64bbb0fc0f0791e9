"""The ``serving`` rollout style on 8 CPU devices: the policy resharded once per step into a
tensor-parallel layout samples exactly what ``legacy`` samples on the FSDP training
layout (same keys, f32), with 12 prompts that do not divide the 8 devices; the reshard
round trip is bit-exact; LoRA and QLoRA states follow the layout; tensor parallelism
stays inside a host; bad ``tensor_parallel`` values exit 2 naming the field; and a
trainer step in the serving layout scores its own samples with the trainer's forward."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from flax import nnx
from jax.sharding import PartitionSpec

from grpo.core.cli import cli
from grpo.core.contracts import MeshLayout, ModelDims, Topology
from grpo.core.errors import UserError
from grpo.engine.parallel.mesh import build_mesh
from grpo.engine.rollout.layout import RolloutPlacement, choose_layout, state_shardings
from grpo.engine.rollout.sampler import Sampler, SamplingParams
from grpo.models.loading import load_hf
from grpo.models.tiny import write_tiny_checkpoint
from grpo.plugins.rollout import SERVING_PARAM_RULES, ServingOptions, ServingStyle, serving_layout

P, LP, K, N = 12, 8, 2, 6
SAMPLING = SamplingParams(max_new_tokens=N, num_generations=K, temperature=0.7, top_k=0, eos_ids=(308,), pad_id=306)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # 8 attention heads (so tp=8 splits them), 2 KV heads (replicated on tp > 2).
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("serving_ckpt"), seed=1, tokenizer=False,
                                      num_attention_heads=8)
    mesh = build_mesh(MeshLayout(dp=1, fsdp=8, tp=1))
    model = load_hf(directory, mesh)
    graphdef, state = nnx.split(model)
    rs = np.random.default_rng(0)
    lengths = rs.integers(1, LP + 1, size=P)
    mask = (np.arange(LP)[None, :] >= LP - lengths[:, None]).astype(np.int32)
    tokens = np.where(mask == 1, rs.integers(0, 300, size=(P, LP)), 306).astype(np.int32)
    legacy = Sampler(graphdef, mesh=mesh, batch_axes=("dp", "fsdp", "tp"), sampling=SAMPLING)
    ref = legacy.generate(state, tokens, mask, jax.random.key(7))
    return graphdef, state, mesh, model.config, tokens, mask, ref


def _serving(graphdef, mesh, tp):
    placement = RolloutPlacement.of_layout(mesh, serving_layout(8, tp, kv_heads=2))
    sampler = Sampler(graphdef, mesh=placement.mesh, batch_axes=placement.batch_axes, sampling=SAMPLING,
                      activation_rules=placement.activation_rules, cache_rules=placement.cache_rules)
    return placement, sampler


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_serving_samples_what_legacy_samples(setup, tp):
    graphdef, state, mesh, _, tokens, mask, ref = setup
    placement, sampler = _serving(graphdef, mesh, tp)
    served = placement.reshard_jit(state)(state)
    # The copy is in the serving layout: query heads split tp ways, KV heads gcd(tp, 2)
    # ways, the embed dimension whole.
    q = served["layers"]["q_proj"].get_value()
    k = served["layers"]["k_proj"].get_value()
    assert q.sharding.shard_shape(q.shape)[2] == q.shape[2] // tp
    assert k.sharding.shard_shape(k.shape)[2] == k.shape[2] // min(tp, 2)
    assert q.sharding.shard_shape(q.shape)[1] == q.shape[1]
    out = sampler.generate(served, tokens, mask, jax.random.key(7))
    assert np.asarray(out.tokens).shape == (P * K, N)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5, rtol=0)
    assert np.asarray(ref.mask).sum() > P * K  # not all stopped at once: the loop ran
    # The round trip back to the training layout is bit-exact.
    back = jax.jit(lambda s: s, out_shardings=jax.tree.map(lambda x: x.sharding, state))(served)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_serving_decode_gathers_no_weights(setup):
    """The decode loop's collectives in the serving layout move activations only: nothing
    as large as a weight matrix, while legacy's gathers weights (the tiny vocab x hidden
    embedding is 320 x 64)."""
    import re

    graphdef, state, mesh, cfg, tokens, mask, _ = setup

    def collective_shapes(sampler, params):
        pre = sampler.prefill(params, tokens, mask)
        raw, impl = sampler.place_key(jax.random.key(0))
        text = sampler.decode_jit().lower(params, pre.cache, pre.logits, pre.prompt_tokens, pre.prompt_mask, raw,
                                          key_impl=impl).compile().as_text()
        return re.findall(r"= (\w+)\[([\d,]*)\][^ ]* (all-gather|all-reduce|reduce-scatter|all-to-all)", text)

    def elements(dims):
        return int(np.prod([int(d) for d in dims.split(",") if d]))

    legacy = Sampler(graphdef, mesh=mesh, batch_axes=("dp", "fsdp", "tp"), sampling=SAMPLING)
    legacy_ops = collective_shapes(legacy, state)
    # FSDP: a layer's [hidden, mlp] gate/up projection is gathered inside the decode loop.
    assert ("all-gather", f"{cfg.hidden_size},{cfg.intermediate_size}") in {(op, d) for _, d, op in legacy_ops}
    placement, sampler = _serving(graphdef, mesh, 2)
    ops = collective_shapes(sampler, placement.reshard_jit(state)(state))
    assert {op for _, _, op in ops} <= {"all-reduce", "all-gather"}
    # Activations only: nothing larger than [rows per shard, hidden] (24 x 64 here).
    per_shard = P * K // placement.layout.shards
    assert max(elements(d) for _, d, _ in ops) <= per_shard * cfg.hidden_size, ops


def test_lora_and_qlora_states_follow_the_layout(setup):
    from grpo.core.config import LoraConfig
    from grpo.models.lora import apply_lora

    graphdef, state, mesh, cfg, *_ = setup
    placement = RolloutPlacement.of_layout(mesh, serving_layout(8, 2, kv_heads=2))
    for quant in ("none", "int8"):
        model = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
        apply_lora(model, LoraConfig(rank=4, alpha=8, base_quantization=quant), abstract=True)
        _, full = nnx.split(model)
        shardings = state_shardings(full, placement.mesh, SERVING_PARAM_RULES)
        flat = dict(nnx.to_flat_state(shardings))
        for path, var in flat.items():
            sh = var.get_value()
            assert sh.mesh.shape == placement.mesh.shape
            assert "fsdp" not in str(sh.spec)  # no FSDP in the serving layout
        assert flat[("layers", "q_proj")].get_value().spec[2] == "tp"  # codes or weights: heads over tp
        assert flat[("lora", "q_proj_b")].get_value().spec == PartitionSpec(None, None, "tp", None)
        assert all(a is None for a in flat[("lora", "q_proj_a")].get_value().spec)


def test_serving_candidates_stay_inside_a_host():
    style = ServingStyle()
    dims = ModelDims(num_attention_heads=16, num_key_value_heads=2, head_dim=128, hidden_size=2048,
                     intermediate_size=11008, vocab_size=151936, num_hidden_layers=36)
    layout = MeshLayout(dp=1, fsdp=16, tp=1)
    four_hosts = Topology(process_count=4, local_device_count=4)
    auto = style.rollout_layouts(layout=layout, topology=four_hosts, options=ServingOptions(), model=dims)
    assert [c.tensor_parallel for c in auto] == [1, 2, 4]
    assert style.rollout_shards(layout=layout, topology=four_hosts, options=ServingOptions()) == 4
    problems = style.check(layout=layout, topology=four_hosts, options=ServingOptions(tensor_parallel=8))
    assert problems and "span hosts" in problems[0] and "rollout.options.tensor_parallel" in problems[0]


def test_serving_layout_keeps_the_expert_axis():
    """Issue 54: with mesh.expert_parallel the serving layout splits its batch over dp x ep
    and the experts over ep (each expert's width like the MLP's); tensor_parallel x ep must
    divide the devices (exit 2 naming both)."""
    style = ServingStyle()
    dims = ModelDims(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
                     intermediate_size=128, vocab_size=320, num_hidden_layers=2)
    layout = MeshLayout(dp=1, fsdp=2, tp=1, ep=4)
    one = Topology(process_count=1, local_device_count=8)
    auto = style.rollout_layouts(layout=layout, topology=one, options=ServingOptions(), model=dims)
    assert [c.tensor_parallel for c in auto] == [1, 2]
    assert [c.mesh.shape for c in auto] == [{"dp": 2, "fsdp": 1, "ep": 4, "tp": 1}, {"dp": 1, "fsdp": 1, "ep": 4, "tp": 2}]
    assert all(c.batch_axes == ("dp", "ep") and c.shards == 8 // c.tensor_parallel for c in auto)
    assert SERVING_PARAM_RULES["experts"] == "ep" and SERVING_PARAM_RULES["expert_mlp"] == SERVING_PARAM_RULES["mlp"]
    with pytest.raises(UserError, match=r"rollout.options.tensor_parallel=4 x mesh.expert_parallel=4 does not divide"):
        style.rollout_layouts(layout=layout, topology=one, options=ServingOptions(tensor_parallel=4), model=dims)


def test_auto_picks_by_the_roofline():
    """With chip figures auto weighs weights per chip (1/tp) against a KV cache replicated
    once tp exceeds the KV heads; without them (CPU) it takes the smallest valid tp."""
    from grpo.engine.planning.tpu import CHIPS

    dims = ModelDims(num_attention_heads=16, num_key_value_heads=2, head_dim=128, hidden_size=2048,
                     intermediate_size=11008, vocab_size=151936, num_hidden_layers=36)
    est = dict(cache_slots=1280, weight_bytes=6.2e9, compute_itemsize=2, resident_bytes=6e9)
    cands = [serving_layout(8, t, kv_heads=2) for t in (1, 2, 4, 8)]
    chosen, table = choose_layout(cands, dims, rows=128, chip=CHIPS["v6e"], **est)
    # Weights per chip shrink with tp; the cache, split only 2 ways (2 KV heads), grows
    # per chip past tp = 2 as each tp group takes more rows.
    assert chosen.tensor_parallel == 4
    assert table[1]["hbm_s"] > table[2]["hbm_s"] > table[4]["hbm_s"] < table[8]["hbm_s"]
    assert table[8]["ici_s"] > table[4]["ici_s"] > table[2]["ici_s"] > table[1]["ici_s"] == 0
    assert choose_layout(cands, dims, rows=128)[0].tensor_parallel == 1
    # Rows that only some layouts split: tp=8 leaves one shard, which takes any batch.
    assert choose_layout(cands[:2], dims, rows=4)[0].tensor_parallel == 2


def _write(tmp_path, overrides: dict) -> str:
    from pathlib import Path

    raw = yaml.safe_load(Path("configs/quickstart.yaml").read_text())
    raw["train"]["steps"] = 2
    raw["eval"] = {"every_n_steps": 0}
    raw["checkpoint"] = {"every_n_steps": 0}
    for key, value in overrides.items():
        sec, field = key.split(".", 1)
        if "." in field:
            field, sub = field.split(".")
            raw[sec].setdefault(field, {})[sub] = value
        else:
            raw[sec][field] = value
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("tp, args, needle", [
    (3, ["--processes", "1", "--local-devices", "8"], "does not divide the 8 devices"),
    (8, ["--processes", "2", "--local-devices", "4"], "span hosts"),
])
def test_bad_tensor_parallel_exits_2_naming_the_field(tmp_path, tp, args, needle):
    path = _write(tmp_path, {"rollout.style": "serving", "rollout.options.tensor_parallel": tp})
    result = CliRunner().invoke(cli, ["config", "validate", path, *args])
    assert result.exit_code == 2, result.output
    assert "rollout.options.tensor_parallel" in result.output and needle in result.output
    assert "Traceback" not in result.output


def test_tensor_parallel_must_divide_the_heads(tmp_path):
    # The tiny quickstart model has 4 heads; tp=8 divides the devices but not the heads.
    path = _write(tmp_path, {"rollout.style": "serving", "rollout.options.tensor_parallel": 8})
    result = CliRunner().invoke(cli, ["plan", path, "--topology", "v6e:2x4"])
    assert result.exit_code == 2, result.output
    assert "rollout.options.tensor_parallel=8" in result.output and "4 attention heads" in result.output


@pytest.mark.slow
def test_trainer_step_in_the_serving_layout(tmp_path):
    """12 prompts x 16 samples on 8 devices (12 does not divide 8) through a serving
    rollout at tp=2: the trainer's own forward pass gives the sampler's log-probs back."""
    from grpo.core.config import load_config
    from grpo.engine.trainer import Trainer

    path = _write(tmp_path, {"rollout.style": "serving", "rollout.options.tensor_parallel": 2,
                             "train.prompts_per_step": 12})
    trainer = Trainer(load_config(path), tmp_path / "run")
    assert trainer.programs.rollout.describe()["mesh"] == {"dp": 4, "fsdp": 1, "tp": 2}
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["completion/length_mean"] <= 2
        assert r["logprob_gap/sampler_trainer"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("tp", ["auto", 4])
def test_multi_host_plan_keeps_tensor_parallel_inside_a_host(tmp_path, tp):
    """On v6e:4x4 (4 hosts x 4 chips) every tensor-parallel group of the rollout mesh is
    one host's chips (the programs are built as `grpo plan` builds them, not compiled)."""
    pytest.importorskip("libtpu")
    from grpo.core.config import load_config
    from grpo.engine.planning.plan import Planner

    path = _write(tmp_path, {"rollout.style": "serving", "rollout.options.tensor_parallel": tp,
                             "train.prompts_per_step": 16})
    planner = Planner("v6e:4x4")
    programs, _, _ = planner.build(load_config(path))
    mesh = programs.rollout.mesh
    # Tensor parallelism spans (fsdp, tp) of the rollout mesh (the tiny model's 2 KV heads:
    # tp = gcd(T, 2)); each group of T consecutive devices is one host's.
    group = mesh.shape["fsdp"] * mesh.shape["tp"]
    assert group == programs.rollout.tensor_parallel in (1, 2, 4) and mesh.shape["dp"] * group == 16
    if tp == 4:
        assert (mesh.shape["fsdp"], mesh.shape["tp"]) == (2, 2)
    for devices in np.asarray(mesh.devices).reshape(-1, group):
        assert len({d.process_index for d in devices}) == 1
    assert all(int(t) <= 4 for t in (programs.rollout.estimates or {}))


@pytest.mark.parametrize("style", ["legacy", "serving"])
def test_twelve_prompts_times_eight_on_eight_devices_is_valid(tmp_path, style):
    """The replaced system's shape: 12 prompts do not split over 8 prefill shards, their
    96 samples do; prefill shards the prompts over what they divide."""
    path = _write(tmp_path, {"rollout.style": style, "rollout.num_generations": 8, "train.prompts_per_step": 12})
    result = CliRunner().invoke(cli, ["config", "validate", path, "--processes", "1", "--local-devices", "8"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, ["config", "validate", path, "--processes", "5", "--local-devices", "1"])
    assert result.exit_code == 2 and "train.prompts_per_step=12" in result.output, result.output


def test_merged_lora_is_merged_on_the_way_into_the_serving_layout(setup, tmp_path):
    """``model.lora.sampler: merged`` + serving: one program merges the adapters and
    reshards; the projections equal the training-layout merge, in the serving layout."""
    from grpo.core.config import load_config
    from grpo.engine.programs import build_programs
    from grpo.models.lora import apply_lora, merge_into_state, split_params

    graphdef, state, mesh, cfg, *_ = setup
    path = _write(tmp_path, {"rollout.style": "serving", "rollout.options.tensor_parallel": 2,
                             "model.lora": {"rank": 4, "alpha": 8, "sampler": "merged"}})
    config = load_config(path)
    model = apply_lora(nnx.merge(graphdef, jax.tree.map(jnp.copy, state)), config.model.lora)
    g2, full = nnx.split(model)
    params, frozen = split_params(full)
    params = jax.tree.map(lambda x: x + 0.01, params)  # B = 0 at init: make the merge matter
    programs = build_programs(config, mesh=mesh, layout=MeshLayout(dp=1, fsdp=8, tp=1), graphdef=g2,
                              eos_ids=(308,), pad_id=306, arch=cfg, state=full, frozen=frozen)
    engine = programs.sampler()
    engine.update_weights(params, 0)  # the adapters alone: the engine's preparation reads the base
    served = engine.weights
    expected = jax.jit(lambda p, f: merge_into_state(g2, p, f))(params, frozen)
    q = served["layers"]["q_proj"].get_value()
    assert q.sharding.mesh.shape["tp"] == 2 and q.sharding.spec[2] == "tp"
    np.testing.assert_allclose(np.asarray(q), np.asarray(expected["layers"]["q_proj"].get_value()), atol=1e-6)
    assert not np.allclose(np.asarray(q), np.asarray(state["layers"]["q_proj"].get_value()))


@pytest.mark.slow
def test_plan_counts_only_activations_per_serving_decode_step(tmp_path):
    """`grpo plan` on v6e:2x4, serving at tp=2 (dp=4 batch shards): per generated token the
    decode loop moves, into each chip, the all-reduces of the embedding lookup and of each
    layer's attention and MLP outputs ([rows per shard, hidden]) and three [rows] sampling
    reductions (the log-sum-exp's max and sum, the drawn token's logit): all-reduce
    ``2 (tp-1)/tp`` of the buffer; plus the argmax's (value, index) pairs, [tp, rows] f32
    and s32, all-gathered ``(tp-1)/tp``. No weight moves; the reshard moves them once."""
    pytest.importorskip("libtpu")
    from grpo.models.presets import preset_config

    path = _write(tmp_path, {"rollout.style": "serving", "rollout.options.tensor_parallel": 2,
                             "rollout.max_new_tokens": 8})
    result = CliRunner().invoke(cli, ["plan", path, "--topology", "v6e:2x4", "--json"])
    assert result.exit_code == 0, result.output
    rep = json.loads(result.output[result.output.index("{"):])
    assert rep["rollout_style"] == "serving" and rep["rollout_layout"]["mesh"] == {"dp": 4, "fsdp": 1, "tp": 2}
    cfg = preset_config("tiny")
    tp, rows = 2, rep["shape"]["sequences_per_step"] // 4
    f32 = 4
    per_step = rep["programs"]["decode"]["collective_bytes_per_step"]
    all_reduce = ((2 * cfg.num_hidden_layers + 1) * cfg.hidden_size + 3) * rows * f32 * 2 * (tp - 1) / tp
    assert per_step["all-reduce"] == all_reduce
    assert per_step["all-gather"] == 2 * tp * rows * f32 * (tp - 1) / tp
    assert per_step["reduce-scatter"] == per_step["all-to-all"] == per_step["collective-permute"] == 0
    # The reshard gathers the FSDP shards once per step (the tiny model is f32).
    weights = cfg.num_params() * f32
    assert 0 < rep["programs"]["reshard"]["collective_bytes"]["all-gather"] <= weights
    assert rep["state_bytes_per_device"]["rollout_parameters"] > rep["state_bytes_per_device"]["parameters"]
