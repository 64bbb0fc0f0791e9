"""The GRPO loop: prompts -> K rollouts each -> rewards -> advantages -> update.

One :class:`Trainer` per process; every process runs the same program (JAX's
multi-controller model) and takes part in every collective in the same order. Only
process 0 writes metrics, W&B, plots and checkpoint metadata.

The policy's parameters are one ``nnx.State`` shared by the sampler and the update (no
copy per step). A reference model exists only when ``loss.beta > 0``.
"""

from __future__ import annotations

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
from grpo.engine.evaluation import Evaluator
from grpo.engine.loop.factory import build_loop
from grpo.engine.parallel import distributed
from grpo.engine.parallel.mesh import build_mesh, current_topology
from grpo.engine.parallel.split import async_meshes
from grpo.engine.planning.tpu import chip_of
from grpo.engine.programs import build_programs
from grpo.engine.rollout.conversations import Conversations
from grpo.engine.rollout.failures import LOG_NAME, RewardFailures
from grpo.engine.rollout.prompts import default_buckets, tokenize_prompts
from grpo.engine.rollout.step import SampleGroup, StepCollector, StepRollout
from grpo.engine.runs import compiles, identity, rundir
from grpo.engine.runs.checkpoint import Checkpointer
from grpo.engine.runs.metrics import (
    MetricsLogger,
    device_memory_metrics,
    epoch_summary,
    plot_run,
    rollout_scalars,
    step_row,
    tool_metrics,
)
from grpo.engine.training.advantages import group_advantages, informative_groups
from grpo.engine.training.optim import applied_learning_rate
from grpo.engine.training.packing import PackedBatch, packing_stats
from grpo.engine.training.update import UpdateBatch
from grpo.models.families import family_of
from grpo.models.loading import build_model
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


class Trainer:
    def _log_lora(self, model: Any) -> None:
        """One line on the LoRA run's trainable share (process 0)."""
        n_train, n_base = count_params(self.params), count_params(self.frozen)
        lora = self.config.model.lora
        log.info(
            "LoRA rank %d on %s: %s trainable parameters beside a frozen base of %s (%.3f%%)%s",
            lora.rank, ",".join(model.lora_spec.targets), f"{n_train:,}", f"{n_base:,}",
            100.0 * n_train / max(n_base, 1),
            f", base quantized {lora.base_quantization}" if lora.base_quantization != "none" else "",
        )

    def __init__(self, config: RunConfig, run_dir: str | Path):
        self.config = config
        # A local path or a bucket URL (gs://, s3://); probed before anything compiles.
        self.run_dir = rundir.path(run_dir)
        rundir.probe(run_dir)
        self.compiles = compiles.CompileCounter()  # every compile from here (rows, summary.json)
        self.cache_dir = compiles.use_cache(compiles.cache_dir(config.train.compile.cache_dir, self.run_dir))
        distributed.initialize(config.distributed)
        self.is_main = jax.process_index() == 0
        # Asynchronous GRPO: the update mesh is the trainer's; the rollout mesh its own.
        self.meshes = async_meshes(config) if config.train.async_.enabled else None
        if self.meshes is None:
            self.topology = current_topology()
            self.layout = resolve_layout(config, self.topology)
            self.mesh = build_mesh(self.layout)
        else:
            side = self.meshes.update
            self.topology, self.layout, self.mesh = side.topology, side.layout, side.mesh
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
            self._log_lora(model)
        self.ref_params = None
        if config.loss.beta > 0:
            # Full fine-tuning: a frozen copy of the initial policy; never updated, never
            # checkpointed. LoRA: the base itself with the adapters off, read beside zero
            # adapters of its own (the trained ones are donated to every update, so the
            # reference must never hold them; zero adapters are the base even if read).
            copy = jnp.copy if self.frozen is None else jnp.zeros_like
            self.ref_params = jax.tree.map(copy, self.params)
        examples = self.task.load(split=config.task.train_split, options=self.task_options, seed=config.train.seed)
        # A task with environments (tools) rolls out conversations; None: single-turn.
        self.conversations = Conversations.of(
            self.task, self.task_options, self.policy.tokenizer, examples[0],
            tool_format=family_of(model.config).tool_call_format, timeout_s=config.rollout.tool_timeout_s,
        ) if examples else None
        # Every jitted program of a step comes from the one builder `grpo plan` compiles.
        # The trainer's programs' engines read the LoRA base where it is; a rollout mesh's
        # get it from the weight sync, which moves it there once.
        def programs_on(mesh, layout, topology, frozen=None):
            return build_programs(
                config, mesh=mesh, layout=layout, graphdef=self.graphdef,
                eos_ids=self.policy.eos_ids, pad_id=self.policy.pad_id, plugins=self.plugins,
                arch=model.config, topology=topology, state=state, chip=chip_of(mesh.devices.flat[0]),
                detokenize=self.policy.decode, conversations=self.conversations, frozen=frozen,
            )

        self.programs = programs_on(self.mesh, self.layout, self.topology, self.frozen)
        # Async: the rollout's programs on the rollout mesh, from the same builder.
        rollout_programs = self.programs if self.meshes is None else programs_on(
            self.meshes.rollout.mesh, self.meshes.rollout.layout, self.meshes.rollout.topology)
        if self.is_main and rollout_programs.rollout.resharded:
            log.info("rollout layout: %s", rollout_programs.rollout.describe())
        self.opt_state = self.programs.init_opt_state(self.params)
        self.render = self._renderer()
        self.buckets = config.rollout.prompt_buckets or default_buckets(config.rollout.max_prompt_length)
        self.collector = StepCollector(
            config, rollout_programs, rollout_programs.sampler(), task=self.task, task_options=self.task_options,
            prompts=tokenize_prompts(examples, self.render, self.policy.tokenizer,
                                     max_prompt_length=config.rollout.max_prompt_length,
                                     split=config.task.train_split),
            buckets=self.buckets, pad_id=self.policy.pad_id,
        )
        self.update = self.programs.update(self.params, self.opt_state)
        # The reference pass runs micro-batch by micro-batch through the loss plugin's own
        # log-prob path (fused for pallas): never the whole step's [B, N, V] logits.
        self.ref_logprobs = self.programs.reference() if self.ref_params is not None else None
        self.policy_logprobs = self.programs.policy_logprobs()  # LoRA dropout only
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=config.checkpoint.keep)
        self.step = 0
        self.data_position = 0  # prompts drawn so far in the data order (more with dynamic sampling)
        self.skipped_nonfinite = 0
        self.reward_errors: dict[str, int] = {}
        self.reward_failures = RewardFailures(self._write_reward_failure if self.is_main else None, where=str(
            self.run_dir / LOG_NAME), judges=[e.name for e in config.task.model_rewards if e.kind == "judge"])
        self._signal: int | None = None
        # Split by processes, the rollout side evaluates, on its mesh at the weights it was sent.
        by_processes = self.meshes is not None and len(
            {d.process_index for side in (self.meshes.rollout, self.meshes.update) for d in side.mesh.devices.flat}) > 1
        self.evaluator = Evaluator(
            config, rollout_programs if by_processes else self.programs, task=self.task,
            task_options=self.task_options, policy=self.policy, render=self.render, buckets=self.buckets,
        )
        self._packing: tuple[Any, Any] | None = None  # this step's (PackPlan, Placement) when packed
        self._pending: Any = None  # the packed passes' compile ahead while it runs (schedule.Pending)
        self._ahead: dict[str, float] | None = None  # its figures once done
        self._samples: rundir.JsonlLog | None = None
        self._logger: MetricsLogger | None = None
        # The step's loop for this run's mode (a rollout source x a weight sync).
        self.loop = build_loop(self, rollout_programs)

    def frozen_on(self, mesh: Any) -> Any:
        """The frozen LoRA base built again on ``mesh`` (the rollout side of a run split by
        processes, whose processes hold none of the update mesh's): the same config and
        seed give the same base, so it never crosses processes."""
        return split_params(nnx.split(build_model(self.config.model, mesh, seed=self.config.train.seed))[1])[1]

    def _renderer(self):
        """An example's prompt text: a multi-turn task's opening messages through the chat
        template with its tools, else the task's own prompt rendering."""
        if self.conversations is not None:
            return self.conversations.prompt
        from grpo.engine.rollout.prompts import render_prompt

        tok = self.policy.tokenizer
        return lambda ex: render_prompt(self.task, self.task_options, ex, tok)

    # ------------------------------------------------------------------ the step's stages

    def policy_params(self) -> Any:
        """What the evaluation's engine reads for the current weights, taken in through its
        ``update_weights`` (the one way in): the whole model's state (base and adapters,
        no copies), or for ``model.lora.sampler: merged`` the projections with the
        adapters merged in. The engine drops its prepared copy: the caller's is the only one."""
        engine = self.programs.eval_sampler()
        engine.update_weights(self.params, self.step)
        try:
            return engine.weights
        finally:
            engine.release()

    def advantages(self, rollout: StepRollout) -> jax.Array:
        """The rows' advantages: [B] group advantages of their total rewards, or with
        ``train.advantage.credit: turn`` per-token [B, N] turn-level ones; exactly 0 on
        the rows of groups filling a short dynamic-sampling step, whatever the credit."""
        adv = self.config.train.advantage
        if adv.credit == "turn":
            out = self.programs.turn_advantages(rollout.rewards_by_fn, rollout.trained)
        else:
            out = group_advantages(rollout.rewards, num_generations=self.config.group_size, baseline=adv.baseline,
                                   scale=adv.scale, epsilon=adv.epsilon)
        if rollout.filler is not None:
            out = jnp.where(rollout.filler if out.ndim == 1 else rollout.filler[:, None], 0.0, out)
        return out

    def selection_scalars(self, rollout: StepRollout, advantages: jax.Array) -> dict[str, jax.Array]:
        """Device scalars of what the update trains on, when the step selected groups or
        samples (:attr:`StepRollout.informative`): ``advantage/informative_groups``, the
        batch's groups whose advantages are not all zero on their trained tokens (the one
        definition: :func:`informative_groups`), and with down-sampling
        ``down_sampling/degenerate_groups``, groups informative over all their samples
        that train with all-zero advantage on the subset kept."""
        if rollout.informative is None:
            return {}
        k = self.config.group_size
        trained = informative_groups(advantages, rollout.trained, num_generations=k)  # G
        before = rollout.informative.reshape(-1, k)[:, 0]  # G: a group's rows share its verdict
        out = {"advantage/informative_groups": jnp.sum(trained.astype(jnp.int32))}
        if self.config.train.down_sampling.keep is not None:
            out["down_sampling/degenerate_groups"] = jnp.sum((before & ~trained).astype(jnp.int32))
        return out

    def row_batch(self, rollout: StepRollout, advantages: jax.Array) -> UpdateBatch:
        """The rollout in the update's row layout (one sequence a row), with the step's
        LoRA-dropout keys: what :meth:`update_batch` packs."""
        cfg, out, to_train = self.config, rollout.output, self.programs.to_train
        ub = UpdateBatch(
            prompt_tokens=to_train(out.prompt_tokens),
            prompt_mask=to_train(out.prompt_mask),
            tokens=to_train(out.tokens),
            mask=to_train(out.mask),
            advantages=to_train(advantages),
            old_logprobs=None,
            ref_logprobs=None,
            # The behaviour policy's (top-k/top-p truncated): what drew the tokens.
            sampler_logprobs=to_train(out.behaviour) if cfg.loss.mismatch is not None else None,
            truncated=to_train(out.truncated) if cfg.loss.mask_truncated else None,
            loss_mask=None if out.loss_mask is None else to_train(out.loss_mask),
            # MoE with model.moe.router_replay on: the sampler's experts, replayed or compared
            routed_experts=None if out.routed_experts is None else to_train(out.routed_experts),
        )
        # Every PPO epoch of the step uses the same dropout masks as the log-probs its
        # ratio divides by, so at unchanged parameters the ratio is exactly 1.
        return ub._replace(dropout_keys=self.programs.dropout_keys(self.step, ub.tokens.shape[0]))

    def update_batch(self, rollout: StepRollout, advantages: jax.Array) -> UpdateBatch | PackedBatch:
        """The rollout in the update's layout, with the reference log-probs (``beta > 0``)
        and the step's LoRA-dropout keys: rows, or with packing the step's sequences in
        bins (every pass then runs on the bins)."""
        ub = self.row_batch(rollout, advantages)
        self.compiled_ahead()  # the packed passes' executables, compiled ahead (while step 1 rolled out)
        self._packing = None
        if self.programs.packing:
            plan = self.programs.pack_plan(ub)
            ub, place = self.programs.pack(ub, plan)
            self._packing = (plan, place)
        if self.ref_logprobs is not None:
            ub = ub._replace(ref_logprobs=self.ref_logprobs(self.ref_params, ub, self.frozen))
        return ub

    def row_logprobs(self, logprobs: jax.Array, shape: tuple[int, int]) -> jax.Array:
        """Per-token log-probs in the rollout's row layout [B, N] (unpacked when packed)."""
        if self._packing is None:
            return logprobs
        return self.programs.unpack(logprobs, self._packing[1], rows=shape[0], length=shape[1])

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

    def optimize(self, ub: UpdateBatch | PackedBatch) -> tuple[list[dict[str, Any]], jax.Array]:
        """``train.ppo_epochs`` updates on the batch: each epoch's metrics, and the
        trainer's log-probs of the sampled tokens under the pre-update policy (dropout-free
        with LoRA dropout)."""
        trainer_logprobs, ub = self._behaviour_logprobs(ub)
        epoch_metrics = []
        for epoch in range(self.config.train.ppo_epochs):
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
        return epoch_metrics, trainer_logprobs  # in ub's layout: bins when packed

    def observe_rewards(self, rollout: StepRollout) -> dict[str, float]:
        """The step's reward failures, read as soon as the rows are scored and before
        anything trains on them: counted in ``reward_errors``, each function's first
        failure reported once, and the run stopped (a UserError, exit 2) when a function
        failed on every row the step scored, so no update ever trains on a reward that was
        never computed. Returns the step's ``reward/<name>/not_applicable`` metrics (those
        not 0), for :meth:`metrics_row`."""
        errors, counts = jax.device_get((rollout.reward_errors, rollout.reward_counts))
        for name, n in zip(rollout.reward_names, errors):  # over every process's rows
            self.reward_errors[name] = self.reward_errors.get(name, 0) + int(n)
        return self.reward_failures.observe(self.step + 1, rollout.reward_names, errors, counts,
                                            rollout.first_errors)

    def metrics_row(self, rollout: StepRollout, epochs: list[dict[str, Any]], trainer_logprobs: jax.Array,
                    times: dict[str, float], selection: dict[str, jax.Array] | None = None,
                    not_applicable: dict[str, float] | None = None) -> dict[str, Any]:
        """The step's metrics row (read back from the devices in one transfer);
        ``selection``: :meth:`selection_scalars`; ``not_applicable``: what
        :meth:`observe_rewards` returned for the step."""
        cfg = self.config
        tools = rollout.tools
        # Under loss.truncated_policy the trainer's log-probs compare with the behaviour ones.
        rollout_row = rollout_scalars(rollout, trainer_logprobs, truncated=cfg.loss_settings.truncates)
        scalars, tool_totals, selected = jax.device_get((rollout_row, tools and tools.counts, selection or {}))
        extra = {
            **rollout.metrics,
            **(not_applicable or {}),
            **{k: float(v) for k, v in selected.items()},
            "skipped_nonfinite_steps": self.skipped_nonfinite,
            "reward_errors": sum(self.reward_errors.values()),
            # Read from the optimizer's own count: the rate its updates applied.
            "learning_rate": applied_learning_rate(self.programs.lr_schedule, self.opt_state),
        }
        if self._packing is not None:
            extra.update(packing_stats(self._packing[0]))
        update = epoch_summary(jax.device_get(epochs), off_policy_prefixes=(f"{cfg.loss.objective}/",))
        row = step_row(self.step, {k: float(v) for k, v in scalars.items()}, update,
                       objective=cfg.loss.objective, extra=extra, times=times)
        if tools is not None:
            # Over every row rolled out this step (every round of dynamic sampling).
            row.update(tool_metrics(tool_totals, tools.rows))
            # This process's host time: the environments' steps, and rendering + appends.
            row["time/train/tools_s"] = tools.tools_s
            row["time/train/append_s"] = tools.append_s
        row.update(device_memory_metrics(jax.local_devices()))
        return row

    def _write_samples(self, group: SampleGroup, step: int | None = None) -> None:
        """The first prompt's group of completions, for reading what the policy does; in a
        multi-turn rollout each completion's ``turns`` ``[{role, text, trained}]`` too
        (environment replies: ``trained: false``)."""
        row: dict[str, Any] = {
            "step": (self.step if step is None else step) + 1,
            "prompt": self.render(group.example),
            "completions": group.texts,
            "rewards": [round(float(r), 4) for r in group.rewards],
        }
        if group.completion_lengths is not None:
            # Tokens, for `grpo plan --lengths samples.jsonl` (a length profile of the run).
            row["completion_lengths"] = group.completion_lengths
            row["prompt_length"] = group.prompt_length
        if group.turns is not None:
            row["turns"] = group.turns
        if self._samples is None:
            self._samples = rundir.JsonlLog(self.run_dir, "samples.jsonl")
        self._samples.append(row)

    def _write_reward_failure(self, row: dict[str, Any]) -> None:
        failures = rundir.JsonlLog(self.run_dir, LOG_NAME)
        failures.append(row)
        failures.flush()

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

    def _compile_summary(self, startup: compiles.Compiles | None) -> dict[str, Any]:
        """``summary.json``'s compiles: at start-up (set-up through this session's first
        step: what a rerun or resume loads from the persistent cache) and in the whole
        session, and the cache's directory."""
        total = self.compiles.total()
        return {"startup": (startup or total).summary(), "total": total.summary(), "cache_dir": self.cache_dir}

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
        # The state as the loop's source holds it, with the rollouts drawn and not yet trained.
        items, meta = self.loop.saved(self._state(), self._meta())
        self.checkpointer.save(self.step, items, meta)
        if self.is_main:
            log.info("checkpoint saved at step %d in %s", self.step, self.checkpointer.directory)

    def maybe_resume(self) -> bool:
        latest = self.checkpointer.latest_step()
        if latest is None:
            if self.is_main:
                print(f"Starting fresh: no checkpoint in {self.checkpointer.directory}", flush=True)
            return False
        try:
            state, meta = self.checkpointer.restore(self.loop.held_like(self._state()), latest)  # params, opt_state
        except Exception as err:  # noqa: BLE001 - Orbax reports a shape mismatch as ValueError with a traceback
            if identity.is_shape_mismatch(err):
                raise identity.incompatible_checkpoint(self.run_dir, self.config, latest, err) from None
            raise
        state = self.loop.placed(state, self._state())
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.step = int(meta["step"])
        self.data_position = int(meta.get("data_position", self.step * self.config.train.prompts_per_step))
        self.skipped_nonfinite = int(meta.get("skipped_nonfinite_steps", 0))
        self.reward_errors = dict(meta.get("reward_errors", {}))
        # The loop's ledger and the rollouts buffered when it was saved.
        self.loop.restore(meta, lambda name, like: self.checkpointer.restore({name: like}, latest)[0][name])
        if self.is_main:
            print(f"Resuming from the checkpoint at step {self.step} in {self.checkpointer.directory}", flush=True)
        return True

    # ------------------------------------------------------------------ loop

    def train_step(self) -> dict[str, Any]:
        """One GRPO step, as the data flows: collect (roll out and score) -> advantages ->
        update batch -> optimizer steps -> metrics row; the loop
        (:class:`~grpo.engine.loop.loop.Loop`) runs it for every mode, calling the stages
        above."""
        if self._pending is not None:  # the rollout's programs, compiled ahead (the packed passes go on)
            self._pending.wait(lambda name: name != "packed")
        return self.loop.step()

    def evaluate(self) -> dict[str, Any]:
        if self._pending is not None:  # its programs, compiled ahead
            self._pending.wait(lambda name: name.startswith("eval_"))
        return self.loop.evaluate(self.evaluator, self.step, self.params)

    def compile_ahead(self) -> Any:
        """Start compiling the run's shape schedule (``train.compile.ahead``; :mod:`grpo.engine.schedule`)
        on background threads, in parallel, with a progress line: with ``all`` and ``auto``
        the rollout engine's programs and the glue at every prompt width the run's steps
        take, evaluation's at the eval split's (:meth:`_rollout_shapes`), and every packed
        shape at those widths (the longest compile, a chain holding the update, first:
        :func:`~grpo.engine.schedule.submission_order`); ``first`` the widest packed shape;
        ``lazy`` nothing. Step 1 rolls out once the rollout's are compiled
        (:meth:`train_step`), and its first packed pass waits for the rest
        (:meth:`update_batch`). Returns the :class:`~grpo.engine.schedule.Pending` compile,
        or None when nothing compiles ahead."""
        from grpo.engine.schedule import packed_shapes, start_compile, submission_order

        mode = self.config.train.compile.ahead
        rollout = self._rollout_shapes() if mode in ("all", "auto") else []
        packed = packed_shapes(self.programs, params=self.params, opt_state=self.opt_state, frozen=self.frozen,
                               ref_params=self.ref_params, first=mode == "first", widths=self._train_widths()
                               ) if mode != "lazy" and self.programs.packing else []
        shapes = submission_order(rollout, packed)
        if not shapes:
            return None
        return start_compile(shapes, progress=log.info if self.is_main else (lambda _: None))

    def _rollout_shapes(self) -> list[Any]:
        """The rollout engine's programs and the glue at each prompt width the train split's
        prompts reach, and (with evaluation) the eval engine's at the eval split's width
        for its batch: every shape a step or an evaluation gives them, known from the data
        before step 1 (:func:`~grpo.engine.schedule.rollout_shapes`)."""
        from grpo.engine.rollout.prompts import bucket_for
        from grpo.engine.schedule import engine_weights, rollout_shapes

        cfg, programs = self.config, self.programs
        every, steps = cfg.eval.every_n_steps, cfg.train.steps
        # A session of one step reaches one width (its own, compiled as it comes); an
        # evaluation runs at start or at a multiple of eval.every_n_steps still to come.
        train = steps - self.step > 1
        evals = bool(every) and (steps // every > self.step // every or (cfg.eval.at_start and self.step == 0))
        engine = programs.sampler()
        weights = engine_weights(programs, engine, params=self.params, frozen=self.frozen) if train or evals else None
        if weights is None:  # nothing to list, or a rollout side of its own (its weights arrive by the sync)
            return []
        widths = self._train_widths() if train else ()
        shapes = rollout_shapes(programs, engine, weights=weights, prompts=cfg.train.prompts_per_step, widths=widths,
                                key=jax.random.key(cfg.train.seed))
        if evals:
            prompts, evaluator = self.evaluator.prepare()
            size = programs.eval_batch(len(prompts))[1]
            width = bucket_for(max(len(t) for t in prompts.token_ids), self.buckets)
            if not (evaluator is engine and size == cfg.train.prompts_per_step and width in widths):
                shapes += rollout_shapes(programs, evaluator, weights=weights, prompts=size, widths=(width,),
                                         key=jax.random.key(cfg.train.seed + 1), prefix="eval_", glue=False)
        return shapes

    def _train_widths(self) -> tuple[int, ...]:
        """The prompt widths the session's remaining steps' batches take, narrowest first:
        each step's own prompts from the data order (exactly, :func:`~grpo.engine.schedule.step_widths`),
        or with dynamic sampling or partial rollouts (a step may feed more than its
        prompts) any width the train split reaches."""
        from grpo.engine.schedule import reachable_widths, step_widths

        token_ids, a = self.collector.prompts.token_ids, self.config.train
        if a.dynamic_sampling.enabled or a.async_.partial_rollouts:
            return reachable_widths(token_ids, self.buckets)
        return step_widths(token_ids, self.buckets, position=self.data_position, steps=a.steps - self.step,
                           prompts=a.prompts_per_step, seed=a.seed)

    def compiled_ahead(self) -> dict[str, float] | None:
        """The ahead-of-time compile's figures once it finished (waits for it; None: none ran)."""
        if self._pending is not None:
            self._ahead, self._pending = self._pending.wait(), None
        return self._ahead

    def run(self) -> dict[str, Any]:
        cfg = self.config
        resumed = self.maybe_resume()
        if self.is_main:
            rundir.mkdir(self.run_dir)
            # Never overwrites the config that trained earlier steps (grpo.engine.runs.identity).
            identity.record(self.run_dir, cfg, step=self.step if resumed else None)
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
        self.compiles.on_start = logger.compiling
        self._install_signal_handlers()
        t_start = time.perf_counter()
        first_step = self.step
        last_row: dict[str, Any] = {}
        eval_rows: list[dict[str, Any]] = []
        startup: compiles.Compiles | None = None
        try:
            self._pending = self.compile_ahead()
            if cfg.eval.every_n_steps:
                self.evaluator.prepare()  # an eval split with no usable prompt stops the run now
            if cfg.eval.every_n_steps and cfg.eval.at_start and self.step == 0:
                ev = self.evaluate()  # the untrained policy: where the eval curve starts
                eval_rows.append(ev)
                logger.log_eval(ev)
            while self.step < cfg.train.steps:
                self.compiles.read()  # set-up, evaluations, checkpoints: not the step's
                host = time.thread_time()
                row = self.train_step()
                # This thread's CPU time in the step: Python, dispatch, host transfers, scoring
                # (a background rollout's thread is not in it; on CPU devices XLA's work is).
                row["time/train/host_s"] = time.thread_time() - host
                row.update(self.compiles.read().metrics())  # 0 on a warm step
                startup = startup or self.compiles.total()  # set-up through this session's first step
                # Step 1 compiled the glue; every later compile of the builder's programs is
                # outside the schedule (compiled ahead: all of it), warned of and counted.
                row["compile/out_of_list"] = float(self.programs.watch.take())
                self.programs.watch.armed = cfg.train.compile.ahead in ("all", "auto")
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
            self.compiles.on_start = None
            self.loop.close()
            self.collector.scorer.close()  # the reward processes (threads end on their own)
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
            "compile": self._compile_summary(startup),
            "compiled_ahead": self.compiled_ahead(),
        }
        if self.is_main:
            rundir.write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2, default=float))
            if cfg.logging.plot:
                from grpo.engine.rollout.scoring import run_reward_weights

                plot_run(self.run_dir, weights=run_reward_weights(cfg, self.task, self.task_options))
        self.checkpointer.close()
        return summary


def default_run_dir(config: RunConfig, config_path: str | None, *, name: str | None = None) -> Path:
    """``runs/<name>-<timestamp>``: ``name``, else ``config.name`` or the config file's stem
    (:func:`grpo.api.run_name` gives the name ``grpo run`` and ``grpo.train`` use)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        # Every process must agree on the directory: use process 0's clock.
        t = int(multihost_utils.broadcast_one_to_all(np.int64(int(time.time()))))
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(t))
    name = name or config.name or (Path(config_path).stem if config_path else "run")
    return Path("runs") / f"{name}-{stamp}"


__all__ = ["Interrupted", "Trainer", "default_run_dir"]
