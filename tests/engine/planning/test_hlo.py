"""`grpo plan` counts communication: the collectives of each compiled program's optimized
HLO (grpo.engine.planning.hlo), with the trip counts of the loops around them."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from grpo.core.cli import cli
from grpo.engine.planning import hlo

# --------------------------------------------------------------------------- the parser

# A decode-like program: 5 tokens (a fori_loop) x 3 layers (a scan), the trip counts only
# in the conditions (as libtpu 0.0.52 prints them); an async all-gather per layer (iota
# groups), a sync one per token (explicit groups) and one all-reduce outside the loops.
NESTED = """HloModule jit_f, is_scheduled=true, num_partitions=8

%layer_body (p.1: (s32[], bf16[4,256])) -> (s32[], bf16[4,256]) {
  %p.1 = (s32[]{:T(128)}, bf16[4,256]{1,0}) parameter(0)
  %gte.1 = s32[]{:T(128)} get-tuple-element(%p.1), index=0
  %copy.1 = s32[]{:T(128)S(6)} copy(%gte.1)
  %one.1 = s32[]{:T(128)} constant(1)
  %add.1 = s32[]{:T(128)} add(%copy.1, %one.1)
  %gte.2 = bf16[4,256]{1,0} get-tuple-element(%p.1), index=1
  %ag-start = (bf16[4,256]{1,0}, bf16[32,256]{1,0}) all-gather-start(%gte.2), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %ag-done = bf16[32,256]{1,0:T(8,128)(2,1)} all-gather-done(%ag-start)
  %slice.1 = bf16[4,256]{1,0} slice(%ag-done), slice={[0:4], [0:256]}
  ROOT %t.1 = (s32[]{:T(128)}, bf16[4,256]{1,0}) tuple(%add.1, %slice.1)
}

%layer_cond (p.2: (s32[], bf16[4,256])) -> pred[] {
  %p.2 = (s32[]{:T(128)}, bf16[4,256]{1,0}) parameter(0)
  %gte.3 = s32[]{:T(128)} get-tuple-element(%p.2), index=0
  %three = s32[]{:T(128)} constant(3)
  ROOT %lt.1 = pred[]{:T(512)} compare(%gte.3, %three), direction=LT
}

%token_body (p.3: (s32[], bf16[4,256])) -> (s32[], bf16[4,256]) {
  %p.3 = (s32[]{:T(128)}, bf16[4,256]{1,0}) parameter(0)
  %gte.4 = s32[]{:T(128)} get-tuple-element(%p.3), index=0
  %one.2 = s32[]{:T(128)} constant(1)
  %add.2 = s32[]{:T(128)} add(%gte.4, %one.2)
  %gte.5 = bf16[4,256]{1,0} get-tuple-element(%p.3), index=1
  %zero.1 = s32[]{:T(128)} constant(0)
  %copy.2 = s32[]{:T(128)} copy(%zero.1)
  %t.2 = (s32[]{:T(128)}, bf16[4,256]{1,0}) tuple(%copy.2, %gte.5)
  %while.inner = (s32[]{:T(128)}, bf16[4,256]{1,0}) while(%t.2), condition=%layer_cond, body=%layer_body
  %gte.6 = bf16[4,256]{1,0} get-tuple-element(%while.inner), index=1
  %all-gather.9 = bf16[2,4,256]{2,1,0} all-gather(%gte.6), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  %slice.2 = bf16[4,256]{1,0} slice(%all-gather.9), slice={[0:1], [0:4], [0:256]}
  ROOT %t.3 = (s32[]{:T(128)}, bf16[4,256]{1,0}) tuple(%add.2, %slice.2)
}

%token_cond (p.4: (s32[], bf16[4,256])) -> pred[] {
  %p.4 = (s32[]{:T(128)}, bf16[4,256]{1,0}) parameter(0)
  %gte.7 = s32[]{:T(128)} get-tuple-element(%p.4), index=0
  %eight = s32[]{:T(128)} constant(8)
  ROOT %lt.2 = pred[]{:T(512)} compare(%gte.7, %eight), direction=LT
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.3 = f32[] add(%a, %b)
}

ENTRY %main (x: bf16[4,256], y: f32[1024]) -> (bf16[4,256], f32[1024]) {
  %x = bf16[4,256]{1,0} parameter(0)
  %y = f32[1024]{0} parameter(1)
  %three.1 = s32[]{:T(128)} constant(3)
  %t.4 = (s32[]{:T(128)}, bf16[4,256]{1,0}) tuple(%three.1, %x)
  %while.outer = (s32[]{:T(128)}, bf16[4,256]{1,0}) while(%t.4), condition=%token_cond, body=%token_body
  %gte.8 = bf16[4,256]{1,0} get-tuple-element(%while.outer), index=1
  %all-reduce.1 = f32[1024]{0} all-reduce(%y), channel_id=3, replica_groups=mesh['a'=2,'b'=4] {'b'}, to_apply=%sum
  ROOT %t.5 = (bf16[4,256]{1,0}, f32[1024]{0}) tuple(%gte.8, %all-reduce.1)
}
"""


def test_nested_loops_multiply_and_async_pairs_count_once():
    ops = {op.name: op for op in hlo.collectives(NESTED)}
    assert set(ops) == {"ag-start", "all-gather.9", "all-reduce.1"}  # the -done is the same op
    layer, token, outside = ops["ag-start"], ops["all-gather.9"], ops["all-reduce.1"]
    # Outer loop from 3 to 8: 5 tokens; inner scan 3 layers.
    assert [(lp.name, lp.trips) for lp in layer.loops] == [("while.outer", 5), ("while.inner", 3)]
    assert layer.executions == 15 and token.executions == 5 and outside.executions == 1
    assert layer.group_size == 8 and layer.kind == "all-gather"
    assert layer.received_bytes == 7 / 8 * 32 * 256 * 2  # the gathered result (the -done's)
    assert token.group_size == 2 and token.received_bytes == 1 / 2 * 2 * 4 * 256 * 2
    assert outside.group_size == 4 and outside.received_bytes == 2 * 3 / 4 * 1024 * 4  # ring all-reduce
    assert outside.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    kinds = hlo.by_kind(list(ops.values()), in_loop=True)
    assert kinds["all-gather"] == 15 * layer.received_bytes + 5 * token.received_bytes
    assert kinds["all-reduce"] == 0


def test_known_trip_count_reduce_scatter_all_to_all_and_permute():
    text = """HloModule m, num_partitions=4

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]) parameter(0)
  %g = f32[64]{0} get-tuple-element(%p), index=1
  %rs = f32[16]{0} reduce-scatter(%g), replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%sum
  %a2a = f32[64]{0} all-to-all(%g), replica_groups={{0,1,2,3}}, dimensions={0}
  %cp-start = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%g), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp-done = f32[64]{0} collective-permute-done(%cp-start)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[64]) tuple(%i, %cp-done)
}

%cond (q: (s32[], f32[64])) -> pred[] {
  %q = (s32[], f32[64]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %e (x: f32[64]) -> (s32[], f32[64]) {
  %x = f32[64]{0} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[64]) tuple(%z, %x)
  ROOT %w = (s32[], f32[64]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
}
"""
    ops = {op.kind: op for op in hlo.collectives(text)}
    assert {op.executions for op in ops.values()} == {7}
    assert ops["reduce-scatter"].received_bytes == 3 / 4 * 64 * 4  # of the input
    assert ops["all-to-all"].received_bytes == 3 / 4 * 64 * 4
    assert ops["collective-permute"].received_bytes == 64 * 4  # the buffer, not the u32 contexts
    assert ops["collective-permute"].loops[0].source == "backend_config"


def test_a_collective_wrapped_in_async_start_and_done_counts_once():
    text = """HloModule m, num_partitions=4

%wrapped (x: f32[8]) -> f32[32] {
  %x = f32[8]{0} parameter(0)
  ROOT %ag = f32[32]{0} all-gather(%x), replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %e (p: f32[8]) -> f32[32] {
  %p = f32[8]{0} parameter(0)
  %s = ((f32[8]{0}), f32[32]{0}) async-start(%p), calls=%wrapped
  ROOT %d = f32[32]{0} async-done(%s), calls=%wrapped
}
"""
    (op,) = hlo.collectives(text)
    assert op.executions == 1 and op.computation == "wrapped" and op.received_bytes == 3 / 4 * 32 * 4


def test_replica_group_forms_and_shapes():
    assert hlo.replica_groups("replica_groups={{0,2},{1,3}}, dimensions={0}", 4) == (2, [[0, 2], [1, 3]])
    assert hlo.replica_groups("replica_groups=[2,4]<=[8], x", 8) == (4, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert hlo.replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == (2, [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert hlo.replica_groups("replica_groups={}, x", 8) == (8, [list(range(8))])
    assert hlo.replica_groups("replica_groups=mesh['a'=2,'b'=4] {'a'}, x", 8) == (
        2, [[0, 4], [1, 5], [2, 6], [3, 7]])
    n, groups = hlo.replica_groups("replica_groups=mesh['a'=8,'b'=4] {'a':(4)2,'b'}, x", 32)
    assert n == 8 and len(groups) == 4 and groups[0] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert hlo.shape_bytes("bf16[8,128]{1,0:T(8,128)(2,1)}") == 2048
    assert hlo.shape_bytes("(f32[], s32[4]{0}, /*index=2*/pred[3])") == 4 + 16 + 3
    assert hlo.shape_bytes("u4[3,5]") == 8  # packed: 60 bits
    reduce = next(op for op in hlo.collectives(NESTED) if op.kind == "all-reduce")  # groups {0..3}, {4..7}
    assert not hlo.crosses(reduce, [0, 0, 0, 0, 1, 1, 1, 1])
    assert hlo.crosses(reduce, [0, 1] * 4)


# --------------------------------------------------------------------------- a plan

TINY = {
    "model": {"source": "random", "random": {"preset": "tiny"}, "param_dtype": "bfloat16",
              "compute_dtype": "bfloat16", "remat": "full"},
    "task": {"name": "arithmetic"},
    "rollout": {"style": "legacy", "num_generations": 4, "max_prompt_length": 16, "max_new_tokens": 16},
    "train": {"prompts_per_step": 8, "micro_batch_size": 8},
    "loss": {"impl": "jax"},
}


@pytest.mark.slow
def test_fsdp_decode_gathers_every_weight_per_token(tmp_path):
    """The legacy rollout on v6e:2x4 (fsdp=8) all-gathers, per generated token, every
    FSDP-sharded weight: each projection of each layer and the (tied) embedding, 7/8 of
    each received by every chip. Counted here from the model's shapes alone."""
    from grpo.models.presets import preset_config

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    dump = tmp_path / "hlo"
    res = CliRunner().invoke(cli, ["plan", str(path), "--topology", "v6e:2x4", "--json", "--dump-hlo", str(dump)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["mesh"] == {"dp": 1, "fsdp": 8, "tp": 1}

    c = preset_config("tiny")
    D, F, H, Hk, E, V, L = (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                            c.head_dim, c.vocab_size, c.num_hidden_layers)
    per_layer = D * H * E + 2 * D * Hk * E + H * E * D + 3 * D * F  # q, k, v, o, gate, up, down
    weights = L * per_layer + V * D * (1 if c.tie_word_embeddings else 2)
    n = 8
    hand = (n - 1) / n * weights * 2  # bf16
    dec = rep["programs"]["decode"]
    assert dec["collective_bytes_per_step"]["all-gather"] == pytest.approx(hand)
    # Sampling adds a few bytes per token (the early-stop check, row bookkeeping).
    assert hand <= sum(dec["collective_bytes_per_step"].values()) < 1.1 * hand
    ici = 800e9 / 2  # v6e: half its bidirectional ICI figure
    assert dec["ici_s_per_step"] == pytest.approx(sum(dec["collective_bytes_per_step"].values()) / ici, rel=0.05)
    assert rep["chip"]["ici_bandwidth_bytes_per_s"] == 800e9
    for name, p in rep["programs"].items():
        assert p["hlo_source"] in ("xla_dump", "as_text"), name
        assert p["ici_s"] == pytest.approx(p["ici_bytes"] / ici)
        assert p["dcn_bytes"] == 0  # one slice: ICI even between hosts
        assert p["roofline_s"] >= p["roofline_no_comm_s"] > 0
        # The packed passes loop over the step's micro-batch count, a traced value (one
        # compile for every count): that one loop's trip count is unknown to the HLO, and
        # the plan multiplies its collectives by the schedule's count instead.
        if name in ("update", "reference", "policy_logprobs"):
            assert len(p["unknown_trip_counts"]) <= 1, (name, p["unknown_trip_counts"])
        else:
            assert p["unknown_trip_counts"] == [], name
        text = (dump / f"{name}.hlo.txt").read_text()
        assert text.startswith("HloModule") and "ENTRY" in text
    # The update's gradients are reduced across the 8 chips.
    upd = rep["programs"]["update"]["collective_bytes"]
    assert upd["all-reduce"] + upd["reduce-scatter"] > 0
    assert rep["roofline_step_s"] >= rep["roofline_step_no_comm_s"]
