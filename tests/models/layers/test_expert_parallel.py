"""Expert parallelism (issue 54, the expert mesh axis): the MoE block with its experts split
over an ``ep`` mesh axis (all-to-all dispatch and combine) equals the dense per-expert
reference on one device, values and gradients, with the tokens split over dp and ep, a
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


@pytest.mark.parametrize("shape", [(2, 1, 4, 1), (1, 2, 2, 2)], ids=["dp2-ep4", "fsdp2-ep2-tp2"])
def test_expert_parallel_block_equals_the_single_device_reference_with_gradients(shape):
    """2 x 5 = 10 tokens over 8 or 4 token shards (padded), 8 experts over ep; the second
    splits each expert's hidden width over tp (the outputs summed over it)."""
    mesh, p, h = _mesh(*shape), _params(), _h()
    ours = jax.jit(lambda h, p: moe_block(_ctx(mesh), h, p, jnp.int32(0))[0])
    np.testing.assert_allclose(np.asarray(ours(h, p)), np.asarray(_reference(h, p)), atol=1e-5)
    cot = jnp.asarray(np.random.default_rng(2).standard_normal(h.shape), jnp.float32)
    g1 = jax.jit(jax.grad(lambda h, p: jnp.sum(ours(h, p) * cot), argnums=(0, 1)))(h, p)
    g2 = jax.jit(jax.grad(lambda h, p: jnp.sum(_reference(h, p) * cot), argnums=(0, 1)))(h, p)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    hlo = jax.jit(lambda h, p: moe_block(_ctx(mesh), h, p, jnp.int32(0))[0]).lower(h, p).as_text()
    assert "all_to_all" in hlo or "all-to-all" in hlo
