"""The GRPO trainer end to end on the tiny model (8 CPU devices)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from _glossary import assert_glossary
from _runs import TINY, _config, assert_same_run, preempted_and_resumed
from conftest import ROOT

from grpo.core.config import load_config
from grpo.engine.runs.metrics import read_eval, read_metrics
from grpo.engine.trainer import Trainer


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
    # Issue 52: every key is in the metrics glossary, and every key of these sections is logged.
    assert_glossary(row, "Every step", "Sequence packing", *(["Entropy"] if loss == "jax" else []))
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


@pytest.mark.slow
def test_recipe_precision_beta_ppo_epochs_tis_eval_wandb_offline_and_resume(tmp_path, example_plugin):
    """The recipes' settings: bf16 parameters and compute with f32 master weights, beta > 0,
    two PPO epochs, sequence-level truncated IS, evaluation. A large step makes the second epoch clip: the
    logged clip fractions, ratio and approx_kl must show it (before: the first, on-policy
    epoch was logged, so they could never move). The same run preempted by SIGTERM after
    step 2 and resumed ends bit for bit where the uninterrupted one does."""
    from grpo.engine.training.update import MasterWeights

    cfg = _config(**BF16, **{
        "task": {"name": "length"}, "train.optimizer": {"learning_rate": 0.05},
        "loss.beta": 0.1, "loss.mismatch": {"level": "sequence", "mode": "truncate", "cap": 2.0}, "train.ppo_epochs": 2, "train.steps": 4, "train.micro_batch_size": 8,
        "eval.every_n_steps": 2, "eval.num_examples": 6, "eval.batch_size": 8,
        "logging.wandb": {"mode": "offline", "project": "grpo-test"}, "logging.plot": True,
    })
    trainer = Trainer(cfg, tmp_path / "straight")
    assert trainer.ref_params is not None and isinstance(trainer.opt_state, MasterWeights)
    summary = trainer.run()
    rows = read_metrics(tmp_path / "straight")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert_glossary(rows, "Every step", "Mismatch correction")  # issue 52: the metrics glossary, both ways
    assert_glossary(read_eval(tmp_path / "straight"), "Evaluation")
    for r in rows:
        assert r["kl"] >= 0 and r["approx_kl"] > 0
        assert r["ratio/mean"] != 1.0
        assert 0 < r["mismatch/weight_mean"] <= 2.0 and "is_ratio/sampler_trainer/mean" in r
    assert max(r["clip_frac/low"] + r["clip_frac/high"] for r in rows) > 0
    assert rows[1]["kl"] > 0  # the policy left the reference after step 1
    # The optimizer ran twice a step; its schedule count (inside MasterWeights) says so,
    # and the logged rate is the configured one of each step.
    from grpo.engine.training.optim import schedule_count

    assert int(schedule_count(trainer.opt_state)) == 4 * 2
    assert [r["learning_rate"] for r in rows] == [0.05] * 4
    for p, m in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(trainer.opt_state.master)):
        assert p.dtype == jax.numpy.bfloat16 and m.dtype == jax.numpy.float32
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(p.dtype)))
    ev = summary["eval"]
    assert ev["eval/num_prompts"] == 6 and 0.0 <= ev["eval/pass@1"] <= 1.0
    assert (tmp_path / "straight" / "eval.jsonl").exists()
    runs = list((tmp_path / "straight" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert (tmp_path / "straight" / "metrics.png").read_bytes()[:4] == b"\x89PNG"

    resumed = preempted_and_resumed(cfg, tmp_path / "resumed", after=2)
    assert_same_run(trainer, resumed)


@pytest.mark.slow  # a whole run and its resume: 10 s (fast tier budget)
def test_resume_after_sigterm_is_bitwise_identical(tmp_path):
    """The f32 case (bf16 with master weights: the recipe test above)."""
    steps = {"train.steps": 6}
    straight = Trainer(_config(**steps), tmp_path / "straight")
    straight.run()
    assert_same_run(straight, preempted_and_resumed(_config(**steps), tmp_path / "resumed", after=3))


@pytest.mark.slow
def test_compiles_in_the_metrics_and_a_rerun_loads_them_from_the_persistent_cache(tmp_path):
    """Issue 50: every row counts the step's compiles (``compile/count``, ``time/compile_s``),
    summary.json the start-up total; a rerun of the same config in another run directory
    loads every program from the persistent cache (hits, no miss: nothing new compiled).
    Its own cache directory: the suite's session cache would answer the first run too."""
    from grpo.engine.runs.compiles import CACHE_ENV, use_cache

    cache = tmp_path / "cache"
    cfg = _config(**{"train.steps": 2, "train.compile.cache_dir": str(cache)})
    try:
        first = Trainer(cfg, tmp_path / "first").run()
        second = Trainer(cfg, tmp_path / "second").run()
    finally:
        use_cache(os.environ.get(CACHE_ENV))  # the session's cache back for the tests after this one
    rows = read_metrics(tmp_path / "first")
    assert rows[0]["compile/count"] > 0 and rows[0]["time/compile_s"] > 0
    assert all(isinstance(r["compile/count"], int) and r["time/compile_s"] >= 0 for r in rows)
    assert all(0 < r["time/train/host_s"] for r in rows)  # the step's driving thread's CPU time
    a, b = first["compile"], second["compile"]
    assert json.loads((tmp_path / "first" / "summary.json").read_text())["compile"] == a
    assert a["cache_dir"] == str(cache) and any(cache.iterdir())
    assert a["startup"]["count"] >= rows[0]["compile/count"] and a["total"]["count"] >= a["startup"]["count"]
    assert a["startup"]["cache_misses"] > 0 and a["startup"]["cache_hits"] == 0
    assert b["startup"]["cache_hits"] > 0 and b["startup"]["cache_misses"] == 0 == b["total"]["cache_misses"]


@pytest.mark.slow  # a whole run and its resume: 10 s (fast tier budget)
def test_evaluation_pads_awkward_batches_and_matches_unpadded(tmp_path):
    """Any eval.k / batch_size / num_examples on 8 devices (before: an IndivisibleError
    when the prompts did not divide the rollout shards). Greedy completions and scores
    per example do not depend on the batch size; sampled ones (k=4, batches of 3 prompts
    padded to 4) equal an unpadded evaluation of the same batches on one device."""
    import dataclasses

    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from grpo.core.contracts import MeshLayout
    from grpo.engine.evaluation import Evaluator
    from grpo.engine.programs import build_programs

    # Wide initial weights (the quickstart's) make greedy answers depend on the prompt.
    trainer = Trainer(_config(**{"eval.num_examples": 7, "model.random": {
        "preset": "tiny", "overrides": {"initializer_range": 0.125}}}), tmp_path)
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("dp", "fsdp", "tp"))
    on_one = build_programs(trainer.config, mesh=one, layout=MeshLayout(1, 1, 1), graphdef=trainer.graphdef,
                            eos_ids=trainer.policy.eos_ids, pad_id=trainer.policy.pad_id)
    state = trainer.policy_params()
    state_one = jax.device_put(state, NamedSharding(one, PartitionSpec()))

    class Recording:
        """The policy, recording every completion the evaluator decodes (in order)."""

        def __init__(self):
            self.texts: list[str] = []

        def __getattr__(self, name):
            return getattr(trainer.policy, name)

        def decode(self, tokens, mask):
            out = trainer.policy.decode(tokens, mask)
            self.texts += list(out)
            return out

    def evaluate(k: int, batch: int, programs=trainer.programs, state=state):
        """``((prompts, padded) per batch, per-example scores, completions in eval order)``."""
        cfg = trainer.config.model_copy(update={"eval": trainer.config.eval.model_copy(
            update={"k": k, "greedy": k == 1, "batch_size": batch})})
        # One eval sampler per (greedy, k): the programs of each config share them.
        programs = dataclasses.replace(programs, config=cfg)
        policy = Recording()
        ev = Evaluator(cfg, programs, task=trainer.task, task_options=trainer.task_options, policy=policy,
                       render=trainer.render, buckets=trainer.buckets)
        ev.prepare()[1].detokenize = policy.decode  # the eval sampler's texts, recorded
        scores = ev.scores(state)
        assert len(scores.correct) == len(scores.reward) == 7 and len(policy.texts) == 7 * k
        return programs.eval_batch(7), scores, policy.texts

    (_, size), whole, texts = evaluate(1, 7)
    assert size == 8 and len(set(texts)) > 1
    (_, size), thirds, texts_thirds = evaluate(1, 3)  # batches of 3, 3, 1 prompts, each padded to 8
    assert size == 8 and texts_thirds == texts
    np.testing.assert_array_equal(thirds.correct, whole.correct)
    np.testing.assert_array_equal(thirds.reward, whole.reward)
    (real, size), sampled, texts = evaluate(3, 3)  # batches of 3, 3, 1 prompts padded to 8 (24 rows)
    assert (real, size) == (3, 8) and len(set(texts)) > 1 and sampled.correct.max() <= 3
    # 4 prompts x 4 samples: the prompts are replicated for prefill, their samples sharded.
    (real, size), got, texts = evaluate(4, 3)
    (_, size_one), want, texts_one = evaluate(4, 3, on_one, state_one)
    assert (real, size, size_one) == (3, 4, 3)
    assert texts == texts_one and len(set(texts)) > 1
    np.testing.assert_array_equal(got.correct, want.correct)
    np.testing.assert_array_equal(got.reward, want.reward)


def _readme_quickstart(run_dir, steps: int, *overrides: str):
    """``grpo run configs/quickstart.yaml`` shortened (evaluated every 50 steps from step 0,
    no checkpoints, no plot), in a process of its own under the README command's set-up:
    one CPU device and XLA's default compile flags, not this suite's 8 devices and fast
    compiles. Its numerics are then the README's: the first 350 steps' held-out curve is
    the README table's, and its optimised code runs the steps in about 0.7x the CPU time
    of the suite's set-up (97 s against 135 s for 350 steps, measured side by side).
    Returns (eval rows, eval examples, step rows)."""
    from grpo.core.config import select_plugins

    sets = [f"train.steps={steps}", "logging.progress_bar=false", "logging.plot=false", "checkpoint.at_end=false",
            "checkpoint.every_n_steps=0", "eval.every_n_steps=50", *overrides]
    env = dict(os.environ, XLA_FLAGS="")  # the suite's flags out; the compilation cache stays shared
    done = subprocess.run([sys.executable, "-m", "grpo.core.cli", "run", str(ROOT / "configs" / "quickstart.yaml"),
                           "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", sets)
    task = select_plugins(cfg)["task"]
    examples = task.plugin.load(split=cfg.task.eval_split, options=task.options, seed=cfg.train.seed)
    return read_eval(run_dir), examples, read_metrics(run_dir)


@pytest.fixture(scope="module")
def quickstart_350(tmp_path_factory):
    """The shortened quickstart (packed: ``train.packing`` is on by default) as the README
    runs it, once for the tests below: (eval rows, eval examples, step rows)."""
    return _readme_quickstart(tmp_path_factory.mktemp("quickstart_350"), 350)


@pytest.mark.slow
def test_packed_quickstart_equals_unpacked_for_20_steps(quickstart_350, tmp_path):
    """Issue 38's goal: the quickstart packed (its 6-token sequences three to a bin of 18
    tokens) and padded (``train.packing.enabled=false``, one row each) give the same
    rewards and losses within 1e-5 (f32) at each of the first 20 steps. The constant
    learning rate makes the 350-step run's first 20 steps a 20-step run's."""
    packed = quickstart_350[2][:20]
    _, _, padded = _readme_quickstart(tmp_path, 20, "train.packing.enabled=false")
    assert [r["step"] for r in packed] == [r["step"] for r in padded] == list(range(1, 21))
    # 128 sequences a step in about 43 bins, computed on CPU's one shape (issue 50): the
    # widest bins per device, the same every step (one device).
    assert all(r["packing/bins_used"] <= 43 and r["packing/bins"] == r["packing/bins_per_device"]
               * r["packing/micro_batches"] for r in packed), [(r["packing/bins_used"], r["packing/bins"]) for r in packed]
    assert len({r["packing/bins_per_device"] for r in packed}) == 1
    assert not any("packing/efficiency" in r for r in padded)
    for got, want in zip(packed, padded):
        for key in ("reward/mean", "reward/std", "loss", "grad_norm", "entropy", "completion/length_mean"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=f"step {got['step']} {key}")
    assert packed[-1]["reward/mean"] > packed[0]["reward/mean"]  # it learns meanwhile


@pytest.mark.slow
def test_quickstart_learns_held_out_sums(quickstart_350):
    """A shortened quickstart answers sums it never trained on: greedy pass@1 on the
    held-out test prompts goes from 0 to well above what the best constant answer scores
    (the collapse this guards against answers every prompt alike), and its curve is the
    README table's first 350 steps exactly. The curve depends on the set-up's float
    arithmetic (the device count and XLA's compile flags; not the machine since issue 49's
    XLA:CPU set-up, grpo.core.cpu): this run is the README command's (one device, default
    flags), so a change to the numerics updates the README's table
    (python scripts/quickstart_curve.py) or fails here, before CI's 800-step check of the
    README quickstart (python scripts/quickstart_curve.py --check RUN_DIR), which allows
    one held-out prompt of slack for CPUs whose arithmetic is not pinned."""
    rows, examples, _ = quickstart_350
    answers = [ex["answer"] for ex in examples]
    constant = max(answers.count(a) for a in set(answers)) / len(answers)  # best single answer: 3/11
    curve = {r["step"]: r["eval/pass@1"] for r in rows}
    assert sorted(curve) == list(range(0, 351, 50)) and curve[0] == 0.0, curve
    assert curve[350] >= 0.5 and curve[350] >= constant + 0.25, (curve, constant)
    readme = _curve_script().parse_table((ROOT / "README.md").read_text())
    assert {step: round(value, 2) for step, value in curve.items()} == {s: v for s, v in readme.items() if s <= 350}, curve


def _curve_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("quickstart_curve", ROOT / "scripts" / "quickstart_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_curve_table_reads_back_and_check_allows_one_prompt(tmp_path):
    """The table the curve command prints reads back as the curve it was given, and
    ``--check`` allows one held-out prompt of slack a column, not two."""
    script = _curve_script()
    format_table, parse_table = script.format_table, script.parse_table
    curve = {0: 0.0, 50: 0.0, 100: 0.27, 150: 0.36, 200: 0.36, 250: 0.45}
    table = format_table(curve)
    assert table.splitlines()[0].split("|")[2:-1] == [" 0-50 ", " 100  ", " 150-200 ", " 250  "]
    assert parse_table(table) == curve
    # --check: a run's eval.jsonl against a README's table, one held-out prompt of slack.
    import json

    readme = tmp_path / "README.md"
    readme.write_text(f"text\n\n{table}\n")
    run = {0: 0.0, 50: 0.0, 100: 3 / 11, 150: 5 / 11, 200: 4 / 11, 250: 5 / 11}  # 150: one prompt more
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": k, "eval/pass@1": v}) + "\n" for k, v in run.items()))
    assert script.check_run(tmp_path, readme) == []
    run[250] = 7 / 11  # two prompts off the table's 0.45
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": k, "eval/pass@1": v}) + "\n" for k, v in run.items()))
    assert script.check_run(tmp_path, readme) == ["step 250: the README's table says 0.45, the run 0.64"]


@pytest.mark.slow
def test_copy_task_rules_out_a_conditioning_bug(tmp_path):
    """The answer depends only on the prompt and is trivially routed (``"7="`` -> ``"7"``):
    GRPO from a random init must reach near-perfect greedy accuracy on its prompts. If
    the update or the sampler lost the prompt (masks, positions, padding, the cache),
    every prompt would get one answer and accuracy would stay near 1/8."""
    rows, examples, _ = _readme_quickstart(tmp_path, 150, "task.options={operation: copy, chat_template: false}",
                                           "task.eval_split=train", "eval.num_examples=64")
    assert len({ex["question"] for ex in examples[:64]}) == 8
    curve = {r["step"]: r["eval/pass@1"] for r in rows}
    assert curve[0] <= 0.2 and curve[150] >= 0.9, curve


def _cli(*args, env=None, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "grpo.core.cli", *args],
        env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw,
    )


@pytest.mark.slow
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

    from grpo.engine.runs.checkpoint import Checkpointer
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


@pytest.mark.slow
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
    prompt = trainer.render(trainer.collector.prompts.examples[0])
    assert prompt.startswith("<|im_start|>") and "Tom has" in prompt
    summary = trainer.run()
    [row] = read_metrics(tmp_path / "run")
    assert "reward/correct/mean" in row and "reward/format/mean" in row
    assert summary["eval"]["eval/num_prompts"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("family, loss", [("qwen3_untied", "pallas"), ("llama_tied_rope3", "jax")])
def test_one_step_and_export_per_model_family(tmp_path, example_plugin, family, loss):
    """A Qwen3 and a Llama 3 checkpoint written by transformers: sampler, update (each
    loss once, on an untied and a tied head), checkpoint, `grpo export`, and transformers
    reloads the export with our logits."""
    from _model_fixtures import checkpoint

    overrides = {
        "model": {"source": "hf", "path": str(checkpoint(family)), "architecture": family.split("_")[0]},
        "loss.impl": loss, "task": {"name": "length"}, "checkpoint.at_end": True,
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
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from grpo.engine.runs.export import export_run

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


@pytest.mark.slow  # two whole runs of 10 s (fast tier budget)
@pytest.mark.parametrize("dynamic", [False, True], ids=["plain", "dynamic_sampling"])
def test_down_sampling_trains_on_the_max_variance_subset(tmp_path, example_plugin, dynamic):
    """PODS's down-sampling: 4 samples of each prompt rolled out, 2 trained on. From the
    recorded rollouts an independent reference (a brute force over every pair of each
    group) says which rewards the update must see: the update batch's rows are rows of
    their group whose rewards have the largest variance, its advantages are the group
    advantages of the kept rewards, and the logs read the rewards of every sample rolled
    out. With dynamic sampling too, only groups with a reward spread are kept (the flat
    prompts of the `length` task never spread) before their samples are."""
    from itertools import combinations

    p, k, keep = 4, 4, 2
    over = {"task": {"name": "length", "options": {"flat_every": 2}}, "train.steps": 2, "train.prompts_per_step": p,
            "rollout.num_generations": k, "train.down_sampling": {"keep": keep}}
    if dynamic:
        over["train.dynamic_sampling"] = {"enabled": True, "max_rounds": 2}
    trainer = Trainer(_config(**over), tmp_path)
    assert trainer.config.sequences_per_step == p * keep and trainer.config.rollout_sequences_per_step == p * k
    rollouts, batches = [], []  # per step: the update's rows (before packing)
    score, row_batch, generate = trainer.collector._score, trainer.row_batch, trainer.collector.sampler.generate

    def recording_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        rollouts.append(list(jax.device_get((out.tokens, out.mask))))
        return out

    def recording_score(examples, texts, lengths, scores=None):
        totals, per_fn, *flags = score(examples, texts, lengths, scores)  # flags, first failures
        rollouts[-1].append(totals)
        return totals, per_fn, *flags

    def recording_rows(rollout, advantages):
        ub = row_batch(rollout, advantages)
        batches.append(jax.device_get(ub))
        return ub

    trainer.collector._score, trainer.row_batch, trainer.collector.sampler.generate = (
        recording_score, recording_rows, recording_generate)
    trainer.run()
    rows = read_metrics(tmp_path)
    # Issue 52: the metrics glossary, both ways (the degenerate-group count needs the step to
    # track informative groups: with dynamic sampling here).
    assert_glossary(rows, *(["Down-sampling", "Dynamic sampling"] if dynamic else []))
    for row, ub in zip(rows, batches, strict=True):
        # The rounds of this step: the rollout's groups (tokens, masks, rewards) in order.
        rounds = [rollouts.pop(0)] + ([rollouts.pop(0)] if dynamic and row["dynamic_sampling/rounds"] == 2 else [])
        groups = [(t[g * k:(g + 1) * k], m[g * k:(g + 1) * k], r[g * k:(g + 1) * k])
                  for t, m, r in rounds for g in range(p)]
        if dynamic:
            spread = [g for g in groups if g[2].max() > g[2].min()]
            groups = (spread + [g for g in groups if g[2].max() == g[2].min()])[:p]
        else:
            assert len(groups) == p
        kept_all, rolled = [], []
        for g, (tokens, mask, rewards) in enumerate(groups):
            rolled.append(rewards)
            got = slice(g * keep, (g + 1) * keep)
            # Each trained row is a row of its group; its reward is that row's.
            idx = [next(j for j in range(k) if (tokens[j] == t).all() and (mask[j] == m).all())
                   for t, m in zip(ub.tokens[got], ub.mask[got])]
            kept = rewards[idx]
            best = max(np.var(rewards[list(c)]) for c in combinations(range(k), keep))
            np.testing.assert_allclose(np.var(kept), best, atol=1e-9)
            np.testing.assert_array_equal(ub.prompt_tokens[got], np.broadcast_to(ub.prompt_tokens[got][0],
                                                                                  ub.prompt_tokens[got].shape))
            adv = (kept - kept.mean()) / (kept.std() + 1e-4) if kept.max() > kept.min() else np.zeros(keep)
            np.testing.assert_allclose(ub.advantages[got], adv, rtol=1e-5, atol=1e-6)
            kept_all.append(kept)
        assert any(r.max() > r.min() for r in kept_all)  # the step trains on something
        # max_variance of the totals keeps a spread whenever there is one: nothing to count without the filter.
        assert row.get("down_sampling/degenerate_groups", 0.0) == 0.0 and ("advantage/informative_groups" in row) == dynamic
        np.testing.assert_allclose(row["reward/mean"], np.mean(rolled), rtol=1e-6)
        np.testing.assert_allclose(row["down_sampling/kept_reward_mean"], np.mean(kept_all), rtol=1e-6)
    assert not rollouts  # every rollout was accounted for


@pytest.mark.slow  # a whole run and its resume: 10 s (fast tier budget)
def test_dynamic_sampling_trains_only_groups_with_a_reward_spread_and_resumes_bitwise(tmp_path, example_plugin):
    """DAPO's dynamic sampling on the `length` task, whose even prompts score 0.5 whatever
    the completion: every round's rollouts and rewards are recorded, and an independent
    reference says from them which groups the step keeps, how many rounds it makes, and
    the update batch it must build (tokens, masks, advantages). The run has a step that
    refills and one that ends short (filled with equal-reward groups); resumed after step 2 it
    ends bit for bit where the straight run does."""
    p, k, max_rounds = 8, 2, 2
    cfg = _config(**{"task": {"name": "length", "options": {"flat_every": 2}}, "train.steps": 3,
                     "train.dynamic_sampling": {"enabled": True, "max_rounds": max_rounds},
                     "checkpoint.at_end": True})
    trainer = Trainer(cfg, tmp_path / "straight")
    scored, batches = [], []  # per round: (examples, tokens, mask, totals); per step: the update's rows
    score, row_batch, generate = trainer.collector._score, trainer.row_batch, trainer.collector.sampler.generate
    rollouts = []  # per round: the sampler's (tokens, mask); each round is scored right after

    def recording_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        rollouts.append(jax.device_get((out.tokens, out.mask)))
        return out

    def recording_score(examples, texts, lengths, scores=None):
        totals, per_fn, *flags = score(examples, texts, lengths, scores)  # flags, first failures
        tokens, mask = rollouts[len(scored)]
        np.testing.assert_array_equal(lengths, mask.sum(axis=1))
        scored.append((examples, tokens, mask, totals))
        return totals, per_fn, *flags

    def recording_rows(rollout, advantages):
        ub = row_batch(rollout, advantages)
        batches.append(jax.device_get(ub))
        return ub

    trainer.collector._score, trainer.row_batch = recording_score, recording_rows
    trainer.collector.sampler.generate = recording_generate
    trainer.run()
    rows = read_metrics(tmp_path / "straight")
    assert_glossary(rows, "Dynamic sampling")  # issue 52: the metrics glossary, both ways
    scored_copy = list(scored)

    rounds_seen = []
    for step, (row, ub) in enumerate(zip(rows, batches)):
        kept, spare, rounds, generated = [], [], 0, 0
        while len(kept) < p and rounds < max_rounds:  # the reference: rounds until p groups have a spread
            examples, tokens, mask, totals = scored.pop(0)
            for g in range(p):
                group = slice(g * k, (g + 1) * k)
                spread = totals[group].max() > totals[group].min()
                assert not (spread and examples[g * k]["index"] % 2 == 0)  # flat prompts never spread
                (kept if spread and len(kept) < p else spare).append((tokens[group], mask[group], totals[group]))
            rounds, generated = rounds + 1, generated + int(mask.sum())
        filled = p - len(kept)
        picks = kept + spare[:filled]
        assert row["dynamic_sampling/rounds"] == rounds and row["dynamic_sampling/filled_groups"] == filled
        assert row["dynamic_sampling/short"] == float(filled > 0)
        assert row["dynamic_sampling/dropped_groups"] == (rounds - 1) * p
        assert row["dynamic_sampling/uninformative_groups"] == len(spare)
        np.testing.assert_array_equal(ub.tokens, np.concatenate([t for t, _, _ in picks]))
        np.testing.assert_array_equal(ub.mask, np.concatenate([m for _, m, _ in picks]))
        assert row["rollout/generated_tokens"] == generated
        r = np.concatenate([t for _, _, t in picks]).reshape(p, k)
        spread = r.max(1, keepdims=True) > r.min(1, keepdims=True)
        adv = np.where(spread, (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4), 0.0).reshape(-1)
        np.testing.assert_allclose(ub.advantages, adv, rtol=1e-5, atol=1e-6)
        assert (np.abs(ub.advantages.reshape(p, k)).max(1) > 0).sum() == len(kept)  # only informative groups train
        assert row["advantage/informative_groups"] == len(kept)
        rounds_seen.append((rounds, filled))
    assert not scored  # every rollout was accounted for
    assert any(r == 2 and f == 0 for r, f in rounds_seen) and any(f > 0 for _, f in rounds_seen), rounds_seen
    meta = trainer.checkpointer.restore(trainer._state(), 3)[1]
    assert meta["data_position"] == p * sum(r for r, _ in rounds_seen)

    # task.overlong joins the scores as the reward `overlong` (host-side: no compile).
    examples, tokens, _ = scored_copy[0][:3]
    mask = (np.arange(3)[None] < (np.arange(len(examples)) % 4)[:, None]).astype(np.int32)  # lengths 0..3
    texts, lengths = trainer.policy.decode(tokens, mask), mask.sum(1)
    plain, per_fn, *_ = score(examples, texts, lengths)
    trainer.config = trainer.collector.config = load_config(TINY, ["task.overlong={buffer: 2, factor: 0.5}"])
    shaped, per_fn, flags, _ = score(examples, texts, lengths)  # flags: failed, not applicable, scored, timed out
    penalty = np.minimum(-(lengths - (3 - 2)) / 2 * 0.5, 0.0)
    assert penalty.min() == -0.5 and penalty.max() == 0.0
    np.testing.assert_allclose(per_fn["overlong"], penalty, atol=1e-7)
    np.testing.assert_allclose(shaped, plain + penalty, atol=1e-6)
    assert flags.shape == (len(examples), 4, 2) and list(per_fn) == ["length", "overlong"]
    assert (flags[:, :, 1] == [0, 0, 1, 0]).all()  # the penalty never fails, always applies, never times out

    resumed = preempted_and_resumed(cfg, tmp_path / "resumed", after=2)
    assert_same_run(trainer, resumed)


@pytest.fixture(scope="module")
def tools_dynamic_turn_random_top_p(tmp_path_factory):
    """Two steps of the tools quickstart with dynamic sampling, turn credit, PODS
    ``random`` (4 of 8 samples), top-p 0.5 and ``loss.mismatch``; every round's rewards,
    the update batches, the trainer's log-probs and the rows recorded. Scripted so that
    every group's totals are equal (0.5) and only turn credit can tell them apart: each row
    "calls" ``lookup`` after its first token (a turn ends at any token) and answers with
    its next; ``call`` (first turn) is 1 when the first turn's first character is odd, on
    prompts whose index is a multiple of 4 (0 elsewhere), ``prefix`` (every turn) is
    1 - call. Before the one definition, the filter dropped every group (equal totals)
    and the fill trained the ones with a call spread with last-turn advantages of -1/+1."""
    from grpo.core.contracts import EnvStep, ToolCall
    from grpo.engine.rollout.conversations import Conversations
    from grpo.engine.rollout.tools import ToolEnvironment
    from grpo.plugins.tasks import LookupTask

    mp = pytest.MonkeyPatch()

    class Calls(ToolEnvironment):
        def step(self, model_turn_text):
            if getattr(self, "stepped", False):
                return EnvStep(None, True, {})
            self.stepped = True
            return super().step(self.format.render_call(ToolCall("lookup", {"key": self.key})))

    def environment(self, example, *, options, tool_format, timeout_s=10.0):
        env = Calls(tools={"lookup": self._tool(options, int(example.get("seed", 0)))}, format=tool_format,
                    opening=self.prompt_messages(example, options=options), timeout_s=timeout_s)
        env.key = example["key"]
        return env

    def call(completion, example):
        first = [m for m in example["messages"] if m["role"] == "assistant"][0]["content"]
        return float(example["index"] % 4 == 0 and ord(first[:1] or " ") % 2 == 1)

    rewards = {"call": call, "prefix": lambda c, ex: 1.0 - call(c, ex), "correct": lambda c, ex: 0.0,
               "answer": lambda c, ex: 0.0}
    mp.setattr(LookupTask, "environment", environment)
    mp.setattr(LookupTask, "reward_functions", lambda self, *, options: rewards)
    mp.setattr(Conversations, "turn_stop_ids", lambda self: tuple(range(512)))

    p, k, keep = 4, 8, 4
    cfg = load_config(ROOT / "configs" / "quickstart_tools.yaml", [
        "train.steps=2", f"train.prompts_per_step={p}", f"rollout.num_generations={k}",
        f"train.down_sampling={{keep: {keep}, rule: random}}", "train.dynamic_sampling={enabled: true, max_rounds: 2}",
        "train.advantage.credit=turn", "rollout.top_p=0.5", "loss.mismatch.level=token", "eval.every_n_steps=0",
        "checkpoint.at_end=false", "checkpoint.every_n_steps=0", "logging.progress_bar=false", "logging.plot=false",
    ])
    run_dir = tmp_path_factory.mktemp("tools_dynamic")
    trainer = Trainer(cfg, run_dir)
    scored, steps = [], []
    score, update, collect = trainer.collector._score, trainer.update, trainer.collector.collect
    row_batch = trainer.row_batch

    def recording_score(examples, texts, lengths, scores=None):
        totals, per_fn, *flags = score(examples, texts, lengths, scores)  # flags, first failures
        scored.append((totals, per_fn))
        return totals, per_fn, *flags

    def recording_collect(**kw):
        rollout = collect(**kw)
        steps.append({"rounds": len(scored), "output": jax.device_get(rollout.output)})
        return rollout

    def recording_rows(rollout, advantages):  # the update's rows (packed after, by default)
        ub = row_batch(rollout, advantages)
        steps[-1].update(ub=jax.device_get(ub))
        return ub

    def recording_update(params, opt_state, ub, frozen):
        out = update(params, opt_state, ub, frozen)
        steps[-1].update(logprobs=np.asarray(trainer.row_logprobs(out[3], steps[-1]["ub"].tokens.shape)))
        return out

    trainer.collector._score, trainer.collector.collect, trainer.update = recording_score, recording_collect, recording_update
    trainer.row_batch = recording_rows
    try:
        trainer.run()
    finally:
        mp.undo()
    return dict(p=p, k=k, keep=keep, scored=scored, steps=steps, rows=read_metrics(run_dir), config=cfg)


@pytest.mark.slow
def test_dynamic_sampling_with_turn_credit_and_random_down_sampling_trains_every_kept_group(
        tools_dynamic_turn_random_top_p):
    """The one definition of informative across dynamic sampling, turn credit and PODS
    ``random``: the filter keeps exactly the groups whose call has a spread (an independent
    reference from the recorded rewards; their totals are all equal), every kept group
    trains with a non-zero advantage on its trained tokens after down-sampling, the fill
    trains with exactly zero, and the metrics say so."""
    run = tools_dynamic_turn_random_top_p
    p, k, keep = run["p"], run["k"], run["keep"]
    seen, filled_any = 0, False
    for row, step in zip(run["rows"], run["steps"], strict=True):
        rounds = run["scored"][seen:step["rounds"]]
        seen = step["rounds"]
        kept = 0
        for i, (totals, per_fn) in enumerate(rounds):
            assert np.ptp(totals) == 0.0  # every total is 0.5: the old filter kept nothing
            spread = np.ptp(per_fn["call"].reshape(p, k), axis=1) > 0  # the reference's verdicts
            kept += int(spread.sum())
            if i == 0 and spread.sum() >= p:
                assert len(rounds) == 1
        kept = min(kept, p)
        filled = p - kept
        filled_any |= filled > 0
        assert row["dynamic_sampling/rounds"] == len(rounds) and row["dynamic_sampling/filled_groups"] == filled
        assert row["advantage/informative_groups"] == kept and row["down_sampling/degenerate_groups"] == 0
        ub = step["ub"]
        adv, own = np.asarray(ub.advantages), np.asarray(ub.loss_mask)
        assert adv.shape == own.shape  # turn credit: per token
        nonzero = np.abs(adv * own).reshape(p, keep, -1).max(axis=(1, 2)) > 0.5  # +-1 on the last turn
        np.testing.assert_array_equal(nonzero, np.arange(p) < kept)
        np.testing.assert_array_equal(adv.reshape(p, keep, -1)[kept:], 0.0)  # the fill: exactly zero
    assert seen == len(run["scored"]) and filled_any  # a short step happened


@pytest.mark.slow
def test_top_p_behaviour_logprobs_reach_the_mismatch_weights(tools_dynamic_turn_random_top_p):
    """top-p 0.5: the update's ``sampler_logprobs`` are the sampler's behaviour log-probs
    (the truncated nucleus renormalised, above the full-vocabulary ones by minus the log of
    the kept mass), and ``mismatch/weight_mean`` is the mean of min(exp(trainer - behaviour),
    cap) over the trained tokens, by hand; the sampler/trainer gap metric still compares
    the full-vocabulary log-probs (numerics only)."""
    run = tools_dynamic_turn_random_top_p
    cap = run["config"].loss.mismatch.cap
    for row, step in zip(run["rows"], run["steps"], strict=True):
        out, ub, trainer_lp = step["output"], step["ub"], step["logprobs"]
        own = np.asarray(ub.loss_mask) > 0
        np.testing.assert_array_equal(np.asarray(ub.sampler_logprobs), np.asarray(out.behaviour_logprobs))
        behaviour, full = np.asarray(out.behaviour_logprobs)[own], np.asarray(out.logprobs)[own]
        assert np.all(behaviour >= full - 1e-6) and np.mean(behaviour - full) > 0.3
        np.testing.assert_allclose(trainer_lp[own], full, atol=1e-4)  # same policy, same numerics
        want = np.mean(np.minimum(np.exp(trainer_lp[own].astype(np.float64) - behaviour), cap))
        np.testing.assert_allclose(row["mismatch/weight_mean"], want, rtol=1e-4)
        assert want < 0.8  # the kept mass: with the full log-probs the weights would be ~1
        assert row["logprob_gap/sampler_trainer"] < 1e-4


@pytest.mark.slow
def test_one_step_with_the_continuous_engine_and_its_plan(tmp_path):
    """``rollout.engine: continuous``: a step samples through the paged, continuously
    batched sampler (4 slots for 16 rows, so rows queue and refill), the trainer's
    log-probs match the sampler's, evaluation (greedy) runs on it too, and ``grpo plan``
    lists exactly the programs the run
    executed (its start/prefill/decode lower for the TPU topology, the decode with the
    Pallas TPU kernel, and compiles)."""
    from grpo.engine.planning.plan import Planner
    from grpo.engine.rollout.continuous import ContinuousSampler

    # head_dim 128: what the TPU kernel's blocks take, so the plan's decode holds the kernel.
    config = _config(**{"model.random": {"preset": "tiny", "overrides": {"head_dim": 128}},
                        "rollout.engine": "continuous", "rollout.max_new_tokens": 6,
                        "eval": {"every_n_steps": 1, "num_examples": 4, "batch_size": 4},
                        "rollout.continuous": {"slots": 4, "page_size": 4, "chunk": 2, "attention": "auto"}})
    trainer = Trainer(config, tmp_path)
    trainer.run()
    sampler = trainer.programs.sampler()
    assert isinstance(sampler, ContinuousSampler)
    assert sampler.last_stats["prefills"] > 1 and sampler.last_stats["chunks"] >= 3, sampler.last_stats
    [row] = read_metrics(tmp_path)
    assert np.isfinite(row["loss"]) and row["logprob_gap/sampler_trainer"] < 1e-4
    ran = {name for name, fns in trainer.programs.jitted().items() if any(f._cache_size() for f in fns)}
    planner = Planner("v6e-8")
    subject = planner.subject(config)
    listed = {name: lower for name, lower, *_ in planner.programs_to_compile(subject)}
    assert ran == set(listed) and {"start", "prefill", "decode", "eval_start", "eval_decode"} <= ran
    # The plan's engine section under a profile of rows all at the cap (6): 16 rows through
    # 4 slots in 4 waves, each a prefill (step 0) and 5 decode steps = 3 chunks of 2, all
    # 4 slots computed; the static engine decodes 5 steps (one chunk: early_stop_chunk
    # capped at N - 1) of all 16 rows.
    from grpo.engine.planning.plan import engine_report
    from grpo.engine.planning.profiles import LengthProfile
    from grpo.engine.planning.report import format_engine

    en = engine_report(subject, LengthProfile(name="cap", source="test", tokens=np.array([6])))
    assert en["pool_bytes_per_device"] == subject.state["kv_cache"] > 0
    assert (en["chunks"], en["decode_steps"], en["slot_steps"], en["prefills"], en["evictions"]) == (12, 24, 96, 4, 0)
    assert (en["static_decode_steps"], en["static_slot_steps"], en["valid_tokens"]) == (5, 80, 96)
    assert "24 decode steps" in "\n".join(format_engine(en))
    assert en["decode_roofline_no_comm_s"] == en["decode_roofline_s"]  # no compiled decode here: no ICI
    for name in ("start", "prefill"):
        assert listed[name]() is not None, name
    # auto: the plain-JAX reference on CPU, the Pallas TPU kernel in the plan's decode for
    # v6e (run per device under shard_map), which compiles through libtpu.
    decode = listed["decode"]()
    assert "paged_attention" in decode.as_text() and decode.compile() is not None


@pytest.mark.slow
def test_truncated_policy_makes_the_top_p_weights_one(tmp_path):
    """Issue 49 item 5: with top-p 0.9 and loss.mismatch (synchronous, so the ratio's old
    log-probs are the trainer's own), the token weight exp(old - behaviour) is the kept
    mass S < 1 when the trainer's policy is the full-vocabulary one (the old behaviour,
    ``loss.truncated_policy: false``), and 1 within 1e-3 when the trainer's log-probs are
    under the same truncation (``true``): the gradient is no longer shrunk by S. The
    sampler/trainer gap then compares the behaviour log-probs, and no sampled token falls
    outside the trainer's kept set at the same weights. With beta > 0 the reference's
    log-probs are truncated too: at step 1 (reference = policy) the KL is 0, where a
    full-vocabulary reference would put it near S - log S - 1."""
    base = {"rollout.top_p": 0.9, "loss.mismatch": {"level": "token", "mode": "truncate", "cap": 2.0},
            "loss.beta": 0.1}
    rows = {}
    for truncated in (False, True):
        run_dir = tmp_path / str(truncated)
        Trainer(_config(**base, **{"loss.truncated_policy": truncated}), run_dir).run()
        [rows[truncated]] = read_metrics(run_dir)
    old, new = rows[False], rows[True]
    assert_glossary([old, new], "Truncated policy")  # issue 52: the metrics glossary, both ways
    assert old["mismatch/weight_mean"] < 0.99  # S: the old value
    assert "truncated_policy/outside_frac" not in old
    assert abs(new["mismatch/weight_mean"] - 1.0) < 1e-3
    assert new["truncated_policy/outside_frac"] == 0.0
    assert new["logprob_gap/sampler_trainer"] < 1e-4
    assert abs(new["is_ratio/sampler_trainer/mean"] - 1.0) < 1e-3
    assert new["kl"] < 1e-6 and old["kl"] < 1e-6
