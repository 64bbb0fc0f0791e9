"""Shared helpers for the model tests: tiny checkpoints, jitted forwards, HF references.

Checkpoints are written once per session into a temporary directory (functools caches,
so every test module shares them); jitted functions live at module level so each
(model structure, shape, sharding) compiles once for the whole session.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from grpo.core.contracts import MESH_AXES
from grpo.models.decoder import positions_from_mask
from grpo.models.tiny import write_tiny_checkpoint

_ROOT = Path(tempfile.mkdtemp(prefix="grpo-model-tests-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)

# name -> write_tiny_checkpoint kwargs. Each differs from the others where a bug could
# hide: untied head, rope_theta and rms_norm_eps from the config, more layers, MQA with
# a head_dim that is not hidden/heads.
CHECKPOINTS: dict[str, dict] = {
    "tied": dict(tied=True, seed=0),
    "untied": dict(tied=False, seed=1, rope_theta=1_000_000.0, rms_norm_eps=1e-5, num_hidden_layers=3),
    "mqa": dict(tied=True, seed=2, num_key_value_heads=1, head_dim=8),
    "tied_sharded": dict(tied=True, seed=0, num_shards=3),
    "tied_bf16": dict(tied=True, seed=0, dtype="bfloat16"),
}


@functools.cache
def checkpoint(name: str) -> Path:
    if name in FAMILY_CHECKPOINTS or name in MOE_CHECKPOINTS:
        return family_checkpoint(name)
    return write_tiny_checkpoint(_ROOT / name, **CHECKPOINTS[name])


# name -> (transformers config class, its kwargs). Built by transformers itself and saved
# with save_pretrained, so the HF side (names, layouts, config.json) is transformers' own.
# Sizes are deliberately odd: head_dim unrelated to hidden/heads, MQA and GQA, 2 and 3
# layers, a vocabulary of 320 (the tiny tokenizer has 319 tokens); hidden 48 divides over fsdp=8 so sharded loads really shard.
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                # wavelengths of head_dim 16 at theta 5e5 then fall in all three llama3 bands
                "original_max_position_embeddings": 256}
_COMMON = dict(vocab_size=320, hidden_size=48, bos_token_id=306, eos_token_id=308, pad_token_id=306)
FAMILY_CHECKPOINTS: dict[str, tuple[str, dict]] = {
    "qwen3_tied": ("Qwen3Config", dict(
        _COMMON, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=10, tie_word_embeddings=True, rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=512)),
    "qwen3_untied": ("Qwen3Config", dict(
        _COMMON, intermediate_size=72, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
        head_dim=12, tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
        max_position_embeddings=512)),
    "llama_untied": ("LlamaConfig", dict(
        _COMMON, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        tie_word_embeddings=False, rope_theta=500_000.0, rms_norm_eps=1e-5, max_position_embeddings=512)),
    "llama_tied_rope3": ("LlamaConfig", dict(
        _COMMON, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, tie_word_embeddings=True, rope_theta=500_000.0, rms_norm_eps=1e-5,
        max_position_embeddings=2048, rope_scaling=_LLAMA3_ROPE)),
}

# Qwen3-MoE (issue 54): 8 experts, top-2, with and without norm_topk_prob; untied and tied.
MOE_CHECKPOINTS: dict[str, tuple[str, dict]] = {
    "qwen3moe_untied": ("Qwen3MoeConfig", dict(
        _COMMON, intermediate_size=64, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
        tie_word_embeddings=False, rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=512)),
    "qwen3moe_tied_raw": ("Qwen3MoeConfig", dict(
        _COMMON, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, head_dim=12,
        tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-5, max_position_embeddings=512)),
}


@functools.cache
def family_checkpoint(name: str) -> Path:
    """A random checkpoint of ``FAMILY_CHECKPOINTS[name]`` written by transformers, with
    the tiny tokenizer beside it (a complete model directory)."""
    import torch
    import transformers

    from grpo.models.tiny import write_tiny_tokenizer

    cls_name, kwargs = {**FAMILY_CHECKPOINTS, **MOE_CHECKPOINTS}[name]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):  # not all ones, so a mixed-up norm shows
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:  # O(1) activations and logits (transformers' 0.02 init gives ~0 logits)
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    out = _ROOT / name
    model.save_pretrained(out)
    write_tiny_tokenizer(out)
    return out


def scratch_dir(name: str) -> Path:
    path = _ROOT / "scratch" / name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def mesh(dp: int = 1, fsdp: int = 1, tp: int = 1) -> Mesh:
    n = dp * fsdp * tp
    return Mesh(np.array(jax.devices()[:n], dtype=object).reshape(dp, fsdp, tp), MESH_AXES)


def padded_batch(vocab: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[4, 9] tokens and mask: full row, left-padded, right-padded, both."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (4, 9)).astype(np.int32)
    mask = np.ones((4, 9), bool)
    mask[1, :3] = False
    mask[2, 6:] = False
    mask[3, :2] = False
    mask[3, 7:] = False
    tokens[~mask] = 306  # pad id; must not matter
    return tokens, mask


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, tokens, positions, mask):
    model = nnx.merge(graphdef, state)
    hidden, _ = model(tokens, positions, mask)
    return model.logits(hidden)


def logits_of(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    graphdef, state = nnx.split(model)
    positions = positions_from_mask(jnp.asarray(mask))
    return np.asarray(_logits(graphdef, state, jnp.asarray(tokens), positions, jnp.asarray(mask)))


@functools.cache
def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(path: str | Path, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' logits of the checkpoint at ``path`` (its own causal-LM class,
    PyTorch, CPU, float32)."""
    return torch_logits(_hf_model(str(path)), tokens, mask)


def torch_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Float32 logits of a PyTorch causal LM (transformers' or a PEFT wrapper) on a
    padded batch, with grpo's positions (the first real token of each row at 0)."""
    import torch

    positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


@functools.partial(jax.jit, static_argnums=0)
def _packed_hidden(graphdef, state, tokens, positions, segment_ids):
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, segment_ids=segment_ids)[0]


def packed_vs_alone(model, lengths=(5, 7, 4, 3), bin_length=12, vocab: int = 300, seed: int = 0) -> float:
    """The largest |difference| between the hidden states of sequences packed into bins
    (first-fit, segment ids, per-segment positions) and each sequence run alone (no
    padding at all: the reference that cannot see another sequence)."""
    from grpo.engine.training.packing import plan_packing

    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]
    plan = plan_packing(np.array(lengths), bin_length=bin_length)
    tokens = np.zeros(plan.row.shape, np.int32)
    for b, t in zip(*np.nonzero(plan.segment_ids)):
        tokens[b, t] = seqs[plan.row[b, t]][plan.index[b, t]]
    graphdef, state = nnx.split(model)
    packed = np.asarray(_packed_hidden(graphdef, state, jnp.asarray(tokens), jnp.asarray(plan.positions),
                                       jnp.asarray(plan.segment_ids)))
    worst = 0.0
    for r, seq in enumerate(seqs):
        alone = np.asarray(model(jnp.asarray(seq)[None], jnp.arange(len(seq), dtype=jnp.int32)[None])[0])[0]
        b, t = np.nonzero((plan.row == r) & (plan.segment_ids > 0))
        worst = max(worst, float(np.abs(packed[b, t] - alone).max()))
    assert len(plan.row) < len(lengths)  # really packed: some bin holds two sequences
    return worst


def engine_parts(directory: Path, sampling: Any, *, fsdp: int = 2) -> tuple[Any, Any, dict]:
    """A tiny checkpoint loaded on a (1, fsdp, 1) mesh of the first devices, as rollout
    engines take it: ``(graphdef, params, engine kwargs)`` (mesh, the legacy style's batch
    axes, ``sampling``)."""
    from grpo.core.contracts import MeshLayout, NoOptions
    from grpo.engine.parallel.mesh import build_mesh
    from grpo.models.loading import load_hf
    from grpo.plugins.rollout import LegacyStyle

    layout = MeshLayout(dp=1, fsdp=fsdp, tp=1)
    on = build_mesh(layout, devices=jax.devices()[:fsdp])
    graphdef, params = nnx.split(load_hf(directory, on))
    return graphdef, params, dict(mesh=on, batch_axes=LegacyStyle().batch_axes(layout, NoOptions()), sampling=sampling)


def left_padded(lengths: np.ndarray, width: int, *, seed: int, pad: int = 306) -> tuple[np.ndarray, np.ndarray]:
    """Random prompts of ``lengths`` real tokens, left-padded with ``pad`` to ``width``."""
    rs = np.random.default_rng(seed)
    mask = (np.arange(width)[None, :] >= width - np.asarray(lengths)[:, None]).astype(np.int32)
    tokens = np.where(mask == 1, rs.integers(0, 256, size=mask.shape), pad).astype(np.int32)
    return tokens, mask
