"""The loop's buffer (grpo/engine/loop/buffer.py): version bookkeeping and the
staleness refusal by hand, the correction's weights by hand, and a buffered rollout
through a real Orbax checkpoint."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _runs import _config

from grpo.core.contracts import MismatchCorrection
from grpo.engine.loop.buffer import accepted_groups, refuse, staleness

# ------------------------------------------------------------------ bookkeeping by hand


def test_staleness_and_refusal_by_hand():
    # 3 groups of 2 rows at step 5: versions 5,5 | 4,3 | 2,4 (staleness 0,0 | 1,2 | 3,1).
    versions = np.array([5, 5, 4, 3, 2, 4])
    np.testing.assert_array_equal(staleness(step=5, versions=versions), [0, 0, 1, 2, 3, 1])
    np.testing.assert_array_equal(accepted_groups(step=5, versions=versions, max_staleness=2, group_size=2),
                                  [True, True, False])
    np.testing.assert_array_equal(accepted_groups(step=5, versions=versions, max_staleness=0, group_size=2),
                                  [True, False, False])
    np.testing.assert_array_equal(accepted_groups(step=5, versions=versions, max_staleness=3, group_size=2),
                                  [True, True, True])


def test_refused_groups_get_exactly_zero_advantage():
    adv = jnp.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    out = refuse(adv, np.array([True, False, True]), group_size=2)
    np.testing.assert_array_equal(np.asarray(out), [1.0, -1.0, 0.0, 0.0, 2.0, -2.0])
    per_token = jnp.arange(12, dtype=jnp.float32).reshape(6, 2) + 1.0  # turn credit [B, N]
    out = np.asarray(refuse(per_token, np.array([False, True, True]), group_size=2))
    np.testing.assert_array_equal(out[:2], 0.0)
    np.testing.assert_array_equal(out[2:], np.asarray(per_token)[2:])


def test_async_defaults_the_off_policy_correction():
    stale = _config(**{"train.async": {"enabled": True, "max_staleness": 1}})
    assert stale.loss.mismatch is not None and (stale.loss.mismatch.level, stale.loss.mismatch.mode) == ("token", "truncate")
    assert _config(**{"train.async": {"enabled": True, "max_staleness": 0}}).loss.mismatch is None
    chosen = _config(**{"train.async": {"enabled": True}, "loss.mismatch": {"level": "sequence", "cap": 3.0}})
    assert (chosen.loss.mismatch.level, chosen.loss.mismatch.cap) == ("sequence", 3.0)


def test_the_correction_weights_by_hand():
    """A sample drawn one step ago: behaviour log-probs (the sampler's, old weights) vs the
    trainer's at the current weights; the loss weighs each token by
    min(exp(current - behaviour), cap) and the PPO ratio is against the current ones."""
    from grpo.plugins.losses._common import mismatch_weight

    behaviour = jnp.array([[-1.0, -1.5, -0.3, 0.0]])
    current = jnp.array([[-0.5, -0.2, -0.9, 0.0]])
    valid = jnp.array([[True, True, True, False]])
    token, _ = mismatch_weight(old=current, sampler=behaviour, valid=valid,
                               correction=MismatchCorrection(level="token", mode="truncate", cap=2.0))
    np.testing.assert_allclose(np.asarray(token)[0, :3], [math.exp(0.5), 2.0, math.exp(-0.6)], rtol=1e-6)
    seq, _ = mismatch_weight(old=current, sampler=behaviour, valid=valid,
                             correction=MismatchCorrection(level="sequence", mode="truncate", cap=2.0))
    np.testing.assert_allclose(np.asarray(seq)[0, :3], [min(math.exp(0.5 + 1.3 - 0.6), 2.0)] * 3, rtol=1e-6)
    masked, _ = mismatch_weight(old=current, sampler=behaviour, valid=valid,
                                correction=MismatchCorrection(level="token", mode="mask", cap=2.0))
    np.testing.assert_array_equal(np.asarray(masked)[0, :3], [1.0, 0.0, 1.0])


def test_a_buffered_rollout_round_trips_through_an_orbax_checkpoint(tmp_path):
    """Every field back as saved through the real checkpointer (the routed experts of
    router replay, issue 54, among them): device arrays in their shardings, host arrays and scalars with their dtypes, records, dicts, lists, None; an
    array held twice (``logged_rewards is rewards``) comes back as one object."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from grpo.engine.loop.buffer import Buffered, decode, encode, like
    from grpo.engine.rollout.sampler import RolloutOutput
    from grpo.engine.rollout.step import SampleGroup, StepRollout, ToolTotals
    from grpo.engine.runs.checkpoint import Checkpointer

    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    tokens = jax.device_put(jnp.arange(24, dtype=jnp.int32).reshape(4, 6), rows)
    mask = jax.device_put(jnp.ones((4, 6), jnp.int32), rows)
    logprobs = jax.device_put(-jnp.linspace(0.1, 2.0, 24, dtype=jnp.float32).reshape(4, 6), rows)
    rewards = jax.device_put(jnp.array([0.5, -1.0, 0.25, 2.0], jnp.float32), rows)
    output = RolloutOutput(prompt_tokens=tokens[:, :2], prompt_mask=mask[:, :2], tokens=tokens, mask=mask,
                           lengths=jnp.sum(mask, axis=1), truncated=jax.device_put(jnp.array([True, False] * 2), rows),
                           logprobs=logprobs,
                           # issue 54: the rollout's routed experts [B, N, layers, k] int16 (router replay)
                           routed_experts=jax.device_put(
                               (jnp.arange(96, dtype=jnp.int32).reshape(4, 6, 2, 2) % 9 - 1).astype(jnp.int16), rows))
    group = SampleGroup(example={"question": "2+2", "answer": 4, "tags": ["a", {"b": None}]}, texts=["4", "5"],
                        rewards=np.array([1.0, 0.0], np.float32), turns=[[{"role": "assistant", "text": "4",
                                                                          "trained": True}]])
    rollout = StepRollout(output=output, rewards=rewards, rewards_by_fn={"correct": rewards * 2},
                          logged_rewards=rewards, logged_by_fn={"correct": np.array([1.0, -2.0, 0.5, 4.0])},
                          reward_names=["correct"], reward_errors=jax.device_put(jnp.array([3], jnp.int32), rep),
                          generated_tokens=jax.device_put(jnp.array(24, jnp.int32), rep), rollout_s=0.123456789,
                          tools=ToolTotals(jax.device_put(jnp.arange(5), rep), 4, 0.5, 0.25),
                          metrics={"dynamic_sampling/rounds": 2.0, "x": np.float32(1.5)}, group=group, prompts_drawn=2)
    entries = [Buffered(step=3, position=16, versions=np.array([2, 2, 1, 1]), rollout=rollout)]
    arrays = {}
    spec = encode(entries, arrays, {})
    checkpointer = Checkpointer(tmp_path / "ckpt", keep=1)
    checkpointer.save(3, {"buffer": arrays}, {"async": spec})
    restored, meta = checkpointer.restore({"buffer": like(spec, mesh)}, 3)
    back = decode(meta["async"], restored["buffer"])[0]
    assert (back.step, back.position, back.versions.tolist()) == (3, 16, [2, 2, 1, 1])
    got, want = back.rollout, rollout
    assert got.logged_rewards is got.rewards and got.metrics == want.metrics
    assert (got.group.example, got.group.texts, got.group.turns) == (group.example, group.texts, group.turns)
    np.testing.assert_array_equal(got.group.rewards, group.rewards)
    assert got.group.rewards.dtype == np.float32
    assert isinstance(got.metrics["x"], np.float32) and got.rollout_s == want.rollout_s
    assert (got.tools.rows, got.tools.tools_s, got.reward_names, got.prompts_drawn) == (4, 0.5, ["correct"], 2)
    assert got.output.loss_mask is None and got.informative is None
    assert got.output.routed_experts.dtype == jnp.int16 and got.output.routed_experts.sharding == rows
    pairs = [(got.output, want.output), (got.rewards_by_fn, want.rewards_by_fn), (got.logged_by_fn, want.logged_by_fn),
             (got.reward_errors, want.reward_errors), (got.tools.counts, want.tools.counts)]
    for a, b in zip(*(jax.tree.leaves([p[i] for p in pairs]) for i in (0, 1)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.dtype == b.dtype and type(a) is type(b)
        if isinstance(b, jax.Array):
            assert a.sharding == b.sharding
    with pytest.raises(TypeError, match="cannot checkpoint a buffered set"):
        encode({"bad": {1, 2}}, {}, {})
    checkpointer.close()
