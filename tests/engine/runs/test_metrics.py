"""The metrics logger: metrics.jsonl and eval.jsonl, the plot, device memory metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest

from _glossary import assert_glossary


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
    assert_glossary(got, "Accelerator memory")  # issue 52: what the trainer adds to the step's row on a GPU/TPU


def test_the_reward_panel_draws_each_rewards_share_of_the_total():
    """Issue 52: the quickstart's metrics.png drew ``close``/``format``/``length`` (weight 0)
    beside ``correct`` and ``prefix``, each unweighted, so the lines did not add up to
    ``reward/mean`` (max 1.5). With the run's weights, each line is a reward's share and
    the shares sum to ``reward/mean``; rewards of weight 0 are not drawn."""
    from grpo.engine.runs.metrics import reward_lines

    rows = [{"reward/mean": 1.0 * c + 0.5 * p, "reward/correct/mean": c, "reward/prefix/mean": p,
             "reward/close/mean": 0.9, "reward/format/mean": 1.0, "reward/length/mean": 1.0}
            for c, p in ((0.25, 0.5), (0.5, 0.75), (1.0, 1.0))]
    weights = {"correct": 1.0, "prefix": 0.5, "close": 0.0, "length": 0.0, "format": 0.0}
    lines = dict(reward_lines(rows, weights))
    assert list(lines) == ["reward/mean (the sum of the others)", "reward/correct/mean", "0.5 x reward/prefix/mean"]
    total = lines.pop("reward/mean (the sum of the others)")
    assert np.allclose(np.sum(list(lines.values()), axis=0), total)
    # Without weights (a run whose rewards were objects of another process) it says so.
    assert [label for label, _ in reward_lines(rows, None)][1:] == [
        f"reward/{n}/mean (unweighted)" for n in ("close", "correct", "format", "length", "prefix")]


def test_grpo_plot_reads_the_weights_from_the_runs_config(tmp_path):
    """Issue 52: ``grpo plot RUN_DIR`` draws the weighted shares too, reading the weights
    from the run's config.yaml (the quickstart's arithmetic task: correct 1, prefix 0.5)."""
    import yaml

    from grpo.core.config import load_config
    from grpo.engine.cli import _reward_weights

    assert _reward_weights(str(tmp_path)) is None  # no config.yaml: unweighted
    cfg = load_config("configs/quickstart.yaml").model_dump(mode="json", by_alias=True)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    weights = _reward_weights(str(tmp_path))
    assert {k: v for k, v in weights.items() if v} == {"correct": 1.0, "prefix": 0.5}


def test_progress_bar_says_compiling_and_its_eta_counts_only_steps_without_compiles(tmp_path, capsys):
    """Issue 50: the bar sat at 0/800 while compiling, then showed ``eta=4:25:09`` (the
    compiling step in the average) beside tqdm's own remaining time. Now it names the
    program it waits for, and its one ETA times only the steps that compiled nothing."""
    from grpo.engine.runs.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, total_steps=10, start_step=0, is_main=True, run_name="t", progress_bar=True)
    assert logger.eta(0) == "?"
    logger.compiling("jit(rollout)")
    logger.compiling("jit(update)")
    assert logger._bar.desc == "grpo (compiling jit(update): 2 so far)"
    logger.log({"step": 1, "reward/mean": 0.0, "time/train/step_s": 60.0, "compile/count": 7})
    assert logger._bar.desc == "grpo"
    assert logger.eta(1) == "?"  # only a compiling step so far
    logger.log({"step": 2, "reward/mean": 0.0, "time/train/step_s": 1.0, "compile/count": 0})
    logger.log({"step": 3, "reward/mean": 0.0, "time/train/step_s": 3.0, "compile/count": 0})
    assert logger.eta(3) == "0:14"  # 7 steps left at 2 s (the old average: 21.3 s -> 2:29)
    logger.log({"step": 4, "reward/mean": 0.0, "time/train/step_s": 30.0, "compile/count": 1})
    assert logger.eta(4) == "0:12"
    shown = str(logger._bar)
    logger.close()
    assert "eta=0:12" in shown and "<" not in shown and "step/s" not in shown and "s/step" not in shown
    assert "4/10" in capsys.readouterr().err


def test_rollout_scalars_are_one_program_and_match_numpy():
    """Issue 50 (host overhead): the rollout's metrics are one jitted program (one dispatch,
    one compile) rather than a dozen eager ops, each of which compiled at step 1; the
    values against numpy."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    from grpo.engine.runs.compiles import CompileCounter
    from grpo.engine.runs.metrics import rollout_scalars

    rng = np.random.default_rng(0)
    B, N = 6, 5  # a shape no other test gives it
    sampler = rng.normal(size=(B, N)).astype(np.float32)
    trainer = (sampler + rng.normal(scale=0.1, size=(B, N))).astype(np.float32)
    trained = (rng.random((B, N)) < 0.6).astype(np.int32)
    lengths, clipped = trained.sum(1).astype(np.int32), np.array([1, 0, 0, 1, 0, 0], bool)
    rewards = rng.random(B).astype(np.float32)
    out = SimpleNamespace(logprobs=jnp.asarray(sampler), behaviour=None, lengths=jnp.asarray(lengths),
                          truncated=jnp.asarray(clipped))
    rollout = SimpleNamespace(output=out, trained=jnp.asarray(trained), generated_tokens=jnp.int32(40),
                              logged_rewards=rewards, logged_by_fn={"r": rewards})
    with CompileCounter() as counter:
        got = {k: float(v) for k, v in rollout_scalars(rollout, jnp.asarray(trainer)).items()}
        assert counter.read().count == 1  # the scalars' program (the rewards here are host arrays)
    m = trained.astype(np.float64)
    ratio = np.exp(trainer.astype(np.float64) - sampler)
    want = {
        "completion/length_mean": lengths.mean(), "completion/clipped_frac": clipped.mean(),
        "logprob_gap/sampler_trainer": (np.abs(sampler - trainer) * m).sum() / m.sum(),
        "is_ratio/sampler_trainer/mean": (ratio * m).sum() / m.sum(),
        "is_ratio/sampler_trainer/max": ratio[trained > 0].max(), "is_ratio/sampler_trainer/min": ratio[trained > 0].min(),
        # issue 53: KL(sampler || trainer) per trained token, k3 = r - 1 - log r
        "mismatch/kl": ((ratio - 1 - np.log(ratio)) * m).sum() / m.sum(),
        "valid_tokens": m.sum(), "rollout/generated_tokens": 40.0, "rollout/rolled_out_per_trained_token": 40 / m.sum(),
        "reward/mean": rewards.mean(), "reward/std": rewards.std(), "reward/r/mean": rewards.mean(),
    }
    assert got == pytest.approx(want, rel=1e-5)
