"""The optimizer: schedule, clipping, and the learning rate each step applies whatever the
PPO epochs (with a skipped non-finite update)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def test_optimizer_schedule_and_clipping():
    from grpo.core.config import OptimizerConfig
    from grpo.engine.training.optim import learning_rate_schedule, make_optimizer

    cfg = OptimizerConfig(learning_rate=1.0, warmup_steps=3, schedule="linear", min_lr_ratio=0.1)
    sched = learning_rate_schedule(cfg, total_steps=13)
    assert float(sched(0)) == pytest.approx(0.25) and float(sched(3)) == pytest.approx(1.0)
    assert float(sched(13)) == pytest.approx(0.1)
    opt = make_optimizer(OptimizerConfig(learning_rate=0.1, max_grad_norm=1.0, name="lion"), 10)
    params = {"w": jnp.zeros(3)}
    updates, _ = opt.update({"w": jnp.array([30.0, 40.0, 0.0])}, opt.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["w"]), [-0.1, -0.1, 0.0], atol=1e-6)


def _cosine_warmup_by_hand(step: int, *, peak: float, warm: int, total: int, floor: float) -> float:
    """The configured schedule at training step ``step`` (0-based), written out: linear
    warm-up from peak/(warm+1) reaching the peak at step ``warm``, then cosine to floor*peak."""
    if step < warm:
        return peak * (step + 1) / (warm + 1)
    t = min(step - warm, total - warm) / (total - warm)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


@pytest.mark.parametrize("epochs", [1, 3])
def test_applied_learning_rate_follows_the_step_schedule_whatever_the_ppo_epochs(epochs):
    """Lion without weight decay moves every parameter by exactly lr (times a sign), so each
    optimizer call's parameter change is the rate it applied. Every epoch of a training step
    applies that step's rate, warm-up ends at the configured step, a skipped non-finite
    update applies nothing and shifts nothing after it, and the rate read back from the
    optimizer's count (what the trainer logs; inside MasterWeights too) is the applied one."""
    from grpo.core.config import OptimizerConfig
    from grpo.engine.training import optim
    from grpo.engine.training.update import MasterWeights, keep_if_finite

    peak, warm, total, floor = 0.1, 3, 8, 0.1
    cfg = OptimizerConfig(name="lion", learning_rate=peak, warmup_steps=warm, schedule="cosine", min_lr_ratio=floor,
                          weight_decay=0.0, max_grad_norm=1.0)
    opt = optim.make_optimizer(cfg, total, epochs)
    schedule = optim.optimizer_schedule(cfg, total, epochs)
    params = {"w": jnp.zeros(4)}
    grads = {"w": jnp.array([1.0, -2.0, 3.0, -4.0])}
    state = opt.init(params)
    skip = (4, epochs - 1)  # the last epoch of step 4 is non-finite
    applied = []
    for step in range(total):
        want = _cosine_warmup_by_hand(step, peak=peak, warm=warm, total=total, floor=floor)
        for epoch in range(epochs):
            updates, new_state = opt.update(grads, state, params)
            finite = jnp.asarray((step, epoch) != skip)
            new_params = jax.tree.map(lambda p, u: p + u, params, updates)
            new_params, new_state = keep_if_finite(finite, (new_params, new_state), (params, state))
            change = np.abs(np.asarray(new_params["w"] - params["w"]))
            if (step, epoch) == skip:
                np.testing.assert_array_equal(change, 0.0)
                # The moments stay, the schedule's count moves on.
                for a, b in zip(jax.tree.leaves(new_state[1][0]), jax.tree.leaves(state[1][0])):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:
                np.testing.assert_allclose(change, want, rtol=1e-5, err_msg=f"step {step} epoch {epoch}")
                applied.append(float(change[0]))
            params, state = new_params, new_state
            assert int(optim.schedule_count(state)) == step * epochs + epoch + 1
            assert optim.applied_learning_rate(schedule, state) == pytest.approx(want, rel=1e-6)
    assert applied.index(max(applied)) == warm * epochs  # the peak: the first epoch of step `warm`
    assert int(optim.schedule_count(MasterWeights(master=params, inner=state))) == total * epochs
