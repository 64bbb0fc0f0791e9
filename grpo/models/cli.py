"""``grpo model ...``: look at checkpoints without loading them onto devices."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click


@click.group()
def model() -> None:
    """Model checkpoints and presets: inspect."""


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or prefix == "T":
            return f"{n:.0f} {prefix}{unit}" if prefix == "" else f"{n:.2f} {prefix}{unit}"
        n /= 1000
    return f"{n} {unit}"  # pragma: no cover


def _count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def _config_summary(cfg: Any) -> dict[str, Any]:
    return {
        "family": cfg.family,
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "attention_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tied_embeddings": cfg.tie_word_embeddings,
        "rope_scaling": {"rope_type": "llama3", **dict(cfg.rope_scaling)} if getattr(cfg, "rope_scaling", ()) else None,
        "moe": _moe_summary(cfg),
    }


def _moe_summary(cfg: Any) -> dict[str, Any] | None:
    """The experts of a mixture-of-experts family (None for a dense one)."""
    if not getattr(cfg, "num_experts", 0):
        return None
    return {
        "experts": cfg.num_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "expert_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "active_parameters": cfg.active_params(),
    }


def attention_by_platform(attention: str = "auto") -> dict[str, str]:
    """platform -> the attention kernel ``model.attention=attention`` runs there (whole
    sequences; decode is always XLA), or why it cannot run."""
    from grpo.core.config import ModelConfig, attention_plugin
    from grpo.core.errors import UserError

    model = ModelConfig(source="random", attention=attention)
    out = {}
    for platform in ("tpu", "gpu", "cpu"):
        try:
            name, plugin, _ = attention_plugin(model, platform)
            out[platform] = name + (" (interpreted)" if platform in plugin.interpret_platforms else "")
        except UserError as err:
            out[platform] = "refused: " + "; ".join(getattr(err, "problems", []) or [str(err)])
    return out


def inspect_report(path: str, *, architecture: str = "auto", attention: str = "auto") -> dict[str, Any]:
    """What ``grpo model inspect`` prints, as a dict (a preset name, directory or hub id).
    ``architecture``: ``auto`` or the model plugin that must handle the checkpoint;
    ``attention``: ``model.attention``, reported per platform."""
    report = _inspect(path, architecture=architecture)
    report["attention"] = attention_by_platform(attention)
    return report


def _inspect(path: str, *, architecture: str) -> dict[str, Any]:
    from grpo.models.presets import PRESETS, preset_config

    if path in PRESETS and not Path(path).exists():
        cfg = preset_config(path)
        if architecture not in ("auto", cfg.family):
            from grpo.core.errors import UserError

            raise UserError(
                f"--architecture {architecture} but preset {path!r} is a {cfg.family} model; "
                f"use --architecture {cfg.family} or auto."
            )
        n = cfg.num_params()
        return {
            "source": f"preset {path}",
            "architecture": cfg.hf_architecture,
            "config": _config_summary(cfg),
            "parameters": n,
            "bytes_by_dtype": {"float32": 4 * n, "bfloat16": 2 * n},
            "kv_cache_bytes_per_token_bf16": cfg.kv_bytes_per_token(),
            "files": [],
            "problems": [],
        }
    from grpo.models.hf import check_tensors
    from grpo.models.loading import SafetensorsCheckpoint, read_family, resolve_checkpoint

    directory = resolve_checkpoint(path)
    plugin, cfg = read_family(directory, architecture=architecture)
    with SafetensorsCheckpoint(directory) as ckpt:
        problems = check_tensors(cfg, ckpt.tensors, plugin.tensor_maps(cfg))
        names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
        by_dtype = {names.get(k, k): v for k, v in sorted(ckpt.nbytes_by_dtype().items())}
        files = sorted(set(ckpt.file_of.values()))
        stored = sum(math.prod(shape) for shape, _ in ckpt.tensors.values())
    return {
        "source": str(directory),
        "architecture": getattr(cfg, "hf_architecture", plugin.name),
        "config": _config_summary(cfg),
        "parameters": cfg.num_params(),
        "stored_parameters": stored,
        "bytes_by_dtype": by_dtype,
        "kv_cache_bytes_per_token_bf16": cfg.kv_bytes_per_token(),
        "files": files,
        "problems": problems,
    }


@model.command("inspect")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--architecture", default="auto", show_default=True,
              help="Model plugin that must handle PATH (as model.architecture in a config).")
@click.option("--attention", default="auto", show_default=True,
              help="model.attention to report per platform (whole-sequence attention; decode is XLA).")
def inspect_cmd(path: str, as_json: bool, architecture: str, attention: str) -> None:
    """Parameter count, bytes per dtype, config summary and tying of PATH.

    PATH is a Hugging Face model directory, a hub id, or a preset name (e.g.
    qwen2.5-3b, qwen3-1.7b, llama-3.2-1b). Only headers are read; exits 2 when the
    checkpoint would not load.
    """
    from grpo.models.loading import CheckpointError

    report = inspect_report(path, architecture=architecture, attention=attention)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        c = report["config"]
        click.echo(f"source:       {report['source']}")
        click.echo(f"architecture: {report['architecture']} (model plugin {c['family']})")
        click.echo(
            f"layers {c['layers']}, hidden {c['hidden_size']}, mlp {c['intermediate_size']}, heads "
            f"{c['attention_heads']} (kv {c['kv_heads']}, head_dim {c['head_dim']}), vocab {c['vocab_size']}"
        )
        click.echo(
            f"rope_theta {c['rope_theta']:g}, rms_norm_eps {c['rms_norm_eps']:g}, "
            f"max_position_embeddings {c['max_position_embeddings']}"
        )
        click.echo(f"tied embeddings: {'yes' if c['tied_embeddings'] else 'no'}")
        if c["rope_scaling"]:
            click.echo(f"rope scaling: {c['rope_scaling']}")
        if c["moe"]:
            m = c["moe"]
            click.echo(
                f"experts:      {m['experts']}, {m['experts_per_token']} per token (width "
                f"{m['expert_intermediate_size']}, norm_topk_prob {str(m['norm_topk_prob']).lower()}); active "
                f"parameters {m['active_parameters']:,} ({_count(m['active_parameters'])})"
            )
        click.echo(f"parameters:   {report['parameters']:,} ({_count(report['parameters'])})")
        if "stored_parameters" in report and report["stored_parameters"] != report["parameters"]:
            click.echo(f"stored:       {report['stored_parameters']:,} (tensors in the files)")
        for dtype, nbytes in report["bytes_by_dtype"].items():
            label = "bytes" if report["files"] else "bytes if"
            click.echo(f"{label} {dtype}: {nbytes:,} ({_human(nbytes)})")
        click.echo(f"KV cache:     {report['kv_cache_bytes_per_token_bf16']:,} bytes/token (bfloat16)")
        click.echo("attention:    " + ", ".join(f"{p} {k}" for p, k in report["attention"].items()))
        if report["files"]:
            click.echo(f"files:        {', '.join(report['files'])}")
    if report["problems"]:
        raise CheckpointError(f"{report['source']} would not load:", problems=report["problems"])
