"""Exporting LoRA and QLoRA models, checked against PEFT and transformers.

The references are independent of grpo's forward: ``peft.PeftModel`` applies our
``adapter_model.safetensors`` to transformers' own model of the base checkpoint, and
transformers loads the merged export. The checkpoint is a Qwen3 written by transformers
(GQA 6/3 heads, head_dim 12, so ``o_proj`` is 72 -> 48 and q/k/v are 48 -> 72/36; q/k
norms; untied head), where a mix-up of the adapters' head flattening or of ``A``/``B``
could not cancel out. Adapters get random non-zero ``A`` *and* ``B`` (the trained state;
at init ``B = 0`` would hide a transposed or misplaced ``B``).
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from flax import nnx

from _model_fixtures import checkpoint, hf_logits, logits_of, padded_batch, scratch_dir, torch_logits
from grpo.core.config import LoraConfig, load_config
from grpo.models.loading import load_hf, save_hf
from grpo.models.lora import PROJECTIONS, apply_lora, merge_params, merged_params, save_peft, split_params

FAMILY = "qwen3_untied"
ATOL = 1e-4


def _randomize_adapters(model, seed: int, scale: float = 0.2):
    """``model`` with every adapter matrix (A and B) replaced by ``scale * N(0, 1)``; the base untouched."""
    graphdef, state = nnx.split(model)
    adapters, base = split_params(state)
    leaves, treedef = jax.tree.flatten(adapters)
    rng = np.random.default_rng(seed)  # NumPy: no random-number kernel to compile per shape
    # In the adapters' own shardings, so the forward compiled for the step-0 model is reused.
    new = [jax.device_put((scale * rng.standard_normal(x.shape)).astype(x.dtype), x.sharding) for x in leaves]
    return nnx.merge(graphdef, merge_params(jax.tree.unflatten(treedef, new), base))


def _lora_model(**lora):
    model = load_hf(checkpoint(FAMILY))
    return apply_lora(model, LoraConfig(rank=4, alpha=8, targets=["all-linear"], **lora))


def _peft_logits(base_dir, adapter_dir, tokens, mask) -> np.ndarray:
    """PEFT's logits: transformers' base model with the adapter directory applied (float32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo.core.errors import require

    peft = require("peft", purpose="The LoRA export tests (PEFT is their reference)", install='pip install -e ".[dev]"')

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    return torch_logits(model, tokens, mask)


def _maxdiff(a, b, mask) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b))[mask].max())


# ------------------------------------------------------------------ save_peft / save_hf


@pytest.fixture(scope="module")
def adapted():
    """(model with random adapters, its logits, the step-0 model's logits) on the padded batch."""
    tokens, mask = padded_batch()
    model = _lora_model()
    at_init = logits_of(model, tokens, mask)
    model = _randomize_adapters(model, seed=1)
    return model, logits_of(model, tokens, mask), at_init


@pytest.fixture(scope="module")
def peft_dir(adapted):
    return save_peft(adapted[0], scratch_dir("lora_export_peft"), base_model=str(checkpoint(FAMILY)))


def test_step0_adapters_leave_the_base_model(adapted):
    tokens, mask = padded_batch()
    _, _, at_init = adapted
    assert _maxdiff(at_init, hf_logits(checkpoint(FAMILY), tokens, mask), mask) < ATOL


def test_peft_round_trip(adapted, peft_dir):
    model, ours, at_init = adapted
    tokens, mask = padded_batch()
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(checkpoint(FAMILY))
    assert (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"])) == (4, 8.0, sorted(PROJECTIONS))
    assert _maxdiff(ours, at_init, mask) > 0.1  # the adapters really change the model
    ref = _peft_logits(cfg["base_model_name_or_path"], peft_dir, tokens, mask)
    assert _maxdiff(ours, ref, mask) < ATOL


def test_merged_export_matches_peft(adapted, peft_dir):
    model, ours, _ = adapted
    tokens, mask = padded_batch()
    out = save_hf(model, scratch_dir("lora_export_merged"))
    merged = hf_logits(out, tokens, mask)
    assert _maxdiff(merged, _peft_logits(checkpoint(FAMILY), peft_dir, tokens, mask), mask) < ATOL
    assert _maxdiff(merged, ours, mask) < ATOL
    # The merged directory is a plain model: no adapters, the base's tensor names.
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "np") as f, safe_open(
        str(checkpoint(FAMILY) / "model.safetensors"), "np"
    ) as g:
        assert set(f.keys()) == set(g.keys())


# ------------------------------------------------------------------ QLoRA


def test_qlora_merged_export_is_dequantized_base_plus_delta():
    """nf4 base: the export is dequant(codes, scales) + (alpha / r) A @ B, not the original
    float base + delta; transformers loads it and agrees with our quantized forward."""
    from grpo.models.quant import dequantize, max_error

    tokens, mask = padded_batch()
    original = {n: np.asarray(getattr(load_hf(checkpoint(FAMILY)).layers, n)[...]) for n in PROJECTIONS}
    model = _randomize_adapters(_lora_model(base_quantization="nf4", quantization_block=16), seed=2)
    assert getattr(model.layers, "q_proj")[...].dtype == jnp.uint4
    out = save_hf(model, scratch_dir("qlora_export_merged"))
    exported = load_hf(out)  # our loader reads the export back in our layout
    merged = merged_params(model)
    scale = 8 / 4
    for name in PROJECTIONS:
        codes, scales = getattr(model.layers, name)[...], getattr(model.layers, f"{name}_scale")[...]
        base = np.asarray(dequantize(codes, scales, "nf4", jnp.float32, axis=1))
        # Really quantized: within the format's bound of the float base, but not equal to it.
        absmax = np.abs(original[name]).max()
        assert 0 < np.abs(base - original[name]).max() <= max_error("nf4") * absmax + 1e-6, name
        a = np.asarray(getattr(model.lora, f"{name}_a")[...], np.float64)
        b = np.asarray(getattr(model.lora, f"{name}_b")[...], np.float64)
        L, r = a.shape[0], a.shape[-1]
        delta = scale * np.einsum("lir,lro->lio", a.reshape(L, -1, r), b.reshape(L, r, -1))
        expected = base + delta.reshape(base.shape)
        np.testing.assert_allclose(np.asarray(merged[f"layers.{name}"]), expected, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(getattr(exported.layers, name)[...]), expected, atol=1e-5,
                                   err_msg=name)
    ours = logits_of(model, tokens, mask)
    assert _maxdiff(hf_logits(out, tokens, mask), ours, mask) < ATOL


# ------------------------------------------------------------------ a run, then `grpo export`


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, example_plugin_dir):
    """A two-step LoRA run from the HF checkpoint (the `length` task gives a random policy
    non-zero advantages, so both A and B train), checkpointed at the end."""
    from _runs import TINY
    from conftest import _on_path
    from grpo.engine.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("lora_run")
    plugin = _on_path(example_plugin_dir, ("grpo_example_plugin",))
    next(plugin)
    try:
        cfg = load_config(TINY, [
            "model.source=hf", f"model.path={checkpoint(FAMILY)}",
            "model.lora={rank: 4, alpha: 8, targets: [all-linear]}",
            "task={name: length}", "train.steps=2", "train.optimizer.learning_rate=0.02",
            "checkpoint.at_end=true",
        ])
        trainer = Trainer(cfg, run_dir)
        initial = jax.tree.map(np.asarray, trainer.params)
        trainer.run()
    finally:
        plugin.close()
    model = nnx.merge(trainer.graphdef, trainer.policy_params())
    tokens, mask = padded_batch()
    return run_dir, trainer, initial, logits_of(model, tokens, mask)


def _grpo(*args):
    from grpo.core.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.slow  # a whole LoRA run (its module fixture) for the export commands
def test_run_checkpoint_holds_only_the_adapters(lora_run):
    import orbax.checkpoint as ocp

    run_dir, trainer, initial, _ = lora_run
    meta = ocp.StandardCheckpointer().metadata(run_dir / "checkpoints" / "2" / "params").item_metadata
    paths = {".".join(str(k.key) for k in path[:-1]) for path, _ in jax.tree_util.tree_flatten_with_path(meta)[0]}
    assert paths == {f"lora.{n}_{m}" for n in PROJECTIONS for m in "ab"}
    # Both adapter halves trained: B left zero, and A moved in the second step.
    for name in PROJECTIONS:
        assert not initial["lora"][f"{name}_b"][...].any(), name
        assert np.abs(np.asarray(trainer.params["lora"][f"{name}_b"][...])).max() > 0, name
        trained_a = np.asarray(trainer.params["lora"][f"{name}_a"][...])
        assert not np.allclose(trained_a, initial["lora"][f"{name}_a"][...]), name


@pytest.mark.slow  # a whole LoRA run (its module fixture) for the export commands
def test_cli_export_adapter_and_merged(lora_run, tmp_path, example_plugin):
    run_dir, _, _, ours = lora_run
    tokens, mask = padded_batch()
    result = _grpo("export", run_dir, tmp_path / "adapter", "--adapter")
    assert result.exit_code == 0, result.output
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(checkpoint(FAMILY))
    adapter = _peft_logits(cfg["base_model_name_or_path"], tmp_path / "adapter", tokens, mask)
    assert _maxdiff(adapter, ours, mask) < ATOL
    assert _maxdiff(adapter, hf_logits(checkpoint(FAMILY), tokens, mask), mask) > 1e-3  # the trained adapters

    result = _grpo("export", run_dir, tmp_path / "merged")
    assert result.exit_code == 0, result.output
    assert _maxdiff(hf_logits(tmp_path / "merged", tokens, mask), ours, mask) < ATOL
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


@pytest.mark.slow  # a whole LoRA run (its module fixture) for the export commands
def test_cli_adapter_export_of_a_full_fine_tuning_run_is_a_user_error(lora_run, tmp_path, example_plugin):
    run_dir, _, _, _ = lora_run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["model"]["lora"] = None
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")
    result = _grpo("export", tmp_path, tmp_path / "out", "--adapter")
    assert result.exit_code == 2
    text = result.output.strip()
    assert "full fine-tuning run" in text and "without --adapter" in text
    assert "Traceback" not in text and len(text.splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a whole LoRA run (its module fixture) for the export commands
def test_cli_adapter_export_writes_a_relative_base_path_absolute(lora_run, tmp_path, example_plugin, monkeypatch):
    """model.path relative to where `grpo run` started: adapter_config.json names the base
    by its absolute path, so the adapter directory loads from anywhere."""
    run_dir = lora_run[0]
    base = checkpoint(FAMILY)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["model"]["path"] = base.name
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    shutil.copytree(run_dir / "checkpoints", tmp_path / "run" / "checkpoints")
    monkeypatch.chdir(base.parent)
    result = _grpo("export", tmp_path / "run", tmp_path / "adapter", "--adapter")
    assert result.exit_code == 0, result.output
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base.resolve())
