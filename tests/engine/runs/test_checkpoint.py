"""Checkpoints: a sharded round trip, keeping the last ``keep`` steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def test_checkpoint_roundtrip_with_sharding(tmp_path):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from grpo.core.contracts import MeshLayout
    from grpo.engine.parallel.mesh import build_mesh
    from grpo.engine.runs.checkpoint import Checkpointer

    mesh = build_mesh(MeshLayout(dp=1, fsdp=8, tp=1))
    sh = NamedSharding(mesh, P("fsdp"))
    state = {"w": jax.device_put(jnp.arange(16.0), sh), "step": jnp.asarray(3, jnp.int32)}
    ck = Checkpointer(tmp_path / "ck", keep=2)
    for step in (1, 2, 3):
        ck.save(step, {"state": state, "other": {"x": jnp.ones(2)}}, {"step": step, "note": "x"})
    assert ck.all_steps() == [2, 3]  # keep=2
    zeros = {"w": jax.device_put(jnp.zeros(16), sh), "step": jnp.asarray(0, jnp.int32)}
    items, meta = ck.restore({"state": zeros})  # only the items asked for
    restored = items["state"]
    assert meta == {"step": 3, "note": "x"} and set(items) == {"state"}
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(16.0))
    assert restored["w"].sharding == sh and int(restored["step"]) == 3
    ck.close()
