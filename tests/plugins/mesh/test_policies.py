"""Mesh policies: pure resolution for many topologies, and the real Mesh on 8 CPU devices."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from grpo.core.cli import cli
from grpo.core.contracts import MeshLayout, Topology
from grpo.core.errors import UserError
from grpo.plugins.mesh import AutoMesh, ExplicitMesh, HostLocalMesh, parse_shape

TOPOLOGIES = {"1x8": (1, 8), "2x4": (2, 4), "4x4": (4, 4), "1x1": (1, 1)}


def _resolve(policy, procs, local, **options):
    return policy.resolve(Topology(process_count=procs, local_device_count=local), policy.parse_options(options))


@pytest.mark.parametrize(
    "topo, auto, host_local",
    [
        ("1x8", (1, 8, 1), (1, 8, 1)),
        ("2x4", (1, 8, 1), (2, 4, 1)),
        ("4x4", (1, 16, 1), (4, 4, 1)),
        ("1x1", (1, 1, 1), (1, 1, 1)),
    ],
)
def test_auto_and_host_local(topo, auto, host_local):
    procs, local = TOPOLOGIES[topo]
    a = _resolve(AutoMesh(), procs, local)
    h = _resolve(HostLocalMesh(), procs, local)
    assert (a.dp, a.fsdp, a.tp) == auto
    assert (h.dp, h.fsdp, h.tp) == host_local
    assert a.axis_names == ("dp", "fsdp", "tp")
    # FSDP across hosts is worth a warning (with the seeds' measurement); inside a host it is not.
    assert bool(a.warnings) == (procs > 1)
    assert not h.warnings
    if procs > 1:
        assert "10.0 s/step" in a.warnings[0] and "18.6 s/step" in a.warnings[0]


def test_auto_with_tp():
    layout = _resolve(AutoMesh(), 1, 8, tp=2)
    assert layout.shape == {"dp": 1, "fsdp": 4, "tp": 2}
    with pytest.raises(UserError, match="tp=3 does not divide the 8 devices"):
        _resolve(AutoMesh(), 1, 8, tp=3)


def test_host_local_refuses_unequal_hosts():
    topo = Topology(process_count=2, local_device_count=4, devices_per_process=(4, 2))
    with pytest.raises(UserError, match=r"same number of devices on every host; got \[4, 2\]"):
        HostLocalMesh().resolve(topo, HostLocalMesh().parse_options({}))


@pytest.mark.parametrize(
    "shape, topo, expected",
    [
        ("1,-1,1", "1x8", (1, 8, 1)),
        ("2,-1,1", "2x4", (2, 4, 1)),
        ("dp:2,fsdp:-1,tp:1", "4x4", (2, 8, 1)),
        ("fsdp:-1", "1x8", (1, 8, 1)),
        ("1,4,2", "1x8", (1, 4, 2)),
        ("-1,1,1", "1x1", (1, 1, 1)),
        (" 4 , 4 , 1 ", "4x4", (4, 4, 1)),
    ],
)
def test_explicit_shapes(shape, topo, expected):
    layout = _resolve(ExplicitMesh(), *TOPOLOGIES[topo], shape=shape)
    assert (layout.dp, layout.fsdp, layout.tp) == expected


@pytest.mark.parametrize(
    "shape, message",
    [
        ("1,-1,-1", "more than one -1"),
        ("1,2", "has 2 sizes"),
        ("1,0,8", "positive integers or -1"),
        ("a,b,c", "'a' is not an integer"),
        ("dp:2,pp:4", "names axis 'pp'"),
        ("dp:2,dp:4", "names axis 'dp' twice"),
        ("dp:2,4,1", "mixes named and positional"),
        ("", "is not three sizes"),
    ],
)
def test_bad_shape_strings(shape, message):
    with pytest.raises(ValueError, match=message):
        parse_shape(shape)


@pytest.mark.parametrize(
    "shape, topo, message",
    [
        ("1,4,1", "1x8", "has 4 devices in all, but there are 8"),
        ("3,-1,1", "2x4", "multiply to 3, which does not divide the 8 devices"),
        ("2,8,1", "1x8", "has 16 devices in all"),
    ],
)
def test_explicit_shape_vs_topology(shape, topo, message):
    with pytest.raises(UserError, match=message):
        _resolve(ExplicitMesh(), *TOPOLOGIES[topo], shape=shape)


def _preview(*args):
    return CliRunner().invoke(cli, ["mesh", "preview", *args])


def test_preview_v6e16_pod():
    # A v6e-16 pod: 4 hosts x 4 chips.
    auto = _preview("--policy", "auto", "--processes", "4", "--local-devices", "4", "--json")
    host = _preview("--policy", "host_local", "--processes", "4", "--local-devices", "4", "--json")
    assert auto.exit_code == 0 and host.exit_code == 0
    a, h = json.loads(auto.output), json.loads(host.output)
    assert a["axis_names"] == ["dp", "fsdp", "tp"]
    assert a["shape"] == {"dp": 1, "fsdp": 16, "tp": 1} and len(a["warnings"]) == 1
    assert h["shape"] == {"dp": 4, "fsdp": 4, "tp": 1} and h["warnings"] == []
    text = _preview("--policy", "explicit", "--shape", "dp:4,fsdp:-1", "--processes", "4", "--local-devices", "4")
    assert text.exit_code == 0 and "dp=4, fsdp=4, tp=1" in text.output


def test_preview_errors_exit_2():
    bad = _preview("--policy", "explicit", "--shape", "1,-1,-1", "--processes", "1", "--local-devices", "8")
    assert bad.exit_code == 2 and "options.shape" in bad.output and "Traceback" not in bad.output
    unknown = _preview("--policy", "nope", "--processes", "1", "--local-devices", "8")
    assert unknown.exit_code == 2 and "auto, explicit, host_local" in unknown.output
    half = _preview("--policy", "auto", "--processes", "2")
    assert half.exit_code == 2 and "go together" in half.output


def test_preview_current_devices():
    result = _preview("--policy", "auto", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["shape"] == {"dp": 1, "fsdp": 8, "tp": 1}


def test_build_mesh_on_8_cpu_devices():
    import jax

    from grpo.engine.parallel.mesh import build_mesh, current_topology

    topo = current_topology()
    assert topo.device_count == 8 and topo.process_count == 1
    mesh = build_mesh(_resolve(ExplicitMesh(), 1, 8, shape="2,2,2"))
    assert mesh.axis_names == ("dp", "fsdp", "tp")
    assert dict(mesh.shape) == {"dp": 2, "fsdp": 2, "tp": 2}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_logical_rules():
    from jax.sharding import PartitionSpec as P

    from grpo.sharding import (
        ACTIVATION_RULES,
        PARAM_RULES,
        logical_to_spec,
        with_batch_axes,
    )

    # The expert axis ep is one more FSDP/batch axis; a mesh without it drops it (below).
    assert logical_to_spec(("embed", "mlp"), PARAM_RULES) == P(("fsdp", "ep"), "tp")
    assert logical_to_spec(("vocab", "embed"), PARAM_RULES) == P("tp", ("fsdp", "ep"))
    assert logical_to_spec(("embed", "embed"), PARAM_RULES) == P(("fsdp", "ep"), None)
    assert logical_to_spec(("experts", "embed", "expert_mlp"), PARAM_RULES) == P("ep", "fsdp", "tp")
    assert logical_to_spec(("batch", "length", "embed"), ACTIVATION_RULES) == P(("dp", "fsdp", "ep"), None, None)
    assert logical_to_spec(("batch", "length"), with_batch_axes(ACTIVATION_RULES, ("dp",))) == P("dp", None)


def test_without_an_expert_axis_the_specs_are_the_dp_fsdp_tp_ones():
    """Issue 54: ``mesh.expert_parallel: 1`` (the default) builds the (dp, fsdp, tp) mesh and
    every spec is what it was before the expert axis: ep dropped; with ep, the experts over it."""
    import jax
    from jax.sharding import PartitionSpec as P

    from grpo.engine.parallel.mesh import build_mesh
    from grpo.sharding import ACTIVATION_RULES, PARAM_RULES, data_axes, fit_spec

    plain = build_mesh(MeshLayout(dp=2, fsdp=2, tp=2), jax.devices()[:8])
    assert plain.axis_names == ("dp", "fsdp", "tp") and data_axes(plain) == ("dp", "fsdp")
    assert fit_spec((64, 32), ("embed", "mlp"), plain, PARAM_RULES) == P("fsdp", "tp")
    assert fit_spec((8, 4, 16), ("batch", "length", "embed"), plain, ACTIVATION_RULES) == P(("dp", "fsdp"), None, None)
    experts = build_mesh(MeshLayout(dp=1, fsdp=2, tp=1, ep=4), jax.devices()[:8])
    assert experts.axis_names == ("dp", "fsdp", "ep", "tp") and data_axes(experts) == ("dp", "fsdp", "ep")
    assert fit_spec((2, 8, 64, 32), ("layers", "experts", "embed", "expert_mlp"), experts, PARAM_RULES) == P(
        None, "ep", "fsdp", None)
    assert fit_spec((64, 32), ("embed", "mlp"), experts, PARAM_RULES) == P(("fsdp", "ep"), None)


def test_mesh_preview_carves_the_expert_axis_out_of_fsdp():
    """Issue 54: `grpo mesh preview --expert-parallel 4` on 8 devices gives (dp 1, fsdp 2,
    ep 4, tp 1); on 6 it is refused naming mesh.expert_parallel (exit 2)."""
    args = ["mesh", "preview", "--policy", "auto", "--processes", "1", "--json"]
    result = CliRunner().invoke(cli, [*args, "--local-devices", "8", "--expert-parallel", "4"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["shape"] == {"dp": 1, "fsdp": 2, "ep": 4, "tp": 1} and out["axis_names"] == ["dp", "fsdp", "ep", "tp"]
    result = CliRunner().invoke(cli, [*args, "--local-devices", "6", "--expert-parallel", "4"])
    assert result.exit_code == 2 and "mesh.expert_parallel=4 does not divide the fsdp axis" in result.output
