"""A run's identity: the fingerprint of the config fields that define what it trains.

Two configs with the same fingerprint train the same run: continuing one's checkpoint
under the other is a resume, not a different experiment. ``--resume`` (and ``--run-dir``
on a directory with a checkpoint) continues only a run of the same fingerprint; the run
directory records it (``identity.json``).

**Every field defines the run except those in** :data:`NOT_IDENTITY` (an exclusion list,
so a field added later counts, and a resume across it is refused rather than silent).
The excluded fields only extend, observe or lay out the same run:

- extend: ``train.steps`` (a longer run of the same config continues it);
- observe: ``eval``, ``checkpoint``, ``logging`` (cadences, W&B), ``task.eval_split``,
  and ``name`` (it picks the directory; the fingerprint decides whether to continue it);
- lay out or execute the same computation: ``distributed`` and ``mesh`` (an Orbax
  checkpoint restores onto another mesh), the rollout's sharding style and decoding engine
  (``rollout.style/options/engine/engine_options/continuous/prompt_buckets/early_stop_chunk/
  kv_segment``: they change which devices and kernels draw from the same distribution),
  the loss implementation (``loss.impl/options``: the same loss, fused or not), activation
  memory and attention kernels (``model.remat/attention/attention_options``), exact
  gradient accumulation and packing (``train.micro_batch_size``, ``train.packing``), when and
  where the programs compile (``train.compile``), and the async device split (``train.async.rollout_devices``).

Everything else defines the run: the model (source, path, architecture, tokenizer, random
preset and overrides, dtypes, LoRA), the task (name, options, data files, train split,
overlong shaping), the seed, the batch (``train.prompts_per_step``, ``ppo_epochs``), the
algorithm (``loss`` but its implementation: clip, beta, aggregation, objective, mismatch
correction; ``train.optimizer``, ``advantage``, dynamic and down-sampling, ``async`` but
its device split) and rollout sampling (``num_generations``, length caps, temperature,
top-k/top-p, turns and tool timeout).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

NOT_IDENTITY: tuple[str, ...] = (
    "name",
    "train.steps",
    "eval",
    "checkpoint",
    "logging",
    "task.eval_split",
    "distributed",
    "mesh",
    "rollout.style",
    "rollout.options",
    "rollout.engine",
    "rollout.engine_options",
    "rollout.continuous",
    "rollout.prompt_buckets",
    "rollout.early_stop_chunk",
    "rollout.kv_segment",
    "loss.impl",
    "loss.options",
    "model.remat",
    "model.attention",
    "model.attention_options",
    "train.micro_batch_size",
    "train.packing",
    "train.compile",
    "train.async.rollout_devices",
)
"""Dotted paths (of the config as YAML spells it) that do not define a run; everything
under a listed section is excluded with it."""


def _excluded(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in NOT_IDENTITY)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and empty mappings are leaves."""
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data}


def _as_dict(config: Any) -> dict[str, Any]:
    if hasattr(config, "model_dump"):
        return config.model_dump(mode="json")
    return json.loads(json.dumps(config))


def identity_fields(config: Any) -> dict[str, Any]:
    """The flattened fields of ``config`` (a RunConfig or its dumped dict) that define the run."""
    return {k: v for k, v in flatten(_as_dict(config)).items() if not _excluded(k)}


def fingerprint(config: Any) -> str:
    """16 hex digits of a SHA-256 over :func:`identity_fields` (canonical JSON)."""
    text = json.dumps(identity_fields(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_MISSING = object()


def differences(old: Any, new: Any, *, identity: bool | None = True) -> list[tuple[str, Any, Any]]:
    """``(path, old value, new value)`` for each flattened field that differs, sorted by
    path: identity fields (``identity=True``), the others (``False``) or all (``None``).
    A field only one side has shows the other side as ``"<unset>"``."""
    a, b = flatten(_as_dict(old)), flatten(_as_dict(new))
    out = []
    for key in sorted(set(a) | set(b)):
        if identity is not None and _excluded(key) == identity:
            continue
        x, y = a.get(key, _MISSING), b.get(key, _MISSING)
        if x != y:
            out.append((key, "<unset>" if x is _MISSING else x, "<unset>" if y is _MISSING else y))
    return out


def describe(diffs: list[tuple[str, Any, Any]], *, limit: int = 8) -> str:
    """``"model.random.preset ('tiny' -> 'small'), train.seed (0 -> 1)"``, at most ``limit``."""
    parts = [f"{k} ({_short(x)} -> {_short(y)})" for k, x, y in diffs[:limit]]
    if len(diffs) > limit:
        parts.append(f"and {len(diffs) - limit} more")
    return ", ".join(parts)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["NOT_IDENTITY", "describe", "differences", "fingerprint", "flatten", "identity_fields"]
