"""The GRPO trainer end to end on the tiny model (8 CPU devices)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from grpo.core.config import load_config
from grpo.engine.metrics import read_metrics
from grpo.engine.trainer import Interrupted, Trainer

ROOT = Path(__file__).parent.parent

TINY = {
    "model": {"source": "random", "random": {"preset": "tiny"}},
    "rollout": {"num_generations": 2, "max_prompt_length": 32, "max_new_tokens": 3, "early_stop_chunk": 0},
    "task": {"name": "arithmetic", "options": {"max_operand": 4, "num_examples": 64, "num_test_examples": 8}},
    "train": {"steps": 1, "prompts_per_step": 8, "optimizer": {"learning_rate": 1e-3}},
    "checkpoint": {"every_n_steps": 0, "at_end": False},
    "logging": {"progress_bar": False, "plot": False},
}


def _config(**overrides):
    sets = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    return load_config(TINY, sets)


def _params_np(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


@pytest.mark.parametrize("style", ["legacy", "maxtext"])
@pytest.mark.parametrize("loss", ["jax", "pallas"])
def test_one_step_every_style_and_loss(tmp_path, example_plugin, style, loss):
    # The third-party `length` task (tests/fixtures/example_plugin) rewards longer
    # completions, so even a random policy gets non-zero advantages and a real update.
    overrides = {"rollout.style": style, "loss.impl": loss, "task": {"name": "length"}}
    if loss == "pallas":
        overrides["loss.options"] = {"interpret": True}
    trainer = Trainer(_config(**overrides), tmp_path)
    before = _params_np(trainer)
    summary = trainer.run()
    assert summary["steps"] == 1
    [row] = read_metrics(tmp_path)
    for key in ("reward/mean", "reward/std", "loss", "grad_norm", "clip_frac/low", "clip_frac/high", "kl",
                "logprob_gap/sampler_trainer", "completion/length_mean", "completion/clipped_frac",
                "time/train/step_s", "time/train/rollout_generate_s", "time/train/update_s",
                "throughput/train/valid_tokens_per_s", "time/train/step_avg_last10_s", "skipped_nonfinite_steps",
                "reward/length/mean"):
        assert key in row, key
    # CPU reports no memory stats: the keys are omitted rather than zero.
    assert not any(k.startswith("memory/") for k in row)
    assert np.isfinite(row["loss"]) and row["grad_norm"] > 0
    # The trainer's log-probs of the sampled tokens match the sampler's.
    assert row["logprob_gap/sampler_trainer"] < 1e-4
    assert any(not np.array_equal(a, b) for a, b in zip(before, _params_np(trainer)))
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["rollout"]["style"] == style
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1


BF16 = {"model.param_dtype": "bfloat16", "model.compute_dtype": "bfloat16"}


def test_recipe_precision_beta_ppo_epochs_tis_eval_and_wandb_offline(tmp_path, example_plugin):
    """The recipes' settings: bf16 parameters and compute with f32 master weights, beta > 0,
    two PPO epochs, truncated IS. A large step makes the second epoch clip: the logged
    clip fractions, ratio and approx_kl must show it (before: the first, on-policy epoch
    was logged, so they could never move)."""
    from grpo.engine.update import MasterWeights

    cfg = _config(**BF16, **{
        "task": {"name": "length"}, "train.optimizer": {"learning_rate": 0.05},
        "loss.beta": 0.1, "loss.tis_cap": 2.0, "train.ppo_epochs": 2, "train.steps": 2, "train.micro_batch_size": 8,
        "eval.every_n_steps": 2, "eval.num_examples": 6, "eval.batch_size": 8,
        "logging.wandb": {"mode": "offline", "project": "grpo-test"}, "logging.plot": True,
    })
    trainer = Trainer(cfg, tmp_path)
    assert trainer.ref_params is not None and isinstance(trainer.opt_state, MasterWeights)
    summary = trainer.run()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["kl"] >= 0 and r["approx_kl"] > 0
        assert r["ratio/mean"] != 1.0
        assert "tis/weight_mean" in r and "is_ratio/sampler_trainer/mean" in r
    assert max(r["clip_frac/low"] + r["clip_frac/high"] for r in rows) > 0
    assert rows[1]["kl"] > 0  # the policy left the reference after step 1
    for p, m in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(trainer.opt_state.master)):
        assert p.dtype == jax.numpy.bfloat16 and m.dtype == jax.numpy.float32
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(p.dtype)))
    ev = summary["eval"]
    assert ev["eval/num_prompts"] == 6 and 0.0 <= ev["eval/pass@1"] <= 1.0
    assert (tmp_path / "eval.jsonl").exists()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_resume_after_sigterm_is_bitwise_identical(tmp_path, precision):
    steps = {"train.steps": 6, **(BF16 if precision == "bf16" else {})}
    straight = Trainer(_config(**steps), tmp_path / "straight")
    straight.run()

    run_dir = tmp_path / "resumed"
    first = Trainer(_config(**steps), run_dir)
    step_fn = first.train_step

    def train_step_then_preempt():
        row = step_fn()
        if first.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, as on a preempted TPU
        return row

    first.train_step = train_step_then_preempt
    with pytest.raises(Interrupted) as stop:
        first.run()
    assert stop.value.step == 3 and stop.value.exit_code == 128 + signal.SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert first.checkpointer.latest_step() == 3

    second = Trainer(_config(**steps), run_dir)
    assert second.maybe_resume() and second.step == 3
    second.run()
    for a, b in zip(_params_np(straight), _params_np(second)):
        np.testing.assert_array_equal(a, b)
    timing = ("time/", "throughput/")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rows]  # noqa: E731
    assert strip(read_metrics(run_dir)) == strip(read_metrics(tmp_path / "straight"))


def test_quickstart_learns():
    """The quickstart's task is learnable: mean reward rises within bounded steps."""
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["train.steps=60", "logging.progress_bar=false",
                                                           "logging.plot=false", "checkpoint.at_end=false",
                                                           "checkpoint.every_n_steps=0"])
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        Trainer(cfg, d).run()
        rewards = [r["reward/mean"] for r in read_metrics(d)]
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert last > first + 0.1, (first, last)


def _cli(*args, env=None, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "grpo.core.cli", *args],
        env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw,
    )


def test_cli_sigterm_leaves_loadable_checkpoint_and_export(tmp_path):
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(dict(TINY, train=dict(TINY["train"], steps=500))))
    run_dir = tmp_path / "run"
    proc = _cli("run", str(cfg_path), "--run-dir", str(run_dir))
    deadline = time.time() + 300
    while time.time() < deadline and not read_metrics(run_dir):
        time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "checkpoint saved" in err and "--run-dir" in err
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] >= 1

    # The checkpoint loads: export it and compare with transformers.
    out_dir = tmp_path / "hf"
    export = _cli("export", str(run_dir), str(out_dir))
    out, err = export.communicate(timeout=300)
    assert export.returncode == 0, err
    import torch
    from transformers import AutoModelForCausalLM

    from grpo.engine.checkpoint import Checkpointer
    from grpo.models.loading import load_hf

    hf = AutoModelForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32)
    ours = load_hf(out_dir)
    tokens = np.array([[5, 17, 42, 99, 3]], np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    hidden, _ = ours(tokens, np.arange(5, dtype=np.int32)[None])
    np.testing.assert_allclose(np.asarray(ours.logits(hidden)), ref, atol=1e-4)
    # ... and the exported weights are the trained checkpoint's, not the random init.
    from grpo.models.loading import random_init

    init = random_init("tiny", seed=0)
    assert not np.allclose(np.asarray(init.embed[...]), np.asarray(ours.embed[...]))
    ck = Checkpointer(run_dir / "checkpoints", keep=1)
    assert ck.latest_step() == steps[-1]
    ck.close()


def test_gsm8k_on_an_hf_checkpoint_one_step_and_eval(tmp_path):
    """The real data path: a local HF checkpoint (config + safetensors + tokenizer with a
    chat template) and GSM8K-format jsonl files loaded through `datasets`."""
    from grpo.models.tiny import write_tiny_checkpoint

    model_dir = write_tiny_checkpoint(tmp_path / "model", tied=False)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    rows = [
        {"question": f"Tom has {i} apples and buys {i + 2} more. How many?",
         "answer": f"He has {i} + {i + 2} = {2 * i + 2}.\n#### {2 * i + 2:,}"}
        for i in range(1, 17)
    ]
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(TINY, [
        "model.source=hf", f"model.path={model_dir}",
        "task.name=gsm8k",
        "task.options=" + json.dumps({"data_files": {"train": str(tmp_path / "train.jsonl"),
                                                     "test": str(tmp_path / "test.jsonl")}}),
        "rollout.max_prompt_length=512", "eval.every_n_steps=1", "eval.num_examples=8", "eval.batch_size=8",
    ])
    trainer = Trainer(cfg, tmp_path / "run")
    # Every EOS id stops a completion: the tokenizer's and the generation config's.
    assert {1, 2, trainer.policy.tokenizer.eos_token_id} <= set(trainer.policy.eos_ids)
    prompt = trainer.render(trainer.prompts.examples[0])
    assert prompt.startswith("<|im_start|>") and "Tom has" in prompt
    summary = trainer.run()
    [row] = read_metrics(tmp_path / "run")
    assert "reward/correct/mean" in row and "reward/format/mean" in row
    assert summary["eval"]["eval/num_prompts"] == 8


@pytest.mark.parametrize("loss", ["jax", "pallas"])
@pytest.mark.parametrize("family", ["qwen3_untied", "llama_tied_rope3"])
def test_one_step_and_export_per_model_family(tmp_path, example_plugin, family, loss):
    """A Qwen3 and a Llama 3 checkpoint written by transformers: sampler, update with each
    loss, checkpoint, `grpo export`, and transformers reloads the export with our logits."""
    from _model_fixtures import checkpoint

    overrides = {
        "model": {"source": "hf", "path": str(checkpoint(family)), "architecture": family.split("_")[0]},
        "loss.impl": loss, "task": {"name": "length"}, "checkpoint.at_end": loss == "jax",
    }
    if loss == "pallas":
        overrides["loss.options"] = {"interpret": True}
    trainer = Trainer(_config(**overrides), tmp_path)
    assert trainer.policy.model.config.family == family.split("_")[0]
    before = _params_np(trainer)
    trainer.run()
    [row] = read_metrics(tmp_path)
    assert np.isfinite(row["loss"]) and row["grad_norm"] > 0
    assert row["logprob_gap/sampler_trainer"] < 1e-4
    assert any(not np.array_equal(a, b) for a, b in zip(before, _params_np(trainer)))
    if loss != "jax":
        return
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from grpo.engine.export import export_run

    out = export_run(tmp_path, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family.split("_")[0]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = np.array([[5, 17, 42, 99, 3, 250]], np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    trained = nnx.merge(trainer.graphdef, trainer.params)
    hidden, _ = trained(tokens, np.arange(6, dtype=np.int32)[None])
    np.testing.assert_allclose(np.asarray(trained.logits(hidden)), ref, atol=1e-4)
