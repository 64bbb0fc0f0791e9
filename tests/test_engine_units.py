"""Engine building blocks: advantages, data order, optimizer schedule, checkpoints, metrics."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo.engine.rollout.prompts import (
    PromptSet,
    bucket_for,
    build_batch,
    default_buckets,
    position_indices,
    process_slice,
    step_indices,
)
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


def test_step_indices_epochs_without_replacement():
    n, p = 10, 4
    seen = np.concatenate([step_indices(n, step=s, prompts_per_step=p, seed=3) for s in range(5)])  # 20 = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert not np.array_equal(seen[:10], seen[10:])  # a fresh permutation each epoch
    again = np.concatenate([step_indices(n, step=s, prompts_per_step=p, seed=3) for s in range(5)])
    np.testing.assert_array_equal(seen, again)  # a function of (seed, step) only: resumable
    other = np.concatenate([step_indices(n, step=s, prompts_per_step=p, seed=4) for s in range(5)])
    assert not np.array_equal(seen, other)


def test_position_indices_continue_the_step_order():
    """Dynamic sampling draws from a position, not a step: any split of the positions
    gives the order the steps give."""
    n, p = 10, 4
    by_step = np.concatenate([step_indices(n, step=s, prompts_per_step=p, seed=3) for s in range(5)])
    by_position = np.concatenate([position_indices(n, start=a, count=b - a, seed=3)
                                  for a, b in [(0, 3), (3, 11), (11, 12), (12, 20)]])
    np.testing.assert_array_equal(by_step, by_position)


def test_group_filter_rounds_surplus_and_short_steps():
    from grpo.engine.rollout.dynamic_sampling import GroupFilter, group_spread

    np.testing.assert_array_equal(group_spread(np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2), [False, True, False])
    f = GroupFilter(want=3, max_rounds=4)
    f.add(np.array([True, False, False]))
    assert not f.done
    f.add(np.array([True, True, True]))  # one informative group too many: dropped
    assert f.done and not f.short
    assert f.picks() == ([(0, 0), (1, 0), (1, 1)], 0)
    assert f.metrics() == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/uninformative_groups": 2.0,
                           "dynamic_sampling/dropped_groups": 3.0, "dynamic_sampling/filled_groups": 0.0,
                           "dynamic_sampling/short": 0.0}
    with pytest.raises(RuntimeError, match="after the step is complete"):
        f.add(np.array([True, True, True]))
    short = GroupFilter(want=3, max_rounds=2)
    short.add(np.array([False, True, False]))
    with pytest.raises(ValueError, match="3 groups"):
        short.add(np.array([True, False]))
    short.add(np.array([False, False, False]))
    assert short.done and short.short
    assert short.picks() == ([(0, 1), (0, 0), (0, 2)], 2)  # the earliest equal-reward groups fill
    assert short.metrics() == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/uninformative_groups": 5.0,
                               "dynamic_sampling/dropped_groups": 3.0, "dynamic_sampling/filled_groups": 2.0,
                               "dynamic_sampling/short": 1.0}


def test_down_sampling_keeps_the_max_variance_subset():
    """PODS's max-variance rule against a brute force over every subset (random rewards,
    ties, a constant group); the random rule keeps distinct rows of each group."""
    from itertools import combinations

    from grpo.engine.rollout.dynamic_sampling import down_sample

    rng = np.random.default_rng(0)
    n = 8
    groups = [rng.normal(size=n), rng.integers(0, 2, n).astype(float), np.full(n, 0.5),
              np.array([1.0, 0, 0, 0, 0, 0, 0, 0]), rng.integers(0, 3, n) * 0.5]
    rewards = np.concatenate(groups)
    for keep in (2, 3, 4, 7, 8):
        rows = down_sample(rewards, n, keep)
        assert rows.shape == (len(groups) * keep,)
        for g, group in enumerate(groups):
            mine = rows[g * keep:(g + 1) * keep]
            assert np.all(np.diff(mine) > 0) and mine.min() >= g * n and mine.max() < (g + 1) * n
            best = max(np.var(group[list(c)]) for c in combinations(range(n), keep))
            np.testing.assert_allclose(np.var(rewards[mine]), best, rtol=1e-9, atol=1e-12)
    # One right answer among eight: it is kept, with the wrong ones of the earliest rows.
    np.testing.assert_array_equal(down_sample(groups[3], n, 4), [0, 1, 2, 3])
    np.testing.assert_array_equal(down_sample(np.roll(groups[3], 5), n, 3), [0, 1, 5])
    rows = down_sample(rewards, n, 3, rule="random", rng=np.random.default_rng(1))
    again = down_sample(rewards, n, 3, rule="random", rng=np.random.default_rng(1))
    np.testing.assert_array_equal(rows, again)
    for g in range(len(groups)):
        mine = rows[g * 3:(g + 1) * 3]
        assert len(set(mine)) == 3 and all(g * n <= r < (g + 1) * n for r in mine)
    with pytest.raises(ValueError, match="keep must be"):
        down_sample(rewards, n, 9)


def test_overlong_penalty_matches_the_dapo_formula():
    from grpo.engine.rollout.scoring import overlong_penalty

    lengths = np.arange(0, 17)
    got = overlong_penalty(lengths, max_new_tokens=16, buffer=4, factor=0.5)
    want = [min(-(L - (16 - 4)) / 4 * 0.5, 0.0) for L in lengths]  # 0 up to 12 tokens, -0.5 at 16
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
    assert got.dtype == np.float32 and got[12] == 0.0 and got[16] == -0.5
    with pytest.raises(ValueError, match="buffer=16"):
        overlong_penalty(lengths, max_new_tokens=16, buffer=16, factor=1.0)


def test_buckets_and_left_padding():
    assert default_buckets(256) == [16, 32, 64, 128, 256]
    assert default_buckets(8) == [8]
    assert bucket_for(17, [16, 32]) == 32
    ps = PromptSet(examples=[{"i": i} for i in range(4)], token_ids=[[5], [6, 7, 8], [9, 9], [1, 2, 3, 4, 5]])
    idx = np.array([0, 1, 2, 3])
    b0 = build_batch(ps, idx, local=process_slice(4, 0, 2), buckets=[4, 8], pad_id=0)
    b1 = build_batch(ps, idx, local=process_slice(4, 1, 2), buckets=[4, 8], pad_id=0)
    # Both processes pad to the bucket of the longest prompt of the global batch (5 -> 8).
    assert b0.tokens.shape == b1.tokens.shape == (2, 8)
    np.testing.assert_array_equal(b0.tokens[1], [0, 0, 0, 0, 0, 6, 7, 8])
    np.testing.assert_array_equal(b0.mask[1], [0, 0, 0, 0, 0, 1, 1, 1])
    assert [e["i"] for e in b1.examples] == [2, 3]


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


def test_metrics_logger_and_plot(tmp_path):
    from grpo.engine.runs.metrics import (
        MetricsLogger,
        device_memory_metrics,
        plot_run,
        read_metrics,
    )

    logger = MetricsLogger(tmp_path, total_steps=3, start_step=0, is_main=True, run_name="t", progress_bar=False)
    for s in (1, 2, 3):
        logger.log({"step": s, "reward/mean": s / 3, "time/train/step_s": float(s),
                    "throughput/train/valid_tokens_per_s": 10.0 * s, "loss": np.float32(0.5)})
    logger.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["time/train/step_avg_last10_s"] == pytest.approx(2.0)
    assert rows[0]["loss"] == 0.5
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    png = plot_run(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    assert Image.open(png).size == (1100, 400)  # reward + throughput
    # With eval rows (eval.jsonl) the plot gains the eval pass@k panel between them.
    from grpo.engine.runs.metrics import read_eval

    logger = MetricsLogger(tmp_path, total_steps=3, start_step=0, is_main=True, run_name="t", progress_bar=False,
                           resume=True)
    for s, acc in ((0, 0.0), (2, 0.5), (3, 0.75)):
        logger.log_eval({"step": s, "eval/pass@1": acc, "eval/num_prompts": 4.0, "eval/greedy": True})
    logger.close()
    assert [(r["step"], r["eval/pass@1"]) for r in read_eval(tmp_path)] == [(0, 0.0), (2, 0.5), (3, 0.75)]
    assert Image.open(plot_run(tmp_path)).size == (1650, 400)  # 5.5 inches a panel
    # Memory keys are omitted (not zero) where a backend reports nothing, as CPU does.
    class Dev:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    assert device_memory_metrics([Dev(None), Dev({})]) == {}
    gib = 1024**3
    got = device_memory_metrics([Dev({"bytes_in_use": gib, "peak_bytes_in_use": 3 * gib}), Dev({"bytes_in_use": 2 * gib})])
    assert got == {"memory/train/bytes_in_use_max_gib": 2.0, "memory/train/peak_bytes_in_use_max_gib": 3.0}
