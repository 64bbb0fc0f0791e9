"""Router replay in the update (issue 54, item 3): the rollout's routed experts travel
with their tokens through packing and into the forward's layout; the routing metrics."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from grpo.core.config import MoeConfig
from grpo.engine.training.packing import pack_batch, plan_packing
from grpo.engine.training.routing import moe_call, router_losses, routing_metrics
from grpo.engine.training.update import UpdateBatch
from grpo.models.layers.moe import LayerRouting

LY, K = 3, 2  # layers, experts per token


def _rows():
    """3 rows: left-padded prompts [3, 4], completions [3, 5] with lengths 5, 2, 3; each
    completion token's ids encode (row, column, layer, slot) and are -1 off the mask."""
    prompt_mask = np.array([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]], np.int32)
    prompt = np.where(prompt_mask, np.arange(12).reshape(3, 4) + 10, 0).astype(np.int32)
    lengths = np.array([5, 2, 3])
    mask = (np.arange(5)[None] < lengths[:, None]).astype(np.int32)
    tokens = np.where(mask, np.arange(15).reshape(3, 5) + 50, 0).astype(np.int32)
    r, c, ly, k = np.meshgrid(np.arange(3), np.arange(5), np.arange(LY), np.arange(K), indexing="ij")
    routed = np.where(mask[..., None, None] > 0, 1000 * r + 100 * c + 10 * ly + k, -1).astype(np.int16)
    return prompt, prompt_mask, tokens, mask, routed


def test_replay_ids_travel_with_their_tokens_through_packing():
    prompt, prompt_mask, tokens, mask, routed = _rows()
    lengths = prompt_mask.sum(1) + mask.sum(1)  # 9, 4, 6
    plan = plan_packing(lengths, bin_length=10)
    packed, _ = pack_batch(prompt_tokens=jnp.asarray(prompt), prompt_mask=jnp.asarray(prompt_mask),
                           tokens=jnp.asarray(tokens), mask=jnp.asarray(mask), row=jnp.asarray(plan.row),
                           index=jnp.asarray(plan.index), segment_ids=jnp.asarray(plan.segment_ids),
                           routed_experts=jnp.asarray(routed))
    got = np.asarray(packed.routed_experts)
    assert got.shape == plan.row.shape + (LY, K) and got.dtype == np.int16
    toks = np.asarray(packed.tokens)
    seen = 0
    for b, t in np.ndindex(*plan.row.shape):
        if plan.segment_ids[b, t] == 0 or toks[b, t] < 50:  # padding or a prompt token: none
            assert (got[b, t] == -1).all()
            continue
        row, col = divmod(int(toks[b, t]) - 50, 5)  # the completion token in this slot
        np.testing.assert_array_equal(got[b, t], routed[row, col])
        seen += 1
    assert seen == mask.sum()


def test_rows_layout_puts_the_ids_at_their_tokens_and_counts_the_predicting_slots():
    prompt, prompt_mask, tokens, mask, routed = _rows()
    ub = UpdateBatch(prompt_tokens=jnp.asarray(prompt), prompt_mask=jnp.asarray(prompt_mask), tokens=jnp.asarray(tokens),
                     mask=jnp.asarray(mask), advantages=None, old_logprobs=None, ref_logprobs=None,
                     routed_experts=jnp.asarray(routed))
    call = moe_call(ub, packed=False, options=MoeConfig(router_replay="rollout"))
    assert call.use_replay and call.replay.shape == (LY, 3, 9, K)
    replay = np.asarray(call.replay)
    assert (replay[:, :, :4] == -1).all()  # prompt tokens route themselves
    np.testing.assert_array_equal(np.moveaxis(replay[:, :, 4:], 0, 2), routed)
    # slot 3 (the last prompt token) predicts completion token 0, ..., the last slot nothing
    np.testing.assert_array_equal(np.asarray(call.mask)[:, 3:8], mask > 0)
    assert not np.asarray(call.mask)[:, 8].any() and not np.asarray(call.mask)[:, :3].any()
    assert not moe_call(ub, packed=False, options=MoeConfig(router_replay="compare")).use_replay
    assert moe_call(ub, packed=False, options=MoeConfig(), replay=False).replay is None


def test_routing_metrics_and_router_losses():
    # two layers, 4 experts, top-2; 10 counted tokens each
    routing = LayerRouting(
        experts=None, load=jnp.array([[5.0, 5.0, 5.0, 5.0], [14.0, 2.0, 2.0, 2.0]]),
        prob_sum=jnp.array([[2.5, 2.5, 2.5, 2.5], [7.0, 1.0, 1.0, 1.0]]), z_sum=jnp.array([20.0, 40.0]),
        agree=jnp.array([9.0, 6.0]), compared=jnp.array([10.0, 10.0]), tokens=jnp.array([10.0, 10.0]))
    m = routing_metrics(routing, top_k=2, compared=True)
    assert float(m["moe/routing_agreement"]) == 0.75
    assert abs(float(m["moe/expert_load/max"]) - 14.0 / 5.0) < 1e-6
    assert abs(float(m["moe/expert_load/mean"]) - (1.0 + 2.8) / 2) < 1e-6
    # 4 * sum f P: uniform layer 1.0; layer 2: 4 * (0.7*0.7 + 3 * 0.1*0.1) = 2.08
    assert abs(float(m["moe/load_balancing_loss"]) - (1.0 + 2.08) / 2) < 1e-6
    assert abs(float(m["moe/router_z_loss"]) - 3.0) < 1e-6
    assert "moe/routing_agreement" not in routing_metrics(routing, top_k=2, compared=False)
    assert float(router_losses(m, MoeConfig())) == 0.0
    both = MoeConfig(load_balancing_loss=0.01, router_z_loss=0.001)
    assert abs(float(router_losses(m, both)) - (0.01 * 1.54 + 0.001 * 3.0)) < 1e-7
