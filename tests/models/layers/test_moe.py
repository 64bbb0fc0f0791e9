"""The mixture-of-experts block (issue 54, items 2 and 3): the dropless grouped-matmul
experts against a dense per-expert reference (values and gradients), router replay
(R3: the replayed experts are used, the router still gets its gradient), and the routing
statistics (agreement, load, losses)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo.models.layers.context import LayerContext
from grpo.models.layers.moe import MoeCall, load_balancing_loss, moe_block, router_z_loss
from grpo.models.presets import preset_config

CFG = preset_config("tiny-moe", {"hidden_size": 16, "moe_intermediate_size": 8})  # 8 experts, top-2
B, T, D, X, M, K = 2, 5, 16, 8, 8, 2


def _ctx(moe=None, config=CFG) -> LayerContext:
    return LayerContext(config=config, dtype=jnp.float32, mesh=None, rules=(), quantization="none", lora=None,
                        dropout_keys=None, positions=None, cos=None, sin=None, kernel=None, dense_impl="xla",
                        mask=None, segment_ids=None, write_index=None, moe=moe)


def _params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "mlp_norm": jnp.asarray(1 + 0.1 * rng.standard_normal(D), jnp.float32),
        "router": jnp.asarray(rng.standard_normal((D, X)), jnp.float32),
        "expert_gate": jnp.asarray(rng.standard_normal((X, D, M)) / 4, jnp.float32),
        "expert_up": jnp.asarray(rng.standard_normal((X, D, M)) / 4, jnp.float32),
        "expert_down": jnp.asarray(rng.standard_normal((X, M, D)) / 3, jnp.float32),
    }


def _reference(h, p, experts=None, norm=True):
    """Every expert on every token (dense), then each token's k chosen ones combined with
    its renormalised router probabilities; ``experts`` [B, T, k] overrides the top-k."""
    x = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + CFG.rms_norm_eps) * p["mlp_norm"]
    probs = jax.nn.softmax(x @ p["router"], axis=-1)  # B T X
    if experts is None:
        experts = jnp.argsort(-probs, axis=-1)[..., :K]
    gates = jnp.take_along_axis(probs, experts, axis=-1)
    if norm:
        gates = gates / gates.sum(-1, keepdims=True)
    every = jnp.einsum("btxm,xmd->btxd", jax.nn.silu(jnp.einsum("btd,xdm->btxm", x, p["expert_gate"]))
                       * jnp.einsum("btd,xdm->btxm", x, p["expert_up"]), p["expert_down"])  # B T X D
    chosen = jnp.take_along_axis(every, experts[..., None], axis=2)  # B T k D
    return h + jnp.einsum("btkd,btk->btd", chosen, gates)


_reference = jax.jit(_reference, static_argnames="norm")


def _h(seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, D)), jnp.float32)


def test_grouped_experts_equal_the_dense_per_expert_reference_with_gradients():
    p, h = _params(), _h()
    ours = jax.jit(lambda h, p: moe_block(_ctx(), h, p, jnp.int32(0))[0])
    np.testing.assert_allclose(np.asarray(ours(h, p)), np.asarray(_reference(h, p)), atol=1e-5)
    cot = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, D)), jnp.float32)
    g1 = jax.jit(jax.grad(lambda h, p: jnp.sum(ours(h, p) * cot), argnums=(0, 1)))(h, p)
    g2 = jax.jit(jax.grad(lambda h, p: jnp.sum(_reference(h, p) * cot), argnums=(0, 1)))(h, p)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert float(jnp.abs(g1[1]["router"]).max()) > 1e-3


def test_without_norm_topk_prob_the_gates_are_the_raw_probabilities():
    cfg = preset_config("tiny-moe", {"hidden_size": 16, "moe_intermediate_size": 8, "norm_topk_prob": False})
    p, h = _params(3), _h(4)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda h, p: moe_block(_ctx(config=cfg), h, p, jnp.int32(0))[0])(h, p)),
                               np.asarray(_reference(h, p, norm=False)), atol=1e-5)


def _shifted(own):
    """Other experts than ``own`` for the first token of each row (the rest unchanged)."""
    other = (own + 3) % X
    return own.at[:, 0].set(other[:, 0])


def test_replay_uses_the_given_experts_and_the_router_still_learns():
    """R3: the replayed ids replace the top-k; their gates are the router's probabilities,
    so the router's gradient is the reference's with those experts."""
    p, h = _params(5), _h(6)
    _, routing = jax.jit(lambda h, p: moe_block(_ctx(MoeCall()), h, p, jnp.int32(0)))(h, p)
    own = routing.experts.astype(jnp.int32)
    replay = _shifted(own)

    @functools.partial(jax.jit, static_argnums=2)
    def ours(h, p, use):
        call = MoeCall(replay=replay.astype(jnp.int16), use_replay=use)
        return moe_block(_ctx(call), h, {**p, "moe_replay": replay.astype(jnp.int16)}, jnp.int32(0))

    out, r = ours(h, p, True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(_reference(h, p, replay)), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(r.experts), np.asarray(replay))
    # the recomputed top-k differs from the replayed ids on the first token of each row
    assert float(r.agree) == B * T - B and float(r.tokens) == B * T
    cot = jnp.ones((B, T, D))
    g = jax.jit(jax.grad(lambda p: jnp.sum(ours(h, p, True)[0] * cot)))(p)
    gr = jax.jit(jax.grad(lambda p: jnp.sum(_reference(h, p, replay) * cot)))(p)
    np.testing.assert_allclose(np.asarray(g["router"]), np.asarray(gr["router"]), atol=1e-5)
    assert float(jnp.abs(g["router"]).max()) > 1e-3
    # off: the ids are only compared; the output is the model's own routing
    out_off, r_off = ours(h, p, False)
    np.testing.assert_allclose(np.asarray(out_off), np.asarray(_reference(h, p)), atol=1e-5)
    assert float(r_off.agree) == B * T - B
    np.testing.assert_array_equal(np.asarray(r_off.experts), np.asarray(own))


def test_routing_statistics_count_only_masked_tokens():
    p, h = _params(7), _h(8)
    mask = jnp.asarray(np.arange(T)[None, :] < np.array([[3], [5]]))
    _, r = jax.jit(lambda h, p: moe_block(_ctx(MoeCall(mask=mask)), h, p, jnp.int32(0)))(h, p)
    e = np.asarray(r.experts)
    counts = np.bincount(e[np.asarray(mask)].reshape(-1), minlength=X)
    np.testing.assert_array_equal(np.asarray(r.load), counts)
    assert float(r.tokens) == 8 and float(r.load.sum()) == 8 * K
    stacked = jax.tree.map(lambda a: a[None], r)  # one layer, as the scan stacks it
    x = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + CFG.rms_norm_eps) * p["mlp_norm"]
    logits = np.asarray(x @ p["router"], np.float64)[np.asarray(mask)]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    lse = np.log(np.exp(logits).sum(-1))
    assert float(router_z_loss(stacked)) == pytest.approx(np.mean(lse ** 2), rel=1e-5)
    f, P = counts / (8 * K), probs.mean(0)
    assert float(load_balancing_loss(stacked, K)) == pytest.approx(X * np.sum(f * P), rel=1e-5)
