"""Completion-length profiles: what ``grpo plan --lengths`` and ``grpo bench update
--lengths`` pack.

A step's cost depends on how long its completions are, not on the length cap alone: the
update, the reference and log-prob passes run on packed bins, and the bins a step needs
follow from its rows' real lengths. A profile is a pool of such lengths; a step's rows
are drawn from it (:func:`draw`) with a fixed seed, so a plan is repeatable.

Sources (``--lengths``):

- a built-in name (:data:`BUILTIN`), stated as fractions of the length cap and scaled to
  the config's ``rollout.max_new_tokens``;
- a text file with one completion length (tokens) a line (blank lines and ``#`` comments
  ignored);
- a run's ``samples.jsonl`` (each step's first group): its rows'
  ``completion_lengths`` and ``prompt_length``, so the prompts' real lengths come with it.

Lengths above the config's cap are clipped to it (those rows were truncated at the cap).
Without measured prompt lengths (a built-in profile, a file of integers) every prompt is
taken at the config's prompt length (``rollout.max_prompt_length``, as the rollout pads
it): an upper bound, so the packed figures are on the safe side.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from statistics import NormalDist
from typing import Any

import numpy as np

from grpo.core.errors import UserError

# The replaced system's own run, Qwen2.5-3B-Instruct GRPO on GSM8K on a TPU v6e-8 (128
# sequences per step, length cap 1,024): 2,293 valid tokens/s at 15.11 s/step, i.e.
# 2293 * 15.11 / 128 = 270.7 valid (trained) tokens per sequence, 26% of the cap, with a
# long tail and some rows truncated at the cap. Its per-row lengths were not published:
# the profile is a lognormal of lengths (as fractions of the cap) clipped at the cap,
# with its two parameters fixed by that mean and by 3% of the rows at the cap.
GSM8K_MEAN_FRACTION = 2293 * 15.11 / 128 / 1024  # 0.2643
GSM8K_AT_CAP = 0.03
_POOL = 4096  # quantile points of a built-in profile


def _clipped_lognormal_mean(*, mu: float, sigma: float) -> float:
    """E[min(X, 1)] for X = exp(mu + sigma Z): the mean fraction of the cap."""
    z = -mu / sigma  # the standard-normal point where X = 1
    n = NormalDist()
    return math.exp(mu + sigma * sigma / 2) * n.cdf(z - sigma) + (1.0 - n.cdf(z))


def clipped_lognormal(*, mean: float, at_cap: float) -> tuple[float, float]:
    """``(mu, sigma)`` of the lognormal whose clipped mean is ``mean`` (fraction of the
    cap) with ``at_cap`` of its mass at or above the cap (so ``mu = -z sigma``, ``z`` the
    ``1 - at_cap`` normal quantile). The clipped mean falls as sigma grows (the median
    ``exp(mu)`` falls): bisection."""
    z = NormalDist().inv_cdf(1.0 - at_cap)
    lo, hi = 1e-3, 10.0
    for _ in range(200):
        sigma = (lo + hi) / 2
        if _clipped_lognormal_mean(mu=-z * sigma, sigma=sigma) > mean:
            lo = sigma
        else:
            hi = sigma
    sigma = (lo + hi) / 2
    return -z * sigma, sigma


def _gsm8k_fractions() -> np.ndarray:
    """The built-in GSM8K profile: :data:`_POOL` quantile midpoints of the clipped
    lognormal, as fractions of the cap (deterministic, no random numbers)."""
    mu, sigma = clipped_lognormal(mean=GSM8K_MEAN_FRACTION, at_cap=GSM8K_AT_CAP)
    n = NormalDist()
    q = [(i + 0.5) / _POOL for i in range(_POOL)]
    return np.minimum(1.0, np.exp([mu + sigma * n.inv_cdf(u) for u in q]))


BUILTIN: dict[str, str] = {
    "gsm8k-qwen25-3b-v6e8": (
        "Qwen2.5-3B-Instruct GRPO on GSM8K, measured by the replaced system on a TPU v6e-8 "
        "(128 sequences per step, cap 1,024): 2,293 valid tokens/s at 15.11 s/step = 271 "
        "valid tokens per sequence (26% of the cap); modelled as a lognormal clipped at the "
        "cap with 3% of the rows at the cap, scaled to the config's cap"
    ),
}


@dataclasses.dataclass(frozen=True)
class LengthProfile:
    """A pool of completion lengths (and, when measured, the prompts' lengths, paired
    row by row).

    - ``fractions``: a built-in profile's lengths as fractions of the cap (``tokens``
      None), scaled to the config's cap when drawn;
    - ``tokens``: measured completion lengths in tokens;
    - ``prompts``: the measured prompt length of each entry of ``tokens`` (None: every
      prompt at the config's prompt length).
    """

    name: str
    source: str
    fractions: np.ndarray | None = None
    tokens: np.ndarray | None = None
    prompts: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.fractions if self.fractions is not None else self.tokens)

    def completions(self, *, cap: int) -> np.ndarray:
        """Every length of the pool at a length cap of ``cap`` tokens (int64, 1..cap)."""
        if self.fractions is not None:
            raw = np.rint(self.fractions * cap)
        else:
            raw = self.tokens
        return np.clip(raw, 1, cap).astype(np.int64)


def builtin(name: str) -> LengthProfile:
    if name not in BUILTIN:
        raise KeyError(name)
    return LengthProfile(name=name, source=BUILTIN[name], fractions=_gsm8k_fractions())


def load_profile(spec: str, *, flag: str = "--lengths") -> LengthProfile:
    """The profile ``spec`` names: a built-in name, a file of integers or a run's
    ``samples.jsonl``. Bad input raises :class:`UserError` naming ``flag``."""
    if spec in BUILTIN:
        return builtin(spec)
    if not os.path.isfile(spec):
        raise UserError(
            f"{flag} {spec!r} is neither a file nor a built-in profile; built-in profiles: "
            f"{', '.join(sorted(BUILTIN))}. A file holds one completion length (tokens) a line, or is a "
            "run's samples.jsonl."
        )
    try:
        with open(spec, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{flag} {spec}: cannot read it ({err}).") from None
    first = next((ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")
    if first.startswith("{"):
        tokens, prompts = _read_samples(text, spec, flag)
        source = f"{len(tokens)} completions of the run whose samples.jsonl is {spec}"
    else:
        tokens, prompts = _read_integers(text, spec, flag), None
        source = f"{len(tokens)} completion lengths read from {spec}"
    return LengthProfile(name=os.path.basename(spec), source=source, tokens=tokens, prompts=prompts)


def _read_integers(text: str, spec: str, flag: str) -> np.ndarray:
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        s = line.split("#", 1)[0].strip()
        if not s:
            continue
        try:
            n = int(s)
        except ValueError:
            raise UserError(f"{flag} {spec}, line {i}: {s!r} is not an integer (one completion length, "
                            "in tokens, a line).") from None
        if n < 1:
            raise UserError(f"{flag} {spec}, line {i}: a completion length is at least 1 token (got {n}).")
        out.append(n)
    if not out:
        raise UserError(f"{flag} {spec} holds no lengths (one completion length, in tokens, a line).")
    return np.asarray(out, np.int64)


def _read_samples(text: str, spec: str, flag: str) -> tuple[np.ndarray, np.ndarray]:
    """A run's ``samples.jsonl``: each row's ``completion_lengths`` with its
    ``prompt_length`` repeated beside them."""
    tokens: list[int] = []
    prompts: list[int] = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{flag} {spec}, line {i}: not JSON ({err.msg}).") from None
        if not isinstance(row, dict) or row.get("completion_lengths") is None:
            raise UserError(
                f"{flag} {spec}, line {i}: no completion_lengths (samples.jsonl rows carry them from this "
                "version of grpo on; for an older run pass a file of integers, one length a line)."
            )
        lengths, prompt = row["completion_lengths"], row.get("prompt_length")
        ok = (isinstance(lengths, list) and all(isinstance(n, int) and n >= 1 for n in lengths)
              and isinstance(prompt, int) and prompt >= 1)
        if not ok:
            raise UserError(f"{flag} {spec}, line {i}: completion_lengths must be a list of positive integers "
                            "and prompt_length a positive integer.")
        tokens += lengths
        prompts += [prompt] * len(lengths)
    if not tokens:
        raise UserError(f"{flag} {spec} holds no samples.")
    return np.asarray(tokens, np.int64), np.asarray(prompts, np.int64)


def draw(profile: LengthProfile, *, rows: int, cap: int, prompt_length: int,
         seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One step's rows drawn from the profile (with replacement, seeded):
    ``(prompt lengths [rows], completion lengths [rows])``, completions at most ``cap``,
    prompts at most ``prompt_length`` (the config's; every prompt at it when the profile
    has none)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(profile), size=rows)
    completions = profile.completions(cap=cap)[idx]
    if profile.prompts is None:
        prompts = np.full(rows, prompt_length, np.int64)
    else:
        prompts = np.clip(profile.prompts[idx], 1, prompt_length)
    return prompts, completions


def summary(profile: LengthProfile, *, cap: int, prompt_length: int) -> dict[str, Any]:
    """The profile at ``cap``: its mean, quantiles and share of rows at the cap."""
    c = profile.completions(cap=cap)
    q = np.quantile(c, [0.1, 0.5, 0.9, 0.99])
    return {
        "name": profile.name,
        "source": profile.source,
        "entries": len(profile),
        "cap": cap,
        "mean_completion": float(c.mean()),
        "quantiles": {"p10": float(q[0]), "p50": float(q[1]), "p90": float(q[2]), "p99": float(q[3])},
        "at_cap": float((c >= cap).mean()),
        "prompts": ("measured (clipped to the config's prompt length)" if profile.prompts is not None
                    else f"every prompt at the config's prompt length, {prompt_length} tokens (an upper bound)"),
        "mean_prompt": float(np.clip(profile.prompts, 1, prompt_length).mean()) if profile.prompts is not None
        else float(prompt_length),
    }


__all__ = ["BUILTIN", "LengthProfile", "builtin", "clipped_lognormal", "draw", "load_profile", "summary"]
