"""Per-step metrics: ``metrics.jsonl``, W&B, a progress bar, summary and plot.

Only process 0 writes (every process computes the same global metrics). Memory keys are
omitted, not zero, where the backend reports no memory statistics (e.g. CPU).
"""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from grpo.core.errors import UserError
from grpo.engine.runs import rundir

GIB = 1024**3


def device_memory_metrics(devices: Iterable[Any]) -> dict[str, float]:
    """Max over local devices of bytes in use / peak, in GiB; {} when unreported."""
    in_use, peak = [], []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - some backends raise instead of returning None
            stats = None
        if not stats:
            continue
        if "bytes_in_use" in stats:
            in_use.append(stats["bytes_in_use"])
        if "peak_bytes_in_use" in stats:
            peak.append(stats["peak_bytes_in_use"])
    out = {}
    if in_use:
        out["memory/train/bytes_in_use_max_gib"] = max(in_use) / GIB
    if peak:
        out["memory/train/peak_bytes_in_use_max_gib"] = max(peak) / GIB
    return out


# Measured against the pre-update policy: exactly on-policy (ratio 1) in the first PPO
# epoch, so with several epochs they are reported from the later ones, where clipping happens.
OFF_POLICY_METRICS = ("clip_frac/low", "clip_frac/high", "ratio/mean", "approx_kl")


def epoch_summary(epochs: list[dict[str, Any]], off_policy_prefixes: tuple[str, ...] = ()) -> dict[str, float]:
    """One row from the per-epoch update metrics of a step: the mean over the epochs (the
    minimum / maximum for ``/min`` / ``/max`` metrics), and for :data:`OFF_POLICY_METRICS`
    and keys starting with ``off_policy_prefixes`` (the objective's own, all ratio-based)
    over epochs 2.. when there are several."""
    out: dict[str, float] = {}
    for key in epochs[0]:
        if key == "finite":
            continue
        off_policy = key in OFF_POLICY_METRICS or key.startswith(off_policy_prefixes)
        chosen = epochs[1:] if off_policy and len(epochs) > 1 else epochs
        reduce = np.min if key.endswith("/min") else np.max if key.endswith("/max") else np.mean
        out[key] = float(reduce([float(e[key]) for e in chosen]))
    return out


def tool_metrics(totals: Any, rows: int) -> dict[str, float]:
    """A step's tool metrics from its counters summed over every row rolled out:
    ``totals`` = (model turns, tool calls, tool errors, tool timeouts, tool results cut
    to fit the tool message)."""
    turns, calls, errors, timeouts, truncated = (float(x) for x in totals)
    return {
        "tools/calls_per_sample": calls / rows,
        "tools/errors": errors,
        "tools/timeouts": timeouts,
        "tools/truncated": truncated,
        "turns/mean": turns / rows,
    }


def rollout_scalars(rollout: Any, trainer_logprobs: Any, *, truncated: bool = False) -> dict[str, Any]:
    """A step's rollout metrics as device scalars (one transfer for them all): lengths,
    truncation, the sampler/trainer log-prob gap and importance ratio over the model's
    own tokens (inserted tokens have no sampler log-prob), the valid tokens, the tokens
    generated over every round, and ``reward/*`` (see :func:`reward_scalars`).
    ``rollout``: a :class:`~grpo.engine.rollout.step.StepRollout`. ``truncated``: the
    trainer's log-probs are under the rollout's top-k/top-p (``loss.truncated_policy``),
    so the sampler's to compare with are its behaviour ones, not its full-vocabulary ones.

    The device scalars are one program (:func:`_device_scalars`), not a dozen eager ops:
    one dispatch a step, and one compile, at the first step."""
    out = rollout.output
    scalars = _device_scalars(out.behaviour if truncated else out.logprobs, trainer_logprobs, rollout.trained,
                              out.lengths, out.truncated, rollout.generated_tokens)
    return {**scalars, **reward_scalars(rollout.logged_rewards, rollout.logged_by_fn)}


def _scalars(sampler: Any, trainer_logprobs: Any, trained: Any, lengths: Any, truncated: Any,
             generated: Any) -> dict[str, Any]:
    """:func:`rollout_scalars`' device part: ``sampler``/``trainer_logprobs`` [B, N],
    ``trained`` [B, N] (the tokens the loss trains on), ``lengths``/``truncated`` [B],
    ``generated`` the tokens rolled out over every round."""
    import jax.numpy as jnp

    mask_f = trained.astype(jnp.float32)
    n_valid = jnp.maximum(jnp.sum(mask_f), 1.0)
    valid = trained > 0
    gap = jnp.sum(jnp.abs(sampler - trainer_logprobs) * mask_f) / n_valid
    # The sampler/trainer mismatch as the importance ratio it is (what loss.mismatch caps).
    is_ratio = jnp.exp(jnp.where(valid, trainer_logprobs - sampler, 0.0))
    return {
        "completion/length_mean": jnp.mean(lengths.astype(jnp.float32)),
        "completion/clipped_frac": jnp.mean(truncated.astype(jnp.float32)),
        "logprob_gap/sampler_trainer": gap,
        "is_ratio/sampler_trainer/mean": jnp.sum(is_ratio * mask_f) / n_valid,
        "is_ratio/sampler_trainer/max": jnp.max(jnp.where(valid, is_ratio, 0.0)),
        "is_ratio/sampler_trainer/min": jnp.min(jnp.where(valid, is_ratio, jnp.inf)),
        # KL(sampler || trainer) per token, estimated on the sampler's own tokens with k3
        # (r - 1 - log r, r the ratio above: unbiased, never negative): the mismatch a
        # low-precision rollout (rollout.quantization) adds, 0 when the two agree.
        "mismatch/kl": jnp.sum((is_ratio - 1.0 - jnp.where(valid, trainer_logprobs - sampler, 0.0)) * mask_f) / n_valid,
        # The completion tokens the loss trains on (multi-turn: not the environment's).
        "valid_tokens": jnp.sum(mask_f),
        "rollout/generated_tokens": generated,  # every round's completions, trained on or not
        # What a trained token cost in rolled-out ones (dynamic sampling's rounds or stream, dropped rows included).
        "rollout/rolled_out_per_trained_token": generated / n_valid,
    }


def _device_scalars(*args: Any) -> dict[str, Any]:
    global _SCALARS_JIT
    if _SCALARS_JIT is None:
        import jax

        _SCALARS_JIT = jax.jit(_scalars)
    return _SCALARS_JIT(*args)


_SCALARS_JIT: Any = None


def reward_scalars(rewards: Any, by_fn: Mapping[str, Any]) -> dict[str, Any]:
    """``reward/mean``, ``reward/std`` and ``reward/<name>/mean``, reduced where the
    rewards are held: on device for the step's global arrays, on the host for the host
    arrays of every row rolled out (down-sampling, dynamic sampling)."""
    import jax.numpy as jnp

    xp = np if isinstance(rewards, np.ndarray) else jnp
    out = {"reward/mean": xp.mean(rewards), "reward/std": xp.std(rewards)}
    out.update({f"reward/{name}/mean": xp.mean(v) for name, v in by_fn.items()})
    return out


def step_row(step: int, scalars: Mapping[str, float], update: Mapping[str, float], *, objective: str,
             extra: Mapping[str, Any], times: Mapping[str, float]) -> dict[str, Any]:
    """The metrics row of a training step: ``scalars`` (:func:`rollout_scalars`, read
    back), ``update`` (:func:`epoch_summary` of the update's metrics), the objective's
    name (its own metrics are ``<objective>/...``), ``extra`` (dynamic/down-sampling
    metrics, counters, the learning rate) and the step's ``times`` (``rollout``,
    ``update``, ``step`` seconds)."""
    row: dict[str, Any] = {"step": step}
    row.update({k: v for k, v in scalars.items() if k.startswith("reward/")})
    row.update(
        {
            "completion/length_mean": scalars["completion/length_mean"],
            "completion/clipped_frac": scalars["completion/clipped_frac"],
            "loss": update.get("loss"),
            "grad_norm": update.get("grad_norm"),
            "clip_frac/low": update.get("clip_frac/low"),
            "clip_frac/high": update.get("clip_frac/high"),
            "ratio/mean": update.get("ratio/mean"),
            "approx_kl": update.get("approx_kl"),
            "kl": update.get("kl", 0.0),
            "logprob_gap/sampler_trainer": scalars["logprob_gap/sampler_trainer"],
            **{k: v for k, v in scalars.items() if k.startswith("is_ratio/")},
            "mismatch/kl": scalars["mismatch/kl"],
            # The objective's own metrics (named `<objective>/...`), the mismatch correction's and
            # loss.truncated_policy's, and a mixture-of-experts model's routing (moe/).
            **{k: v for k, v in update.items() if k.startswith(("mismatch/", "truncated_policy/", f"{objective}/", "moe/"))},
            "rollout/generated_tokens": scalars["rollout/generated_tokens"],
            "rollout/rolled_out_per_trained_token": scalars["rollout/rolled_out_per_trained_token"],
            **extra,
            "time/train/rollout_generate_s": times["rollout"],
            "time/train/update_s": times["update"],
            "time/train/step_s": times["step"],
            "throughput/train/valid_tokens_per_s": scalars["valid_tokens"] / times["step"],
        }
    )
    if "entropy" in update:
        row["entropy"] = update["entropy"]
    return row


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLogger:
    """Writes one JSON line per logged step; mirrors it to W&B and a progress bar."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        start_step: int,
        is_main: bool,
        wandb_cfg: Any = None,
        run_name: str,
        config_dict: Mapping[str, Any] | None = None,
        progress_bar: bool = True,
        resume: bool = False,
    ):
        self.run_dir = rundir.path(run_dir)
        self.is_main = is_main
        self.total_steps = total_steps
        self.step_times: collections.deque[float] = collections.deque(maxlen=10)
        # The ETA's: only steps that compiled nothing (a compile says nothing of the steps left).
        self.timed_steps: collections.deque[float] = collections.deque(maxlen=10)
        self._file: rundir.JsonlLog | None = None
        self._eval_file: rundir.JsonlLog | None = None
        self._wandb = None
        self._bar = None
        self._compiling = 0  # programs compiled since the bar last moved
        if not is_main:
            return
        self._file = rundir.JsonlLog(self.run_dir, "metrics.jsonl")
        self._eval_file = rundir.JsonlLog(self.run_dir, "eval.jsonl")
        if wandb_cfg is not None and wandb_cfg.mode != "disabled":
            import wandb

            try:
                self._wandb = wandb.init(
                    project=wandb_cfg.project,
                    entity=wandb_cfg.entity,
                    name=wandb_cfg.name or run_name,
                    tags=list(wandb_cfg.tags),
                    mode=wandb_cfg.mode,
                    # W&B keeps its files on a local disk: ./wandb when the run is in a bucket.
                    dir=None if rundir.is_remote(self.run_dir) else str(self.run_dir),
                    config=dict(config_dict or {}),
                    id=_wandb_id(self.run_dir),
                    resume="allow" if resume else None,
                )
            except (wandb.errors.Error, OSError) as err:
                raise UserError(
                    f"Weights & Biases could not start in logging.wandb.mode={wandb_cfg.mode!r}: {err} "
                    "For online mode set WANDB_API_KEY (or run `wandb login`) on every host; to log without "
                    "an account set logging.wandb.mode: offline (sync later with `wandb sync`) or disabled."
                ) from None
        if progress_bar:
            from tqdm.auto import tqdm

            # No tqdm remaining/rate: they time every step since the start, compiles included
            # (hours for a run that compiled for a minute); the postfix's eta is the one ETA.
            self._bar = tqdm(total=total_steps, initial=start_step, desc="grpo", unit="step", dynamic_ncols=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def compiling(self, program: str) -> None:
        """Say on the bar that the run waits for the compiler (``program``: the name JAX
        gives the program, e.g. ``jit(update)``); the next logged row clears it."""
        if self._bar is not None:
            self._compiling += 1
            self._bar.set_description_str(f"grpo (compiling {program}: {self._compiling} so far)", refresh=True)

    def log(self, metrics: dict[str, Any]) -> None:
        if "time/train/step_s" in metrics:
            self.step_times.append(float(metrics["time/train/step_s"]))
            metrics["time/train/step_avg_last10_s"] = sum(self.step_times) / len(self.step_times)
            if not metrics.get("compile/count"):
                self.timed_steps.append(float(metrics["time/train/step_s"]))
        if not self.is_main:
            return
        row = {k: _jsonable(v) for k, v in metrics.items()}
        assert self._file is not None
        self._file.append(row)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=int(row["step"]))
        if self._bar is not None:
            step = int(row["step"])
            self._bar.n = step
            self._bar.set_description_str("grpo", refresh=False)
            self._compiling = 0
            self._bar.set_postfix(
                reward=f"{row.get('reward/mean', float('nan')):.3f}",
                step_s=f"{row.get('time/train/step_s', 0.0):.2f}",
                tok_s=f"{row.get('throughput/train/valid_tokens_per_s', 0.0):.0f}",
                eta=self.eta(step),
                refresh=False,
            )
            self._bar.refresh()

    def eta(self, step: int) -> str:
        """The time left after ``step``: the mean of the last 10 steps that compiled nothing,
        times the steps left (``?`` before the first such step)."""
        if not self.timed_steps:
            return "?"
        return _fmt_eta(sum(self.timed_steps) / len(self.timed_steps) * (self.total_steps - step))

    def log_eval(self, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        assert self._eval_file is not None
        self._eval_file.append({k: _jsonable(v) for k, v in metrics.items()})
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=int(metrics["step"]))

    def flush(self) -> None:
        """Persist buffered rows (object stores buffer; see ``grpo.engine.runs.rundir``)."""
        for log in (self._file, self._eval_file):
            if log is not None:
                log.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self.flush()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_id(run_dir: str | Path) -> str:
    path = rundir.path(run_dir) / ".wandb_id"
    if path.exists():
        return path.read_text().strip()
    import uuid

    rid = uuid.uuid4().hex[:12]
    path.write_text(rid)
    return rid


def _fmt_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _read_rows(run_dir: str | Path, name: str) -> list[dict[str, Any]]:
    """Rows of the run-dir log ``name``, from either layout (single file or segments)."""
    rows = rundir.read_jsonl(run_dir, name)
    # A resumed run appends; keep the last row of each step.
    by_step = {r["step"]: r for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-step training rows of ``metrics.jsonl``, one per step, in step order."""
    return _read_rows(run_dir, "metrics.jsonl")


def read_eval(run_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluation rows of ``eval.jsonl`` (``eval/pass@1``, ...), one per step, in step order."""
    return _read_rows(run_dir, "eval.jsonl")


def reward_lines(rows: Sequence[Mapping[str, Any]], weights: Mapping[str, float] | None) -> list[tuple[str, list[float]]]:
    """The reward panel's lines, ``(label, values per row)``: ``reward/mean`` first, then
    each reward's share of it (``weight x reward/<name>/mean``, rewards of weight 0 left
    out, so the shares sum to ``reward/mean``) or, without ``weights``, each
    ``reward/<name>/mean`` as logged."""
    nan = float("nan")
    lines = [("reward/mean" + (" (the sum of the others)" if weights else ""), [r.get("reward/mean", nan) for r in rows])]
    names = sorted({k[len("reward/"):-len("/mean")] for r in rows for k in r
                    if k.startswith("reward/") and k.endswith("/mean") and k != "reward/mean"})
    for name in names:
        key = f"reward/{name}/mean"
        if weights is None:
            lines.append((f"{key} (unweighted)", [r.get(key, nan) for r in rows]))
        elif weights.get(name, 0.0) != 0.0:
            w = float(weights[name])
            label = key if w == 1.0 else f"{w:g} x {key}"
            lines.append((label, [w * r.get(key, nan) for r in rows]))
    return lines


def _plot_rewards(ax: Any, steps: list[int], rows: list[dict[str, Any]], weights: Mapping[str, float] | None) -> None:
    for i, (label, values) in enumerate(reward_lines(rows, weights)):
        ax.plot(steps, values, label=label, **({} if i == 0 else {"alpha": 0.6}))
    ax.set_xlabel("step")
    ax.set_title("reward (training rollouts)" + ("" if weights else ": rewards unweighted"))
    ax.legend(fontsize=8)


def plot_run(run_dir: str | Path, out: str | Path | None = None, *, weights: Mapping[str, float] | None = None) -> Any:
    """Reward, held-out evaluation (when ``eval.jsonl`` has rows), the tool-call rate (a
    multi-turn run: rows with ``tools/calls_per_sample``) and throughput over steps, as a
    PNG (in the run directory, local or in a bucket, by default).

    ``weights`` (reward name -> its weight in the total, :func:`grpo.engine.rollout.scoring.run_reward_weights`)
    draws each weighted reward's share of ``reward/mean``, so the lines drawn add up to it
    and a reward of weight 0 is left out; without them each ``reward/<name>/mean`` is drawn
    as logged, labelled unweighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        from grpo.core.errors import UserError

        raise UserError(f"{run_dir} has no metrics.jsonl rows to plot.")
    evals = read_eval(run_dir)
    out = out if out else rundir.path(run_dir) / "metrics.png"
    steps = [r["step"] for r in rows]
    tools = any("tools/calls_per_sample" in r for r in rows)
    panels = 2 + bool(evals) + tools
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    _plot_rewards(axes[0], steps, rows, weights)
    if evals:
        ax = axes[1]
        ev_steps = [r["step"] for r in evals]
        for key in sorted({k for r in evals for k in r if k.startswith("eval/pass@")}, key=lambda k: int(k.split("@")[1])):
            ax.plot(ev_steps, [r.get(key, float("nan")) for r in evals], marker="o", label=key)
        greedy = evals[-1].get("eval/greedy")
        prompts = evals[-1].get("eval/num_prompts")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlim(0, max(steps[-1], ev_steps[-1]))
        ax.set_xlabel("step")
        ax.set_title(f"eval: {'greedy ' if greedy else ''}accuracy on {int(prompts) if prompts else '?'} eval prompts")
        ax.legend(fontsize=8)
    if tools:
        ax = axes[-2]
        for key in ("tools/calls_per_sample", "turns/mean"):
            ax.plot(steps, [r.get(key, float("nan")) for r in rows], label=key)
        ax.set_xlabel("step")
        ax.set_title("tool calls per sample (training rollouts)")
        ax.legend(fontsize=8)
    axes[-1].plot(steps, [r.get("throughput/train/valid_tokens_per_s", float("nan")) for r in rows])
    axes[-1].set_xlabel("step")
    axes[-1].set_title("valid tokens / s")
    fig.tight_layout()
    out = rundir.write_figure(fig, out, dpi=100)
    plt.close(fig)
    return out


__all__ = [
    "MetricsLogger", "OFF_POLICY_METRICS", "device_memory_metrics", "epoch_summary", "plot_run", "read_eval",
    "read_metrics", "reward_scalars", "rollout_scalars", "step_row", "tool_metrics",
]
