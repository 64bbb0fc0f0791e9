"""The GRPO loop: prompts -> K rollouts each -> rewards -> advantages -> update.

One :class:`Trainer` per process; every process runs the same program (JAX's
multi-controller model) and takes part in every collective in the same order. Only
process 0 writes metrics, W&B, plots and checkpoint metadata.

The policy's parameters are one ``nnx.State`` shared by the sampler and the update (no
copy per step). A reference model exists only when ``loss.beta > 0``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo.core.config import RunConfig, resolve_layout, select_plugins
from grpo.core.errors import UserError
from grpo.engine.conversations import Conversations, roll_out, tool_counts, tool_metrics
from grpo.engine.evaluation import Evaluator
from grpo.engine.parallel import distributed
from grpo.engine.parallel.mesh import build_mesh, current_topology
from grpo.engine.parallel.rows import local_rows, to_global
from grpo.engine.planning.tpu import chip_of
from grpo.engine.programs import build_programs
from grpo.engine.rollout.dynamic_sampling import GroupFilter, down_sample, group_spread
from grpo.engine.rollout.prompts import build_batch, default_buckets, position_indices, process_slice, tokenize_prompts
from grpo.engine.runs import rundir
from grpo.engine.runs.checkpoint import Checkpointer
from grpo.engine.runs.metrics import MetricsLogger, device_memory_metrics, plot_run
from grpo.engine.training.advantages import group_advantages, turn_advantages
from grpo.engine.training.optim import applied_learning_rate
from grpo.engine.training.update import UpdateBatch
from grpo.models.families import family_of
from grpo.models.lora import count_params, split_params
from grpo.models.policy import load_policy

log = logging.getLogger(__name__)


class Interrupted(Exception):
    """Raised after a signal-triggered checkpoint; carries the exit status."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"interrupted by signal {signum} after step {step}")
        self.signum = signum
        self.step = step
        self.exit_code = 128 + signum


@dataclasses.dataclass
class StepTimes:
    rollout: float = 0.0
    update: float = 0.0
    total: float = 0.0


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


def add_tools(acc, tools):
    """Sum the tool counters of rollout rounds: (counts [4], rows, tools_s, append_s)."""
    if acc is None or tools is None:
        return tools if acc is None else acc
    return (acc[0] + tools[0], acc[1] + tools[1], acc[2] + tools[2], acc[3] + tools[3])


class Trainer:
    def __init__(self, config: RunConfig, run_dir: str | Path):
        self.config = config
        # A local path or a bucket URL (gs://, s3://); probed before anything compiles.
        self.run_dir = rundir.path(run_dir)
        rundir.probe(run_dir)
        distributed.initialize(config.distributed)
        self.is_main = jax.process_index() == 0
        self.topology = current_topology()
        self.layout = resolve_layout(config, self.topology)
        self.mesh = build_mesh(self.layout)
        self.plugins = select_plugins(config)
        self.task = self.plugins["task"].plugin
        self.task_options = self.plugins["task"].options

        self.policy = load_policy(config.model, self.mesh, seed=config.train.seed)
        model = self.policy.model
        # `params` is what trains (and is checkpointed): every weight, or with LoRA only the
        # adapters; `frozen` is the frozen (maybe quantized) LoRA base, None otherwise.
        self.graphdef, state = nnx.split(model)
        self.params, self.frozen = split_params(state)
        if self.frozen is not None and self.is_main:
            n_train, n_base = count_params(self.params), count_params(self.frozen)
            lora = config.model.lora
            log.info(
                "LoRA rank %d on %s: %s trainable parameters beside a frozen base of %s (%.3f%%)%s",
                lora.rank, ",".join(model.lora_spec.targets), f"{n_train:,}", f"{n_base:,}",
                100.0 * n_train / max(n_base, 1),
                f", base quantized {lora.base_quantization}" if lora.base_quantization != "none" else "",
            )
        self.ref_params = None
        if config.loss.beta > 0:
            # Full fine-tuning: a frozen copy of the initial policy; never updated, never
            # checkpointed. LoRA: the base itself with the adapters off, read beside zero
            # adapters of its own (the trained ones are donated to every update, so the
            # reference must never hold them; zero adapters are the base even if read).
            copy = jnp.copy if self.frozen is None else jnp.zeros_like
            self.ref_params = jax.tree.map(copy, self.params)
        # Every jitted program of a step comes from the one builder `grpo plan` compiles.
        self.programs = build_programs(
            config, mesh=self.mesh, layout=self.layout, graphdef=self.graphdef,
            eos_ids=self.policy.eos_ids, pad_id=self.policy.pad_id, plugins=self.plugins,
            arch=model.config, topology=self.topology, state=state, chip=chip_of(self.mesh.devices.flat[0]),
        )
        if self.is_main and self.programs.rollout.resharded:
            log.info("rollout layout: %s", self.programs.rollout.describe())
        self.batch_axes = self.programs.batch_axes
        self.batch_sharding = self.programs.rollout_sharding
        self.train_sharding = self.programs.train_sharding
        self.optimizer = self.programs.optimizer
        self.lr_schedule = self.programs.lr_schedule  # of the optimizer's update count
        self.opt_state = self.programs.init_opt_state(self.params)

        from grpo.engine.rollout.prompts import render_prompt

        tok = self.policy.tokenizer
        examples = self.task.load(split=config.task.train_split, options=self.task_options, seed=config.train.seed)
        # A task with environments (tools) rolls out conversations; None: single-turn.
        self.conversations = Conversations.of(
            self.task, self.task_options, tok, examples[0],
            tool_format=family_of(model.config).tool_call_format, timeout_s=config.rollout.tool_timeout_s,
        ) if examples else None
        if self.conversations is not None:
            self.render = self.conversations.prompt
        else:
            self.render = lambda ex: render_prompt(self.task, self.task_options, ex, tok)
        self.prompts = tokenize_prompts(
            examples, self.render, tok, max_prompt_length=config.rollout.max_prompt_length,
            split=config.task.train_split,
        )
        self.buckets = config.rollout.prompt_buckets or default_buckets(config.rollout.max_prompt_length)
        self.turn_stop_ids = None if self.conversations is None else self.conversations.turn_stop_ids()
        self.sampler = self.programs.sampler(turn_stop_ids=self.turn_stop_ids)
        self.update_step = self.programs.update_step
        self.update = self.programs.update(self.params, self.opt_state)
        # The reference pass runs micro-batch by micro-batch through the loss plugin's own
        # log-prob path (fused for pallas): never the whole step's [B, N, V] logits.
        self.ref_logprobs = self.programs.reference() if self.ref_params is not None else None
        self.policy_logprobs = self.programs.policy_logprobs()  # LoRA dropout only
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=config.checkpoint.keep)
        self.step = 0
        # Prompts drawn so far in the data order: step * prompts_per_step, or more with
        # dynamic sampling (checkpointed either way).
        self.data_position = 0
        self.skipped_nonfinite = 0
        self.reward_errors: dict[str, int] = {}
        self._signal: int | None = None
        self.evaluator = Evaluator(
            config, self.programs, task=self.task, task_options=self.task_options, policy=self.policy,
            render=self.render, buckets=self.buckets, conversations=self.conversations,
        )
        self._samples: rundir.JsonlLog | None = None
        self._logger: MetricsLogger | None = None

    # ------------------------------------------------------------------ pieces

    def policy_params(self) -> Any:
        """What the sampler reads: the whole model's state (base and adapters, no copies),
        or for ``model.lora.sampler: merged`` the projections with the adapters merged in."""
        return self.programs.sampler_state(self.params, self.frozen)

    def _to_train(self, x: jax.Array) -> jax.Array:
        """Reshard a rollout-layout batch array to the update's (dp, fsdp) batch layout;
        a jitted identity works for arrays spanning several processes."""
        if not hasattr(self, "_reshard"):
            self._reshard = jax.jit(lambda a: a, out_shardings=self.train_sharding)
        return self._reshard(x)

    def _dropout_keys(self, rows: int) -> jax.Array | None:
        """One LoRA-dropout key per row of this step (None without dropout), derived from
        (seed, step): a resumed run draws the same masks. Every PPO epoch of the step uses
        the same masks as the log-probs its ratio divides by, so at unchanged parameters
        the ratio is exactly 1 (a mask per epoch made it dropout noise)."""
        if not self.programs.lora_dropout:
            return None
        if not hasattr(self, "_make_keys"):
            def make(step):
                base = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.config.train.seed), 0xD80), step)
                return jax.random.key_data(jax.random.split(base, rows))

            self._make_keys = jax.jit(make, out_shardings=self.train_sharding)
        return self._make_keys(jnp.int32(self.step))

    def _behaviour_logprobs(self, ub: UpdateBatch) -> tuple[jax.Array | None, UpdateBatch]:
        """With LoRA dropout: the policy's dropout-free log-probs (what the sampler's are
        compared with), and ``ub`` with its mismatch-correction input corrected for dropout.

        The mismatch weight comes from ``exp(logp_old - logp_sampler)``: a correction for the
        sampler and the trainer disagreeing on the same policy. With dropout the loss's
        ``logp_old`` is under this step's dropout masks (it must be, for the PPO ratio),
        so the loss is handed ``sampler + (masked - dropout_free)``, both of the
        pre-update policy: its weight is then ``exp(dropout_free - sampler)``, numerics
        only, never dropout noise. Without dropout: ``(None, ub)``."""
        if self.policy_logprobs is None:
            return None, ub
        free = self.policy_logprobs(self.params, ub._replace(dropout_keys=None), self.frozen)
        if ub.sampler_logprobs is not None:
            masked = self.policy_logprobs(self.params, ub, self.frozen)
            ub = ub._replace(sampler_logprobs=ub.sampler_logprobs + (masked - free))
        return free, ub

    def _turn_advantages(self, per_fn: dict[str, jax.Array], own: jax.Array) -> jax.Array:
        """Per-token advantages [B, N] of turn-level credit (``train.advantage.credit:
        turn``): the rewards (global [B] each, by name) summed by weight into one component
        per scope (the task's ``reward_turns``, then ``train.advantage.reward_turns``;
        ``task.overlong``'s penalty credits every turn), each component's group advantage
        on the model turns it scores (``own``: the model's tokens [B, N]). The scopes,
        weights and program are built at the first step (a run's rewards never change)."""
        if not hasattr(self, "_turn_adv"):
            from grpo.engine.rollout.scoring import OVERLONG, reward_weights

            adv = self.config.train.advantage
            scopes = {**self.task.reward_turns(options=self.task_options), **adv.reward_turns}
            weights = {**reward_weights(self.task, self.task_options), OVERLONG: 1.0}
            parts: dict[str, list[tuple[float, str]]] = {}
            for name in per_fn:
                if weights[name]:
                    parts.setdefault(scopes.get(name, "all"), []).append((weights[name], name))

            def turn_adv(per_fn, own):
                components = {scope: sum(w * per_fn[n] for w, n in terms) for scope, terms in parts.items()}
                return turn_advantages(components, own, num_generations=self.config.group_size,
                                       baseline=adv.baseline, scale=adv.scale, epsilon=adv.epsilon)

            self._turn_adv = jax.jit(turn_adv, out_shardings=own.sharding)
        return self._turn_adv(per_fn, own)

    def _rollout_batch(self, position: int):
        """The prompts at ``position .. position + prompts_per_step`` of the data order
        (this process's slice of them)."""
        cfg = self.config
        indices = position_indices(len(self.prompts), start=position, count=cfg.train.prompts_per_step, seed=cfg.train.seed)
        local = process_slice(cfg.train.prompts_per_step, jax.process_index(), jax.process_count())
        return build_batch(self.prompts, indices, local=local, buckets=self.buckets, pad_id=self.policy.pad_id)

    def _score(self, examples: list[dict], texts: list[str], lengths: np.ndarray):
        """This process's rows scored: totals [b], each reward [b] by name, and which
        reward functions failed on each row [b, rewards] (int32, in ``per_fn``'s order).
        With ``task.overlong`` the length penalty joins as the reward ``overlong``."""
        from grpo.engine.rollout.scoring import OVERLONG, overlong_penalty, score_completions

        scored = score_completions(self.task, self.task_options, examples, texts)
        per_fn = {name: np.asarray([r[name] for r in scored.rewards], np.float32) for name in scored.names}
        failed = np.asarray([[name in bad for name in scored.names] for bad in scored.failed], np.int32)
        failed = failed.reshape(len(texts), len(scored.names))
        totals = np.asarray(scored.totals, np.float32)
        overlong = self.config.task.overlong
        if overlong.buffer:
            if OVERLONG in per_fn:
                raise UserError(
                    f"task {self.task.name!r} defines a reward named {OVERLONG!r}, the name task.overlong's penalty "
                    "is logged under; rename the task's reward or set task.overlong.buffer=0."
                )
            penalty = overlong_penalty(
                lengths, max_new_tokens=self.config.rollout.max_new_tokens,
                buffer=overlong.buffer, factor=overlong.factor,
            )
            per_fn[OVERLONG] = penalty
            totals = totals + penalty
            failed = np.concatenate([failed, np.zeros((len(texts), 1), np.int32)], axis=1)  # it never fails
        return totals, per_fn, failed

    def _rollout_round(self, position: int, round_: int):
        """Roll out and score the ``prompts_per_step`` prompts at ``position``: the rollout
        (global arrays), this process's totals [b], rewards by name [b] and reward-error
        counts of every process's rows [rewards] (a replicated device array), and the
        seconds the sampler took. Round 0 samples with the step's key, as a step without
        dynamic sampling does; round r with that key folded with r."""
        cfg = self.config
        k = cfg.rollout.num_generations
        t0 = time.perf_counter()
        batch = self._rollout_batch(position)
        shape = (cfg.train.prompts_per_step, batch.tokens.shape[1])
        prompts = to_global(batch.tokens, self.programs.prompt_sharding(shape))
        prompt_mask = to_global(batch.mask, self.programs.prompt_sharding(shape))
        rng = jax.random.fold_in(jax.random.key(cfg.train.seed), self.step)
        if round_:
            rng = jax.random.fold_in(rng, round_)
        examples = [ex for ex in batch.examples for _ in range(k)]  # row b*K+j: sample j of prompt b
        episodes = None
        if self.conversations is None:
            out = self.sampler.generate(self.policy_params(), prompts, prompt_mask, rng)
            local_mask = local_rows(out.mask)
            texts = self.policy.decode(local_rows(out.tokens), local_mask)
        else:
            # Each process runs the environments (tools) of its own rows. Reward
            # functions see the model's last turn and the whole trajectory.
            out, episodes, examples = roll_out(self.conversations, self.sampler, self.policy_params(), prompts,
                                               prompt_mask, rng, examples)
            local_mask = local_rows(out.mask)
            texts = episodes.last_text
        t_generate = time.perf_counter() - t0

        # The completion's length (model and inserted tokens alike: rollout.max_new_tokens bounds both).
        rewards_local, per_fn_local, failed_local = self._score(examples, texts, local_mask.sum(axis=1))
        errors = self._sum_rows(to_global(failed_local, self.batch_sharding))  # rewards
        if round_ == 0 and self.is_main and self.step % self.config.logging.every_n_steps == 0:
            self._write_samples(batch.examples[0], texts[:k], rewards_local[:k],
                                None if episodes is None else episodes.turns[:k])
        tools = None
        if episodes is not None:
            # [turns, calls, errors, timeouts] over every process's rows, and this process's host seconds.
            counts = self._sum_rows(to_global(tool_counts(episodes), self.batch_sharding))
            tools = (counts, out.tokens.shape[0], episodes.tools_s, episodes.append_s)
        return out, rewards_local, per_fn_local, errors, t_generate, tools

    def _all_rows(self, local: np.ndarray) -> np.ndarray:
        """Every process's rows of a host array, in global row order (tiny: rewards)."""
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(local, tiled=True))

    def _assemble(self, outs: list[Any], rows: np.ndarray) -> Any:
        """One rollout of global ``rows`` [B] of the rounds ``outs`` stacked in order, prompts
        left-padded to the widest round's, in the update's row layout. A jitted gather with
        replicated indices: the rows a process trains on may have been sampled on another."""
        if not hasattr(self, "_gather_rows"):
            def gather(outs, rows, width, pad_id):
                def widen(o):
                    pad = ((0, 0), (width - o.prompt_tokens.shape[1], 0))  # left, like build_batch
                    return o._replace(prompt_tokens=jnp.pad(o.prompt_tokens, pad, constant_values=pad_id),
                                      prompt_mask=jnp.pad(o.prompt_mask, pad))
                stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *[widen(o) for o in outs])
                return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), stacked)

            shardings = jax.tree.map(lambda x: self.train_sharding if x.ndim else self.programs.replicated, outs[0])
            self._gather_rows = jax.jit(gather, static_argnums=(2, 3), out_shardings=shardings)
        rows = rows.astype(np.int32)
        rows = jax.make_array_from_callback(rows.shape, self.programs.replicated, lambda idx: rows[idx])
        width = max(o.prompt_tokens.shape[1] for o in outs)
        return self._gather_rows(outs, rows, width, self.policy.pad_id)

    def _next_round(self):
        """One rollout of the next ``prompts_per_step`` prompts of the data order (the data
        position moves past them): :meth:`_rollout_round`'s results and the generated tokens."""
        out, rewards_local, per_fn_local, errors, t_rollout, tools = self._rollout_round(self.data_position, 0)
        self.data_position += self.config.train.prompts_per_step
        return out, rewards_local, per_fn_local, errors, t_rollout, tools, jnp.sum(out.lengths)

    def _dynamic_rollout(self):
        """Rounds of rollouts until the step holds ``prompts_per_step`` groups with a reward
        spread (see :mod:`grpo.engine.rollout.dynamic_sampling`): the rounds the batch takes
        groups from, its rows in them (:meth:`_assemble`'s), their totals and rewards by
        name (every process's rows), the reward-error counts, the sampler's seconds, the
        generated tokens, the ``dynamic_sampling/*`` metrics and the tool counters."""
        cfg = self.config
        p, k = cfg.train.prompts_per_step, cfg.rollout.num_generations
        picker = GroupFilter(want=p, max_rounds=cfg.train.dynamic_sampling.max_rounds)
        outs, totals, per_fn, generated = [], [], [], []
        errors, t_generate, tools = None, 0.0, None
        while not picker.done:
            out, rewards_local, per_fn_local, err, t, round_tools = self._rollout_round(self.data_position, picker.rounds)
            self.data_position += p
            errors = err if errors is None else errors + err
            tools = add_tools(tools, round_tools)
            t_generate += t
            outs.append(out)
            totals.append(self._all_rows(rewards_local))
            per_fn.append({n: self._all_rows(v) for n, v in per_fn_local.items()})
            generated.append(jnp.sum(out.lengths))
            picker.add(group_spread(totals[-1], k))
        groups, _ = picker.picks()
        used = sorted({r for r, _ in groups})  # rounds the batch takes groups from
        slot = {r: i for i, r in enumerate(used)}
        rows = np.asarray([(slot[r] * p + g) * k + j for r, g in groups for j in range(k)])
        # The batch's rewards, every process's rows (rows of a round: r*B + row).
        src = np.asarray([r * p * k + (g * k + j) for r, g in groups for j in range(k)])
        full = np.concatenate(totals)[src]
        per_full = {n: np.concatenate([f[n] for f in per_fn])[src] for n in per_fn[0]}
        return ([outs[r] for r in used], rows, full, per_full, errors, t_generate, sum(generated), picker.metrics(),
                tools)

    def _selected_rollout(self):
        """The step's rollout when rows are selected (dynamic sampling, down-sampling): the
        update batch's rollout in the update's layout, its rewards and rewards by name
        (global arrays), the same over every row rolled out for the batch's groups (host
        arrays, for the logs: down-sampling keeps a biased subset), the reward-error
        counts, the sampler's seconds, the generated tokens, the metrics and the tool
        counters. Down-sampling (:func:`~grpo.engine.rollout.dynamic_sampling.down_sample`)
        keeps ``train.down_sampling.keep`` rows of each group the step trains on."""
        cfg = self.config
        k = cfg.rollout.num_generations
        if cfg.train.dynamic_sampling.enabled:
            outs, rows, full, per_full, errors, t_rollout, generated, metrics, tools = self._dynamic_rollout()
        else:
            out, rewards_local, per_fn_local, errors, t_rollout, tools, generated = self._next_round()
            outs, rows, metrics = [out], np.arange(out.tokens.shape[0]), {}
            full = self._all_rows(rewards_local)
            per_full = {n: self._all_rows(v) for n, v in per_fn_local.items()}
        logged = (full, per_full)
        ds = cfg.train.down_sampling
        if ds.keep is not None:
            rng = np.random.default_rng([cfg.train.seed, self.step]) if ds.rule == "random" else None
            keep = down_sample(full, k, ds.keep, rule=ds.rule, rng=rng)
            rows, full, per_full = rows[keep], full[keep], {n: v[keep] for n, v in per_full.items()}
            metrics = {**metrics, "down_sampling/kept_reward_mean": float(np.mean(full)),
                       "down_sampling/kept_reward_std": float(np.std(full))}
        out = self._assemble(outs, rows)
        place = lambda a: jax.make_array_from_callback(a.shape, self.train_sharding, lambda idx: a[idx])  # noqa: E731
        rewards, per_fn = place(full), {n: place(v) for n, v in per_full.items()}
        return out, rewards, per_fn, logged, errors, t_rollout, generated, metrics, tools

    def _add_reward_errors(self, names: list[str], counts: np.ndarray) -> None:
        """Add a step's failures of each reward function, counted over every process's
        rows (each process scores only its own)."""
        for name, n in zip(names, counts):
            self.reward_errors[name] = self.reward_errors.get(name, 0) + int(n)

    def _sum_rows(self, x: jax.Array) -> jax.Array:
        """Column sums of a batch-sharded global array, replicated on every process."""
        if not hasattr(self, "_row_sum"):
            self._row_sum = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=self.programs.replicated)
        return self._row_sum(x)

    def _write_samples(self, example: dict, texts: list[str], rewards: np.ndarray,
                       turns: list[list[dict]] | None = None) -> None:
        """The first prompt's group of completions, for reading what the policy does; in a
        multi-turn rollout each completion's ``turns`` ``[{role, text, trained}]`` too
        (environment replies: ``trained: false``)."""
        row: dict[str, Any] = {
            "step": self.step + 1,
            "prompt": self.render(example),
            "completions": texts,
            "rewards": [round(float(r), 4) for r in rewards],
        }
        if turns is not None:
            row["turns"] = turns
        if self._samples is None:
            self._samples = rundir.JsonlLog(self.run_dir, "samples.jsonl")
        self._samples.append(row)

    def _flush_logs(self) -> None:
        """Persist the rows buffered for an object store (a no-op for local directories)."""
        for log in (self._samples, self._logger):
            if log is not None:
                log.flush()

    def _install_signal_handlers(self) -> None:
        if not self.config.checkpoint.on_signal:
            return

        def handler(signum, frame):  # noqa: ARG001
            if self._signal is not None:  # a second signal: stop now
                raise KeyboardInterrupt
            self._signal = signum
            log.warning("signal %d received: finishing step %d, then saving a checkpoint", signum, self.step + 1)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    def _stop_requested(self) -> bool:
        flag = self._signal is not None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            flag = bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())
        return flag

    # ------------------------------------------------------------------ state

    def _state(self) -> dict[str, Any]:
        return {"params": self.params, "opt_state": self.opt_state}

    def _meta(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "data_position": self.data_position,
            "seed": self.config.train.seed,
            "skipped_nonfinite_steps": self.skipped_nonfinite,
            "reward_errors": self.reward_errors,
        }

    def save(self) -> None:
        # Logs first: after a preemption, every row up to the checkpoint's step is stored.
        self._flush_logs()
        self.checkpointer.save(self.step, self._state(), self._meta())
        if self.is_main:
            log.info("checkpoint saved at step %d in %s", self.step, self.checkpointer.directory)

    def maybe_resume(self) -> bool:
        latest = self.checkpointer.latest_step()
        if latest is None:
            if self.is_main:
                print(f"Starting fresh: no checkpoint in {self.checkpointer.directory}", flush=True)
            return False
        state, meta = self.checkpointer.restore(self._state(), latest)  # params, opt_state
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.step = int(meta["step"])
        self.data_position = int(meta.get("data_position", self.step * self.config.train.prompts_per_step))
        self.skipped_nonfinite = int(meta.get("skipped_nonfinite_steps", 0))
        self.reward_errors = dict(meta.get("reward_errors", {}))
        if self.is_main:
            print(f"Resuming from the checkpoint at step {self.step} in {self.checkpointer.directory}", flush=True)
        return True

    # ------------------------------------------------------------------ loop

    def train_step(self) -> dict[str, Any]:
        cfg = self.config
        t0 = time.perf_counter()
        logged = None  # the rewards of every row rolled out, where they are not the batch's
        if cfg.train.dynamic_sampling.enabled or cfg.train.down_sampling.keep is not None:
            out, rewards, per_fn, logged, errors, t_rollout, generated, ds_metrics, tools = self._selected_rollout()
        else:
            out, rewards_local, per_fn_local, errors, t_rollout, tools, generated = self._next_round()
            ds_metrics = {}
            rewards = to_global(rewards_local, self.batch_sharding)
            per_fn = {n: to_global(v, self.batch_sharding) for n, v in per_fn_local.items()}
        adv = cfg.train.advantage
        if adv.credit == "turn":
            advantages = self._turn_advantages(per_fn, out.mask if out.loss_mask is None else out.loss_mask)
        else:
            advantages = group_advantages(
                rewards, num_generations=cfg.group_size, baseline=adv.baseline, scale=adv.scale, epsilon=adv.epsilon
            )

        t1 = time.perf_counter()
        to_train = self._to_train
        ub = UpdateBatch(
            prompt_tokens=to_train(out.prompt_tokens),
            prompt_mask=to_train(out.prompt_mask),
            tokens=to_train(out.tokens),
            mask=to_train(out.mask),
            advantages=to_train(advantages),
            old_logprobs=None,
            ref_logprobs=None,
            sampler_logprobs=to_train(out.logprobs) if cfg.loss.mismatch is not None else None,
            truncated=to_train(out.truncated) if cfg.loss.mask_truncated else None,
            loss_mask=None if out.loss_mask is None else to_train(out.loss_mask),
        )
        if self.ref_logprobs is not None:
            ub = ub._replace(ref_logprobs=self.ref_logprobs(self.ref_params, ub, self.frozen))
        ub = ub._replace(dropout_keys=self._dropout_keys(ub.tokens.shape[0]))
        trainer_logprobs, ub = self._behaviour_logprobs(ub)
        epoch_metrics = []
        for epoch in range(cfg.train.ppo_epochs):
            self.params, self.opt_state, m, logprobs = self.update(self.params, self.opt_state, ub, self.frozen)
            epoch_metrics.append(m)
            if epoch == 0:
                if trainer_logprobs is None:
                    trainer_logprobs = logprobs
                # Later epochs measure the ratio against the pre-update policy's log-probs
                # (the first epoch's, computed before its step, under the same dropout masks).
                ub = ub._replace(old_logprobs=jax.lax.stop_gradient(logprobs))
        # A step counts once however many of its epochs were skipped; `finite` is a
        # replicated output of the update, so every process counts alike.
        if not all(bool(m["finite"]) for m in epoch_metrics):
            self.skipped_nonfinite += 1
        jax.block_until_ready(self.params)
        t_update = time.perf_counter() - t1
        self.step += 1
        step_s = time.perf_counter() - t0

        # The sampler/trainer comparison counts the model's own tokens (every real token
        # of a single-turn rollout): inserted tokens have no sampler log-prob.
        trained = out.mask if out.loss_mask is None else out.loss_mask
        mask_f = trained.astype(jnp.float32)
        n_valid = jnp.maximum(jnp.sum(mask_f), 1.0)
        valid = trained > 0
        gap = jnp.sum(jnp.abs(out.logprobs - trainer_logprobs) * mask_f) / n_valid
        # The sampler/trainer mismatch as the importance ratio it is (what loss.mismatch caps).
        is_ratio = jnp.exp(jnp.where(valid, trainer_logprobs - out.logprobs, 0.0))
        scalars = {
            "completion/length_mean": jnp.mean(out.lengths.astype(jnp.float32)),
            "completion/clipped_frac": jnp.mean(out.truncated.astype(jnp.float32)),
            "logprob_gap/sampler_trainer": gap,
            "is_ratio/sampler_trainer/mean": jnp.sum(is_ratio * mask_f) / n_valid,
            "is_ratio/sampler_trainer/max": jnp.max(jnp.where(valid, is_ratio, 0.0)),
            "is_ratio/sampler_trainer/min": jnp.min(jnp.where(valid, is_ratio, jnp.inf)),
            "valid_tokens": jnp.sum(out.mask.astype(jnp.float32)),
            "rollout/generated_tokens": generated,  # every round's completions, trained on or not
        }
        # Over the batch's groups: with down-sampling every sample rolled out for them (what
        # the policy earns), not only the subset trained on.
        if logged is None:
            scalars.update({"reward/mean": jnp.mean(rewards), "reward/std": jnp.std(rewards)})
            scalars.update({f"reward/{name}/mean": jnp.mean(v) for name, v in per_fn.items()})
        scalars, error_counts, tool_totals = jax.device_get((scalars, errors, None if tools is None else tools[0]))
        scalars = {k_: float(v) for k_, v in scalars.items()}
        if logged is not None:
            scalars.update({"reward/mean": float(np.mean(logged[0])), "reward/std": float(np.std(logged[0]))})
            scalars.update({f"reward/{name}/mean": float(np.mean(v)) for name, v in logged[1].items()})
        self._add_reward_errors(list(per_fn), error_counts)
        m = epoch_summary(jax.device_get(epoch_metrics), off_policy_prefixes=(f"{cfg.loss.objective}/",))
        row: dict[str, Any] = {"step": self.step}
        row.update({k_: scalars[k_] for k_ in scalars if k_.startswith("reward/")})
        row.update(
            {
                "completion/length_mean": scalars["completion/length_mean"],
                "completion/clipped_frac": scalars["completion/clipped_frac"],
                "loss": m.get("loss"),
                "grad_norm": m.get("grad_norm"),
                "clip_frac/low": m.get("clip_frac/low"),
                "clip_frac/high": m.get("clip_frac/high"),
                "ratio/mean": m.get("ratio/mean"),
                "approx_kl": m.get("approx_kl"),
                "kl": m.get("kl", 0.0),
                "logprob_gap/sampler_trainer": scalars["logprob_gap/sampler_trainer"],
                **{k_: v for k_, v in scalars.items() if k_.startswith("is_ratio/")},
                # The objective's own metrics (named `<objective>/...`) and the mismatch correction's.
                **{k_: v for k_, v in m.items() if k_.startswith(("mismatch/", f"{cfg.loss.objective}/"))},
                "rollout/generated_tokens": scalars["rollout/generated_tokens"],
                **ds_metrics,
                "skipped_nonfinite_steps": self.skipped_nonfinite,
                "reward_errors": sum(self.reward_errors.values()),
                # Read from the optimizer's own count: the rate its updates applied.
                "learning_rate": applied_learning_rate(self.lr_schedule, self.opt_state),
                "time/train/rollout_generate_s": t_rollout,
                "time/train/update_s": t_update,
                "time/train/step_s": step_s,
                "throughput/train/valid_tokens_per_s": scalars["valid_tokens"] / step_s,
            }
        )
        if "entropy" in m:
            row["entropy"] = m["entropy"]
        if tools is not None:
            # Over every row rolled out this step (every round of dynamic sampling).
            row.update(tool_metrics(tool_totals, tools[1]))
            # This process's host time: the environments' steps, and rendering + appends.
            row["time/train/tools_s"] = tools[2]
            row["time/train/append_s"] = tools[3]
        row.update(device_memory_metrics(jax.local_devices()))
        return row

    def evaluate(self) -> dict[str, Any]:
        return self.evaluator(self.step, self.policy_params())

    def run(self) -> dict[str, Any]:
        cfg = self.config
        resumed = self.maybe_resume()
        if self.is_main:
            rundir.mkdir(self.run_dir)
            rundir.write_text(self.run_dir / "config.yaml", cfg.to_yaml())
        logger = MetricsLogger(
            self.run_dir,
            total_steps=cfg.train.steps,
            start_step=self.step,
            is_main=self.is_main,
            wandb_cfg=cfg.logging.wandb,
            run_name=cfg.name or self.run_dir.name,
            config_dict=cfg.model_dump(mode="json"),
            progress_bar=cfg.logging.progress_bar,
            resume=resumed,
        )
        self._logger = logger
        self._install_signal_handlers()
        t_start = time.perf_counter()
        first_step = self.step
        last_row: dict[str, Any] = {}
        eval_rows: list[dict[str, Any]] = []
        try:
            if cfg.eval.every_n_steps:
                self.evaluator.prepare()  # an eval split with no usable prompt stops the run now
            if cfg.eval.every_n_steps and cfg.eval.at_start and self.step == 0:
                ev = self.evaluate()  # the untrained policy: where the eval curve starts
                eval_rows.append(ev)
                logger.log_eval(ev)
            while self.step < cfg.train.steps:
                row = self.train_step()
                last_row = row
                if self.step % cfg.logging.every_n_steps == 0 or self.step == cfg.train.steps:
                    logger.log(row)
                if cfg.eval.every_n_steps and self.step % cfg.eval.every_n_steps == 0:
                    ev = self.evaluate()
                    eval_rows.append(ev)
                    logger.log_eval(ev)
                due = cfg.checkpoint.every_n_steps and self.step % cfg.checkpoint.every_n_steps == 0
                if self._stop_requested():
                    if cfg.checkpoint.on_signal:
                        self.save()
                    raise Interrupted(self._signal or signal.SIGTERM, self.step)
                if due:
                    self.save()
            if cfg.checkpoint.at_end and self.checkpointer.latest_step() != self.step:
                self.save()
        finally:
            logger.close()
            self._logger = None
            if self._samples is not None:
                self._samples.close()
        summary = {
            "steps": self.step,
            "resumed_from": first_step if resumed else None,
            "wall_s": time.perf_counter() - t_start,
            "final": last_row,
            "eval": eval_rows[-1] if eval_rows else None,
            "skipped_nonfinite_steps": self.skipped_nonfinite,
            "reward_errors": self.reward_errors,
        }
        if self.is_main:
            rundir.write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2, default=float))
            if cfg.logging.plot:
                plot_run(self.run_dir)
        self.checkpointer.close()
        return summary


def default_run_dir(config: RunConfig, config_path: str | None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        # Every process must agree on the directory: use process 0's clock.
        t = int(multihost_utils.broadcast_one_to_all(np.int64(int(time.time()))))
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(t))
    name = config.name or (Path(config_path).stem if config_path else "run")
    return Path("runs") / f"{name}-{stamp}"


__all__ = ["Interrupted", "Trainer", "default_run_dir"]
