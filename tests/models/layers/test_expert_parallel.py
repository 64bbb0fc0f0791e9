"""Expert parallelism (issue 54, the expert mesh axis): the MoE block with its experts split
over an ``ep`` mesh axis (all-to-all dispatch and combine) equals the dense per-expert
reference on one device, values and gradients, with the tokens split over fsdp and ep, a
token count that does not divide the shards, and the experts' hidden width over tp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from grpo.models.layers.context import LayerContext
from grpo.models.layers.moe import moe_block
from grpo.sharding import ACTIVATION_RULES
from tests.models.layers.test_moe import CFG, _h, _params, _reference

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


def _mesh(dp: int, fsdp: int, ep: int, tp: int) -> Mesh:
    devices = np.array(jax.devices()[: dp * fsdp * ep * tp], dtype=object)
    return Mesh(devices.reshape(dp, fsdp, ep, tp), ("dp", "fsdp", "ep", "tp"))


def _ctx(mesh: Mesh) -> LayerContext:
    return LayerContext(config=CFG, dtype=jnp.float32, mesh=mesh, rules=tuple(ACTIVATION_RULES.items()),
                        quantization="none", lora=None, dropout_keys=None, positions=None, cos=None, sin=None,
                        kernel=None, dense_impl="xla", mask=None, segment_ids=None, write_index=None)


def test_expert_parallel_block_equals_the_single_device_reference_with_gradients():
    """On (dp 1, fsdp 2, ep 2, tp 2): 2 x 5 = 10 tokens over 4 token shards (padded), 8
    experts over ep, each expert's hidden width over tp (the outputs summed over it). The
    whole model over ep 4 is the slow test below."""
    mesh, p, h = _mesh(1, 2, 2, 2), _params(), _h()
    ours = jax.jit(lambda h, p: moe_block(_ctx(mesh), h, p, jnp.int32(0))[0])
    np.testing.assert_allclose(np.asarray(ours(h, p)), np.asarray(_reference(h, p)), atol=1e-5)
    cot = jnp.asarray(np.random.default_rng(2).standard_normal(h.shape), jnp.float32)
    g1 = jax.jit(jax.grad(lambda h, p: jnp.sum(ours(h, p) * cot), argnums=(0, 1)))(h, p)
    g2 = jax.jit(jax.grad(lambda h, p: jnp.sum(_reference(h, p) * cot), argnums=(0, 1)))(h, p)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    hlo = jax.jit(lambda h, p: moe_block(_ctx(mesh), h, p, jnp.int32(0))[0]).lower(h, p).as_text()
    assert "all_to_all" in hlo or "all-to-all" in hlo


@pytest.mark.slow
def test_tiny_moe_over_ep4_equals_one_device_in_log_probs_and_update_gradients():
    """The whole tiny MoE on a (dp 1, fsdp 2, ep 4, tp 1) mesh, experts split over ep and
    every other parameter over fsdp x ep: one update step's loss, per-token log-probs and
    gradients (the jax GRPO loss, token_mean, 8 rows) equal the one-device model's within
    1e-5 in f32."""
    from flax import nnx

    from grpo.core.contracts import MeshLayout
    from grpo.engine.parallel.mesh import build_mesh
    from grpo.models.loading import random_init
    from tests.engine.training.test_update import _batch, _step

    ep_mesh = build_mesh(MeshLayout(dp=1, fsdp=2, tp=1, ep=4))
    assert dict(ep_mesh.shape) == {"dp": 1, "fsdp": 2, "ep": 4, "tp": 1}
    one = random_init("tiny-moe", build_mesh(MeshLayout(dp=1, fsdp=1, tp=1), jax.devices()[:1]))
    split = random_init("tiny-moe", ep_mesh)
    assert split.layers.expert_gate[...].sharding.spec[1] == "ep"
    assert tuple(split.embed[...].sharding.spec) == (None, ("fsdp", "ep"))
    graphdef, p1 = nnx.split(one)
    graphdef2, p2 = nnx.split(split)  # the graphdef holds the model's mesh
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = _batch(one.config.vocab_size)
    want = jax.jit(_step(graphdef, 1, "token_mean").grads)(p1, batch)
    step = _step(graphdef2, 1, "token_mean")
    got = jax.jit(type(step)(**{**step.__dict__, "mesh": ep_mesh}).grads)(p2, batch)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want[3]), atol=1e-5)  # log-probs
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(got[1])) > 1e-3
