"""Group and per-turn advantages against a NumPy reference: baselines, scales, exact zeros
for equal rewards, and the reward scopes of multi-turn credit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from grpo.engine.training.advantages import group_advantages, turn_advantages, turn_ids


def _np_reference(r, k, baseline, scale, eps):
    out = []
    batch_std = np.asarray(r, np.float64).std()
    for g in np.asarray(r, np.float64).reshape(-1, k):
        if baseline == "rloo":
            adv = np.array([g[i] - np.delete(g, i).mean() for i in range(k)])
        else:
            adv = g - g.mean()
        if scale == "group_std":
            adv = adv / (g.std() + eps)
        elif scale == "batch_std":
            adv = adv / (batch_std + eps)
        out.append(adv)
    return np.concatenate(out)


@pytest.mark.parametrize("baseline", ["group_mean", "rloo"])
@pytest.mark.parametrize("scale", ["group_std", "batch_std", "none"])
def test_group_advantages_match_reference(baseline, scale):
    r = np.array([1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.0, 1.0])
    got = group_advantages(jnp.asarray(r), num_generations=4, baseline=baseline, scale=scale, epsilon=1e-4)
    np.testing.assert_allclose(np.asarray(got), _np_reference(r, 4, baseline, scale, 1e-4), rtol=1e-5, atol=1e-6)
    # A group with equal rewards carries no signal.
    np.testing.assert_array_equal(np.asarray(got)[4:8], 0.0)


@pytest.mark.parametrize("baseline", ["group_mean", "rloo"])
@pytest.mark.parametrize("scale", ["group_std", "batch_std", "none"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("value", [1.2, 0.7, 1.0 / 3.0, -2.9])
def test_equal_rewards_give_exactly_zero_advantage(baseline, scale, dtype, value):
    """1.2 is the GSM8K recipe's reward for correct + format: a solved group must not be
    pushed up by a rounding residue (before the fix: 1.19e-3 per member for 8 x 1.2)."""
    r = jnp.concatenate([jnp.full((8,), value, dtype), jnp.asarray([0.0, 1.2, 1.2, 0.7, 0.0, 0.0, 1.2, 1.2], dtype)])
    got = np.asarray(group_advantages(r, num_generations=8, baseline=baseline, scale=scale))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[:8], 0.0)
    assert np.all(got[8:] != 0.0)  # a mixed group still carries its signal


def test_batch_std_puts_every_group_on_one_scale():
    """batch_std divides by one number: two groups with the same ranking but spreads 10x
    apart keep their 10x ratio (group_std would make them equal)."""
    r = jnp.asarray([0.0, 1.0, 0.0, 1.0, 0.0, 0.1, 0.0, 0.1])
    batch = np.asarray(group_advantages(r, num_generations=4, scale="batch_std", epsilon=1e-6))
    group = np.asarray(group_advantages(r, num_generations=4, scale="group_std", epsilon=1e-6))
    np.testing.assert_allclose(batch[:4] / batch[4:], 10.0, rtol=1e-4)
    np.testing.assert_allclose(group[:4], group[4:], rtol=1e-3)


# Three rows of a multi-turn rollout (1: the model's tokens; 0: inserted replies, padding).
OWN = np.array([
    [1, 1, 0, 0, 1, 1, 0, 1, 0],  # three model turns
    [1, 1, 1, 0, 0, 0, 0, 0, 0],  # one (the call never closed)
    [1, 0, 0, 1, 1, 0, 0, 0, 0],  # two
    [0, 0, 0, 0, 0, 0, 0, 0, 0],  # none (an empty row)
], np.int32)


def test_turn_ids():
    turn, turns = turn_ids(jnp.asarray(OWN))
    np.testing.assert_array_equal(np.asarray(turns), [3, 1, 2, 0])
    np.testing.assert_array_equal(np.asarray(turn)[0], [0, 0, -1, -1, 1, 1, -1, 2, -1])
    np.testing.assert_array_equal(np.asarray(turn)[2], [0, -1, -1, 1, 1, -1, -1, -1, -1])
    assert (np.asarray(turn)[3] == -1).all()


@pytest.mark.parametrize("baseline", ["group_mean", "rloo"])
@pytest.mark.parametrize("scale", ["group_std", "batch_std", "none"])
def test_turn_advantages_against_reference(baseline, scale):
    """Each scope's rewards get their own group advantage (the NumPy reference above), and
    a token takes those of the scopes its turn is in: ``first`` only the first model turn,
    ``last`` only the last (both, in a one-turn row), ``all`` every model token;
    inserted tokens 0. Two groups of 4 rows (K = 4)."""
    own = np.concatenate([OWN, OWN[[2, 0, 1, 2]]])
    rng = np.random.default_rng(0)
    comps = {s: rng.normal(size=8).astype(np.float32) for s in ("all", "first", "last")}
    got = np.asarray(turn_advantages({s: jnp.asarray(v) for s, v in comps.items()}, jnp.asarray(own),
                                     num_generations=4, baseline=baseline, scale=scale, epsilon=1e-4))
    adv = {s: _np_reference(v, 4, baseline, scale, 1e-4) for s, v in comps.items()}
    want = np.zeros(own.shape)
    for b, row in enumerate(own):
        starts = [t for t in range(len(row)) if row[t] and (t == 0 or not row[t - 1])]
        for t in range(len(row)):
            if not row[t]:
                continue
            turn = sum(s <= t for s in starts) - 1
            want[b, t] = adv["all"][b] + (turn == 0) * adv["first"][b] + (turn == len(starts) - 1) * adv["last"][b]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # With every reward crediting every turn, it is sequence-level GRPO on the model's tokens.
    only_all = np.asarray(turn_advantages({"all": jnp.asarray(comps["all"])}, jnp.asarray(own), num_generations=4,
                                          baseline=baseline, scale=scale))
    seq = np.asarray(group_advantages(jnp.asarray(comps["all"]), num_generations=4, baseline=baseline, scale=scale))
    np.testing.assert_array_equal(only_all, np.where(own > 0, seq[:, None], 0.0))
    with pytest.raises(ValueError, match="unknown reward scopes"):
        turn_advantages({"middle": jnp.zeros(8)}, jnp.asarray(own), num_generations=4)


def test_group_advantages_shape_error():
    with pytest.raises(ValueError, match="prompts \\* 4"):
        group_advantages(jnp.ones(6), num_generations=4)


def test_informative_groups_follow_the_credit_the_update_trains_on():
    """The issue's group (the lookup task's weights and scopes): call = [1, 0] (0.5, first
    turn) and prefix = [0, 1] (0.5, every turn) give equal totals, so sequence credit
    trains it with zero advantage; turn credit trains its last turn with -1/+1 (the first
    turn's scopes cancel) when the rows have two turns, and with zero when they have one
    (``first`` and ``all`` then meet on the same tokens)."""
    from grpo.engine.training.advantages import informative_groups

    call, prefix = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    totals = 0.5 * call + 0.5 * prefix
    seq = group_advantages(jnp.asarray(totals), num_generations=2)
    assert not bool(informative_groups(seq, num_generations=2)[0])
    two_turns = jnp.asarray([[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1]])  # call, tool reply, answer
    comps = {"first": jnp.asarray(0.5 * call), "all": jnp.asarray(0.5 * prefix)}
    adv = np.asarray(turn_advantages(comps, two_turns, num_generations=2))
    np.testing.assert_array_equal(adv[:, :4], 0.0)  # the call's scopes cancel; the reply is not trained
    np.testing.assert_allclose(adv[:, 4:], [[-1, -1], [1, 1]], atol=1e-3)  # 0.25 / (0.25 + 1e-4)
    assert bool(informative_groups(jnp.asarray(adv), two_turns, num_generations=2)[0])
    one_turn = jnp.asarray([[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]])
    adv1 = turn_advantages(comps, one_turn, num_generations=2)
    np.testing.assert_array_equal(np.asarray(adv1), 0.0)
    assert not bool(informative_groups(adv1, one_turn, num_generations=2)[0])
    # Only the trained tokens count: a non-zero advantage on an untrained token is none.
    stray = jnp.zeros((2, 6)).at[0, 2].set(1.0)
    assert not bool(informative_groups(stray, two_turns, num_generations=2)[0])
    assert bool(informative_groups(stray, one_turn, num_generations=2)[0])
    with pytest.raises(ValueError, match="trained tokens"):
        informative_groups(stray, num_generations=2)
