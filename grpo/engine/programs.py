"""The jitted programs of a run, built in one place from (config, mesh, state).

``grpo run`` (the :class:`~grpo.engine.trainer.Trainer`) executes them on real arrays and
``grpo plan`` lowers and compiles the very same jitted functions on abstract state
(``jax.ShapeDtypeStruct`` with the real shardings) for a TPU topology it does not have.
``grpo bench rollout`` makes a run config of its flags and times this builder's sampler,
and ``grpo bench loss`` times
:func:`~grpo.engine.training.update.loss_program`, the loss called the way the update
calls it. Keeping one builder is the point: a plan or a bench that measured something
other than what runs would be worse than none.

The programs of one GRPO step, in the order they run (``grpo plan`` lists exactly these:
``tests/test_architecture.py`` runs a step and compares):

- ``reshard`` (a rollout style with its own layout, ``serving``) or ``merge`` (LoRA with
  ``model.lora.sampler: merged`` on the training layout): the policy as the sampler
  reads it, once per step (:meth:`RunPrograms.prepare_weights`, which the engine applies
  to the weights of its ``update_weights`` when a draw first reads them);
- the sampler's own (:meth:`~grpo.engine.rollout.sampler.BaseSampler.lowerings`):
  ``prefill`` of the step's prompts (``train.prompts_per_step`` x the largest prompt
  bucket), cache repeated K times; ``decode``, the KV-cache decode loop up to
  ``rollout.max_new_tokens``; for a multi-turn task (tools,
  :class:`~grpo.engine.rollout.multiturn.MultiTurnSampler`) ``start`` (the cache grown
  to its final size), ``decode`` as one turn's loop, run once per turn, and ``append``,
  the environment's replies written into every row's cache between turns; with
  ``rollout.engine: continuous``
  (:class:`~grpo.engine.rollout.continuous.ContinuousSampler`) ``start`` (the empty page
  pool and slots), ``prefill`` (queued rows into free slots, run at chunk boundaries) and
  ``decode`` (one chunk of decode steps over the paged cache, run until every row stops);
  for a multi-turn task on it
  (:class:`~grpo.engine.rollout.continuous_multiturn.ContinuousMultiTurnSampler`)
  ``start``, ``append`` (queued rows' prompts, or a turn's replies appended into the
  row's own pages, at chunk boundaries), ``decode`` (one chunk of the slots' turns) and
  ``read`` (the turns finished at a boundary, read for the host's environments);
- the step's glue (:meth:`RunPrograms.step_lowerings`): ``row_sums`` (reward-error and
  tool counters over every process's rows), ``gather_rows`` (the rows trained on,
  gathered from the rounds: dynamic sampling, down-sampling), ``turn_advantages``
  (``train.advantage.credit: turn``), ``to_train`` (the batch resharded to the update's
  row layout), ``dropout_keys`` (LoRA dropout);
- ``reference``: the reference model's per-token log-probs (only when ``loss.beta > 0``);
- ``policy_logprobs``: the policy's dropout-free per-token log-probs (only with LoRA
  dropout; once more under the step's dropout masks with ``loss.mismatch``);
- ``update``: :class:`~grpo.engine.training.update.UpdateStep` — the loss plugin over
  ``train.micro_batch_size`` micro-batches with the model's remat policy, then the
  optimizer step (params and optimizer state donated). Packed, the step's own micro-batch
  schedule (:meth:`RunPrograms.pack_plan`): one compile per bins-per-device width and
  head width on the run's grid (:attr:`RunPrograms.shape_grid`), every one of them listed
  and compiled ahead of step 1 by :mod:`grpo.engine.schedule` (``train.compile.ahead``).

Where the rollout runs is the rollout style's choice (:mod:`grpo.engine.rollout.layout`):
on the training layout (``legacy``, ``maxtext``), or in the style's own layout
(``serving``). Every ``eval.every_n_steps`` steps, evaluation
(:mod:`grpo.engine.evaluation`) runs the same sampler's programs (``eval_prefill``,
``eval_decode``, ...) with ``eval.k`` samples per prompt on batches of
:meth:`RunPrograms.eval_batch` prompts. The trainer and the evaluator jit nothing
themselves.

The builder only wires these pieces and caches the jitted programs by name; the math
lives in the rooms: the sampler built through the ``rollout.engine`` plugin
(:mod:`grpo.engine.rollout.engines`), where the rollout runs and the weights it reads
(:mod:`grpo.engine.rollout.weights`), ``Sampler`` and ``UpdateStep``, the advantages'
host-side math (:mod:`grpo.engine.training.advantages`) and the pack programs
(:mod:`grpo.engine.training.packing`). The abstract state ``grpo plan`` lowers them on is
:mod:`grpo.engine.planning.shapes`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from grpo.core.config import RunConfig, select_plugins
from grpo.core.contracts import MeshLayout
from grpo.engine.schedule import ShapeWatch


def eval_batch_size(prompts: int, *, k: int, shards: int, processes: int) -> int:
    """Rows of one compiled evaluation batch holding ``prompts`` real prompts: the
    smallest size >= ``prompts`` that splits into whole prompts per process and whose
    ``size x k`` sampled rows split evenly over the rollout shards (the extra rows are
    padding whose results are dropped). The prompts themselves need not divide the
    shards: prefill splits them over the part of the shards they divide (replicated at
    worst), and decode splits their ``k`` samples."""
    unit = math.lcm(processes, shards // math.gcd(shards, k))
    return math.ceil(prompts / unit) * unit


@dataclasses.dataclass
class RunPrograms:
    """The jitted programs of a run and the pieces they are made of."""

    config: RunConfig
    mesh: Mesh
    layout: MeshLayout
    graphdef: Any
    plugins: dict[str, Any]
    batch_axes: tuple[str, ...]
    optimizer: Any
    lr_schedule: Any  # the optimizer's schedule: learning rate of an update count
    update_step: Any  # grpo.engine.training.update.UpdateStep (not jitted)
    eos_ids: tuple[int, ...]
    pad_id: int
    rollout: Any = None  # grpo.engine.rollout.layout.RolloutPlacement
    # The run's text side (None in `grpo plan` and benchmarks, which sample no text): the
    # single-turn rows' detokenizer (Policy.decode), or a multi-turn task's conversations.
    detokenize: Any = None
    conversations: Any = None  # grpo.engine.rollout.conversations.Conversations
    # The frozen LoRA base on this builder's mesh (None: no LoRA), which the weight
    # preparation reads beside the trained adapters (:meth:`prepare_weights`): the
    # trainer's for its own programs, the weight sync's copy on a rollout mesh.
    frozen: Any = None
    # Whether the passes over a finished batch run packed (train.packing.enabled and a loss
    # that supports it; decided once by build_programs).
    packing: bool = False
    _samplers: dict = dataclasses.field(default_factory=dict)
    _jitted: dict = dataclasses.field(default_factory=dict)  # name -> jitted program, built on first use
    # Warns of a compile outside the run's shape schedule once armed (grpo.engine.schedule).
    watch: ShapeWatch = dataclasses.field(default_factory=ShapeWatch)

    # ------------------------------------------------------------------ shardings

    @property
    def rollout_sharding(self) -> NamedSharding:
        """Rows of the rollout batch (completions, rewards), on the rollout's mesh."""
        return NamedSharding(self.rollout.mesh, P(self.batch_axes))

    def prompt_sharding(self, shape: Sequence[int]) -> NamedSharding:
        """Rows of ``shape``-shaped prompts as prefill takes them: over the rollout batch
        axes they divide (:func:`grpo.sharding.fit_spec`; replicated at worst)."""
        from grpo.sharding import fit_sharding

        return fit_sharding(shape, ("batch", "length"), self.rollout.mesh, self.rollout.activation_rules)

    @property
    def train_sharding(self) -> NamedSharding:
        """Rows of the update batch: (dp, fsdp[, ep]), like the update's activations."""
        from grpo.sharding import data_axes

        return NamedSharding(self.mesh, P(data_axes(self.mesh)))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def process_count(self) -> int:
        """Processes the mesh's devices belong to (the TPU pod's hosts in ``grpo plan``)."""
        return len({d.process_index for d in self.mesh.devices.flat})

    def eval_batch(self, available: int | None = None) -> tuple[int, int]:
        """``(prompts, padded)`` of one evaluation batch: ``eval.batch_size`` prompts (fewer
        when ``eval.num_examples`` or the ``available`` eval prompts are fewer), placed in
        a batch of ``padded`` (:func:`eval_batch_size`) prompts on this mesh. The batches
        hold the same prompts on every mesh; only their padding depends on it."""
        ev = self.config.eval
        prompts = ev.batch_size
        for cap in (ev.num_examples, available):
            if cap is not None:
                prompts = min(prompts, cap)
        mesh = self.rollout.mesh
        shards = math.prod(mesh.shape[a] for a in self.batch_axes)
        return prompts, eval_batch_size(prompts, k=ev.k, shards=shards, processes=self.process_count)

    def eval_sampler(self):
        """The evaluation sampler: greedy or sampled, ``eval.k`` samples per prompt."""
        return self.sampler(greedy=self.config.eval.greedy, num_generations=self.config.eval.k)

    # ------------------------------------------------------------------ programs

    def sampler(self, *, greedy: bool = False, num_generations: int | None = None):
        """The rollout sampler (``grpo run``'s; evaluation asks for greedy / its own k),
        built once per ``(greedy, k)`` by the ``rollout.engine`` plugin
        (:func:`grpo.engine.rollout.engines.build_sampler`): a :class:`grpo.RolloutEngine`."""
        from grpo.engine.rollout.engines import build_sampler

        r = self.config.rollout
        k = r.num_generations if num_generations is None else num_generations
        key = (greedy, k)
        if key not in self._samplers:
            self._samplers[key] = build_sampler(
                self.config, placement=self.rollout, graphdef=self.graphdef, plugins=self.plugins,
                eos_ids=self.eos_ids, pad_id=self.pad_id, multi_turn=self.multi_turn,
                lora_adapters=not self.merged_sampling, detokenize=self.detokenize,
                conversations=self.conversations, greedy=greedy, num_generations=k, prepare=self.prepare_weights,
            )
            engine = self._samplers[key]
            if key == (False, r.num_generations) and getattr(engine, "quantize_jit", None) is not None:
                # The once-per-sync quantize runs at each step's sync: watched like the step's glue.
                engine.quantize_jit = self.watch.wrap("quantize", engine.quantize_jit)
        return self._samplers[key]

    @property
    def multi_turn(self) -> bool:
        """Whether the run rolls out conversations: it has a multi-turn task's
        conversations, or (``grpo plan``, which has none) its task gives tools for its
        options. A task with an environment of its own and no tools shows only on an
        example: the trainer probes one
        (:meth:`~grpo.engine.rollout.conversations.Conversations.of`)."""
        if self.conversations is not None:
            return True
        task = self.plugins.get("task") if self.plugins else None
        return task is not None and bool(task.plugin.tools(options=task.options))

    @property
    def merged_sampling(self) -> bool:
        """LoRA with ``model.lora.sampler: merged``: the rollout reads projections with the
        adapters merged in (once per step), not base + adapters."""
        lora = self.config.model.lora
        return lora is not None and lora.sampler == "merged"

    def prepare_weights(self, params: Any) -> Any:
        """What this builder's engines read for trained ``params`` beside the frozen base
        :attr:`frozen` (:func:`grpo.engine.rollout.weights.sampler_state`): the state as
        is, LoRA merged (``merge``), or copied into a rollout style's own layout
        (``reshard``). The engines' weight preparation
        (:attr:`grpo.RolloutEngine.prepare`): only an engine calls it, when a draw first
        reads the weights of its ``update_weights``."""
        from grpo.engine.rollout.weights import sampler_state

        frozen = self.frozen
        return sampler_state(params, frozen, resharded=self.rollout.resharded, merging=self._merging(frozen),
                             reshard=self.reshard_jit, merge=self.merge_jit)

    def reshard_jit(self, state: Any):
        """The jitted once-per-step reshard into the rollout layout
        (:func:`grpo.engine.rollout.weights.reshard_program`): ``fn(state)``, or
        ``fn(params, frozen)`` merging LoRA adapters on the way (``merged_sampling``).
        ``state``: the full sampler state (concrete or abstract), for its shardings."""
        from grpo.engine.rollout.weights import reshard_program

        merging = self.merged_sampling and self.config.model.lora is not None
        return self._program("reshard", lambda: reshard_program(self.rollout, self.graphdef, state, merging=merging))

    def merge_jit(self, state: Any):
        """The jitted LoRA merge of ``model.lora.sampler: merged`` on the training layout
        (:func:`grpo.engine.rollout.weights.merge_program`): ``fn(params, frozen)``."""
        from grpo.engine.rollout.weights import merge_program

        return self._program("merge", lambda: merge_program(self.graphdef, state))

    def _merging(self, frozen: Any) -> bool:
        return frozen is not None and self.merged_sampling

    def _program(self, name: str, build: Any) -> Any:
        """The jitted program ``name``, built by ``build()`` on first use (one per run)."""
        if name not in self._jitted:
            self._jitted[name] = self.watch.wrap(name, build())
        return self._jitted[name]

    def jitted(self) -> dict[str, list[Any]]:
        """Every jitted program built so far, by the name ``grpo plan`` lists it under:
        this builder's own and its samplers' (evaluation's as ``eval_<name>``)."""
        out: dict[str, list[Any]] = {name: [fn] for name, fn in self._jitted.items()}
        training = (False, self.config.rollout.num_generations)
        evaluation = (self.config.eval.greedy, self.config.eval.k)
        for key, sampler in self._samplers.items():
            # A sampled evaluation with the rollout's k shares the training sampler.
            prefixes = [p for p, of in (("", training), ("eval_", evaluation)) if key == of]
            for name, fns in sampler.jitted().items():
                for prefix in prefixes:
                    out.setdefault(prefix + name, []).extend(fns)
        return out

    # ------------------------------------------------------------------ the step's glue programs

    def to_train(self, x: jax.Array) -> jax.Array:
        """A rollout-layout batch array resharded to the update's (dp, fsdp) row layout
        (a jitted identity: it works for arrays spanning several processes)."""
        return self._to_train_jit()(x)

    def _to_train_jit(self) -> Any:
        return self._program("to_train", lambda: jax.jit(lambda a: a, out_shardings=self.train_sharding))

    def row_sums(self, x: jax.Array) -> jax.Array:
        """Column sums [C] of a batch-sharded global array [B, C], replicated on every
        process (the step's reward-error and tool counters, each process's rows summed)."""
        return self._row_sums_jit()(x)

    def _row_sums_jit(self) -> Any:
        return self._program("row_sums", lambda: jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=self.replicated))

    def dropout_keys(self, step: int, rows: int) -> jax.Array | None:
        """One LoRA-dropout key per row of step ``step`` (raw key data [rows, 2], in the
        update's layout; None without dropout), derived from (seed, step): a resumed run
        draws the same masks."""
        if not self.lora_dropout:
            return None
        return self._dropout_keys_jit(rows)(jnp.int32(step))

    def _dropout_keys_jit(self, rows: int) -> Any:
        seed = self.config.train.seed

        def make(step):
            base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0xD80), step)
            return jax.random.key_data(jax.random.split(base, rows))

        return self._program("dropout_keys", lambda: jax.jit(make, out_shardings=self.train_sharding))

    def turn_advantages(self, per_fn: dict[str, jax.Array], own: jax.Array) -> jax.Array:
        """Per-token advantages [B, N] of turn-level credit (``train.advantage.credit:
        turn``): the rewards (global [B] each, by name) summed by weight into one component
        per scope (the task's ``reward_turns``, then ``train.advantage.reward_turns``;
        ``task.overlong``'s penalty credits every turn), each component's group advantage
        on the model turns it scores (``own``: the model's tokens [B, N]), in ``own``'s
        sharding. The scopes and weights are read when the program is built (a run's
        rewards never change)."""
        return self._turn_advantages_jit(list(per_fn), own.sharding)(per_fn, own)

    def _turn_advantages_jit(self, names: list[str], sharding: Any) -> Any:
        return self._program("turn_advantages", lambda: self._build_turn_advantages(names, sharding))

    def turn_components(self, per_fn: dict[str, Any]) -> dict[str, Any]:
        """The rewards (each [B], by name) summed by weight into one component per scope
        of turn-level credit (the task's ``reward_turns``, then
        ``train.advantage.reward_turns``; ``task.overlong``'s penalty credits every turn):
        :func:`~grpo.engine.training.advantages.turn_components` with this run's scopes
        and weights."""
        from grpo.engine.rollout.scoring import OVERLONG, reward_weights
        from grpo.engine.training.advantages import turn_components

        task = self.plugins["task"]
        scopes = {**task.plugin.reward_turns(options=task.options), **self.config.train.advantage.reward_turns}
        weights = {**reward_weights(task.plugin, task.options), OVERLONG: 1.0}
        return turn_components(per_fn, scopes=scopes, weights=weights)

    def informative_groups(self, totals: Any, per_fn: dict[str, Any], trained: Callable[[], Any], *,
                           num_generations: int) -> np.ndarray:
        """Which groups of these rows are informative, [G] bool, by the update's own
        functions and ``train.advantage`` options: the host-side filter of dynamic
        sampling (:func:`~grpo.engine.training.advantages.informative_groups_of`)."""
        from grpo.engine.training.advantages import informative_groups_of

        return informative_groups_of(totals, per_fn, trained, advantage=self.config.train.advantage,
                                     num_generations=num_generations, components=self.turn_components)

    def scope_components(self, per_fn: dict[str, Any]) -> dict[str, Any]:
        """:meth:`turn_components` in scope order (all, first, last): what down-sampling
        ranks a group with equal totals by."""
        from grpo.engine.training.advantages import in_scope_order

        return in_scope_order(self.turn_components(per_fn))

    def _build_turn_advantages(self, names: list[str], sharding: Any) -> Any:
        from grpo.engine.training.advantages import turn_advantages

        adv = self.config.train.advantage

        def turn_adv(per_fn, own):
            components = self.turn_components({n: per_fn[n] for n in names})
            return turn_advantages(components, own, num_generations=self.config.group_size,
                                   baseline=adv.baseline, scale=adv.scale, epsilon=adv.epsilon)

        return jax.jit(turn_adv, out_shardings=sharding)

    def gather_rows(self, outs: Sequence[Any], rows: np.ndarray) -> Any:
        """One rollout of global ``rows`` [B] (host indices, the same on every process) of
        the rounds ``outs`` (rollout outputs) stacked in order, prompts left-padded to the
        widest round's, in the update's row layout. A jitted gather with replicated
        indices: the rows a process trains on may have been sampled on another."""
        rows = np.asarray(rows).astype(np.int32)
        rows = jax.make_array_from_callback(rows.shape, self.replicated, lambda idx: rows[idx])
        width = max(o.prompt_tokens.shape[1] for o in outs)
        return self._gather_rows_jit(outs[0])(list(outs), rows, width, self.pad_id)

    def _gather_rows_jit(self, example: Any) -> Any:
        """``example``: a rollout output (concrete or abstract), for the outputs' structure."""

        def gather(outs, rows, width, pad_id):
            def widen(o):
                pad = ((0, 0), (width - o.prompt_tokens.shape[1], 0))  # left, like build_batch
                return o._replace(prompt_tokens=jnp.pad(o.prompt_tokens, pad, constant_values=pad_id),
                                  prompt_mask=jnp.pad(o.prompt_mask, pad))
            stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *[widen(o) for o in outs])
            return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), stacked)

        shardings = jax.tree.map(lambda x: self.train_sharding if x.ndim else self.replicated, example)
        return self._program("gather_rows", lambda: jax.jit(gather, static_argnums=(2, 3), out_shardings=shardings))

    # ------------------------------------------------------------------ packing

    @property
    def update_devices(self) -> int:
        """The devices the update's rows (and bins) split over: dp x fsdp (x ep)."""
        from grpo.sharding import data_axes

        return math.prod(self.mesh.shape[a] for a in data_axes(self.mesh))

    @property
    def max_bins_per_device(self) -> int:
        """The most bins a device holds in one packed micro-batch: the tokens the configured
        padded micro-batch gives it (:func:`~grpo.engine.training.packing.max_bins_per_device`)."""
        from grpo.engine.rollout.prompts import default_buckets
        from grpo.engine.training.packing import max_bins_per_device

        cfg = self.config
        lp = max(cfg.rollout.prompt_buckets or default_buckets(cfg.rollout.max_prompt_length))
        return max_bins_per_device(micro_batch_size=cfg.micro_batch_size, devices=self.update_devices,
                                   sequence_length=lp + cfg.rollout.max_new_tokens, bin_length=cfg.bin_length)

    @property
    def shape_grid(self) -> tuple[tuple[int, ...], int]:
        """``(pers, head_buckets)``: the bins-per-device widths a step may schedule and the
        head widths per width (:func:`~grpo.engine.training.packing.shape_grid`)."""
        from grpo.engine.training.packing import shape_grid

        cpu = self.mesh.devices.flat[0].platform == "cpu"
        return shape_grid(self.config.train.packing, max_per=self.max_bins_per_device, cpu=cpu)

    def schedule_shapes(self) -> dict[int, list[tuple[int, int]]]:
        """The micro-batch schedules a step can take, by bins per device per micro-batch
        (each key one compiled shape of each packed pass: their count is the compile
        bound; :func:`~grpo.engine.training.packing.schedule_shapes`)."""
        from grpo.engine.training.packing import schedule_shapes

        return schedule_shapes(rows=self.config.sequences_per_step, devices=self.update_devices,
                               max_per=self.max_bins_per_device, pers=self.shape_grid[0])

    def scheduled_shape(self, per: int | None = None) -> tuple[int, int, int]:
        """``(m_cap, devices x per, L)``: the scheduled bins' layout at ``per`` bins per
        device per micro-batch (default: the widest a step can schedule)."""
        from grpo.engine.training.packing import micro_capacity

        per = per or max(self.schedule_shapes())
        d = self.update_devices
        return (micro_capacity(rows=self.config.sequences_per_step, devices=d, per=per), d * per,
                self.config.bin_length)

    def pack_plan(self, batch: Any) -> Any:
        """The step's :class:`~grpo.engine.training.packing.PackPlan` (host) from the rows'
        lengths, read back replicated: every process computes the same plan, laid out for
        the step's micro-batch schedule."""
        from grpo.engine.parallel.rows import row_range
        from grpo.engine.training.packing import schedule_packing

        # Replicated: every process reads all rows from its own shards (no device spans
        # processes in a host read-back; row_range says so if the sharding ever changes).
        lengths = row_range(self._lengths_jit()(batch.prompt_mask, batch.mask), slice(None))  # B 2
        return schedule_packing(lengths[:, 0], bin_length=self.config.bin_length, devices=self.update_devices,
                                max_per=self.max_bins_per_device, rows=self.config.sequences_per_step,
                                completions=lengths[:, 1], pers=self.shape_grid[0], head_buckets=self.shape_grid[1])

    @property
    def bins_sharding(self) -> NamedSharding:
        """Scheduled bins [m_cap, devices x per, L, ...]: each micro-batch's bins over the
        update's row axes, the micro-batch axis on every device."""
        from grpo.sharding import data_axes

        return NamedSharding(self.mesh, P(None, data_axes(self.mesh)))

    def _lengths_jit(self) -> Any:
        """[B, 2] int32: each row's real tokens and its completion tokens (the plan's bins
        and head width)."""
        from grpo.engine.training.packing import lengths_program

        return self._program("sequence_lengths", lambda: lengths_program(replicated=self.replicated))

    def pack(self, batch: Any, plan: Any) -> tuple[Any, Any]:
        """``(PackedBatch, Placement)`` of the padded ``batch`` (an UpdateBatch) laid out
        by ``plan``: bins over the update's row axes, the normaliser of the padded batch."""
        from grpo.engine.training.packing import pack_arrays

        return pack_arrays(self._pack_jit(), batch, plan, replicated=self.replicated)

    def _pack_jit(self) -> Any:
        from grpo.engine.training.packing import pack_program

        return self._program("pack", lambda: pack_program(
            self.update_step, bins_sharding=self.bins_sharding, rows_sharding=self.train_sharding,
            replicated=self.replicated, head_rows=self.update_devices))

    def unpack(self, values: jax.Array, place: Any, *, rows: int, length: int) -> jax.Array:
        """Packed per-token values [bins, L] back to the row layout [rows, length]."""
        return self._unpack_jit()(values, place, rows, length)

    def _unpack_jit(self) -> Any:
        from grpo.engine.training.packing import unpack_program

        return self._program("unpack", lambda: unpack_program(out_sharding=self.train_sharding))

    def update(self, params: Any = None, opt_state: Any = None):
        """The jitted update ``(params, opt_state, UpdateBatch, frozen=None) -> (params,
        opt_state, metrics, logprobs)``; ``params`` are the trainable parameters (with
        LoRA the adapters, ``frozen`` the base). With example state its output shardings
        are pinned."""
        return self._program("update", lambda: self.update_step.jit(params, opt_state))

    def reference(self):
        """The jitted reference pass ``(ref_params, UpdateBatch, frozen=None) -> [B, N]
        log-probs`` (micro-batched, through the loss plugin's log-prob path; with LoRA the
        base, adapters off), or None when ``loss.beta == 0`` (no reference model then)."""
        if self.config.loss.beta <= 0:
            return None
        return self._program("reference", self.update_step.jit_reference)

    @property
    def lora_dropout(self) -> bool:
        lora = self.config.model.lora
        return lora is not None and lora.dropout > 0

    def policy_logprobs(self):
        """The jitted forward-only pass of the policy ``(params, UpdateBatch, frozen) ->
        [B, N] log-probs`` under the batch's LoRA-dropout masks (none: dropout-free), or
        None without LoRA dropout. With dropout the update's own log-probs carry its masks;
        this pass gives the dropout-free ones the sampler's are compared with, and with
        ``loss.mismatch`` the masked ones the mismatch weight is corrected by."""
        if not self.lora_dropout:
            return None
        return self._program("policy_logprobs", self.update_step.jit_policy_logprobs)

    def init_opt_state(self, params: Any) -> Any:
        """The optimizer state of concrete ``params`` (with the f32 master copy when the
        run keeps master weights), each leaf in its parameter's sharding (an eager init
        keeps it; a jitted one may replicate) and scalars replicated."""
        replicated = self.replicated
        return jax.tree.map(
            lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding) else jax.device_put(x, replicated),
            self.optimizer_init(params),
        )

    def optimizer_init(self, params: Any) -> Any:
        """The optimizer's init of ``params`` as it comes (unplaced): :meth:`init_opt_state`
        places it, ``grpo plan`` takes its shapes
        (:func:`~grpo.engine.planning.shapes.abstract_opt_state`)."""
        from grpo.engine.training.update import init_optimizer_state

        return init_optimizer_state(self.optimizer, params, master_weights=self.config.master_weights)

    # ------------------------------------------------------------------ the step's glue on abstract state (grpo plan)

    @property
    def selects_rows(self) -> bool:
        """Whether a step trains on rows selected from its rounds (dynamic sampling,
        down-sampling): they are gathered into the update's layout (``gather_rows``)."""
        train = self.config.train
        return train.dynamic_sampling.enabled or train.down_sampling.keep is not None

    def step_lowerings(self, params: Any, frozen: Any, full: Any, padded: Any = None) -> dict[str, Any]:
        """The step's glue programs (beside the samplers', the reference pass and the
        update) that ``config`` runs, by name in the order a step runs them, each as a
        function lowering it on abstract state: ``params`` (trainable), ``frozen`` (the
        LoRA base or None), ``full`` (the whole model state) and, packed, ``padded`` (the
        step's abstract padded update batch:
        :func:`~grpo.engine.planning.shapes.abstract_update_batch`). What ``grpo plan``
        compiles beside :meth:`~grpo.engine.rollout.sampler.BaseSampler.lowerings`."""
        from grpo.engine.rollout.scoring import OVERLONG, reward_weights

        cfg = self.config
        task = self.plugins["task"]
        names = list(reward_weights(task.plugin, task.options)) + ([OVERLONG] if cfg.task.overlong.buffer else [])
        b_ro, b = cfg.rollout_sequences_per_step, cfg.sequences_per_step
        n = cfg.rollout.max_new_tokens
        # Rows as the loop holds them: the rollout's layout, or the update's once selected.
        held = self.train_sharding if self.selects_rows else self.rollout_sharding
        arr = lambda shape, dtype, sh: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sh)  # noqa: E731
        out: dict[str, Any] = {}
        if self.merged_sampling and frozen is not None and not self.rollout.resharded:
            out["merge"] = lambda: self.merge_jit(full).lower(params, frozen)
        # The reward-error counts (the tool counters, [rows, 4], are a smaller variant).
        out["row_sums"] = lambda: self._row_sums_jit().lower(arr((b_ro, 4 * len(names)), jnp.int32, self.rollout_sharding))
        if self.selects_rows:
            out["gather_rows"] = lambda: self._lower_gather_rows()
        if cfg.train.advantage.credit == "turn":
            own = arr((b, n), jnp.int32, held)
            per_fn = {name: arr((b,), jnp.float32, held) for name in names}
            out["turn_advantages"] = lambda: self._turn_advantages_jit(names, held).lower(per_fn, own)
        # The largest array it moves ([B, N] float32: the sampler's log-probs).
        out["to_train"] = lambda: self._to_train_jit().lower(arr((b, n), jnp.float32, held))
        if self.lora_dropout:
            out["dropout_keys"] = lambda: self._dropout_keys_jit(b).lower(jax.ShapeDtypeStruct((), jnp.int32))
        if self.packing:
            if padded is None:
                raise ValueError("a packed run's glue lowers on the step's abstract padded update batch (padded)")
            shape = self.scheduled_shape()  # the widest micro-batch a step can schedule
            idx = [arr(shape, jnp.int32, self.replicated)] * 3
            out["sequence_lengths"] = lambda: self._lengths_jit().lower(padded.prompt_mask, padded.mask)
            head = shape[1] // self.update_devices * shape[2]  # the widest head a step can compile
            out["pack"] = lambda: self._pack_jit().lower(padded, *idx, head=head)
            packed, place = jax.eval_shape(functools.partial(self._pack_jit(), head=head), padded, *idx)
            values = arr(shape, jnp.float32, self.bins_sharding)
            place = jax.tree.map(lambda x: arr(x.shape, x.dtype, self.bins_sharding), place)
            out["unpack"] = lambda: self._unpack_jit().lower(values, place, b, n)
        return out

    def _lower_gather_rows(self) -> Any:
        """``gather_rows`` of the most rounds a step can take (``dynamic_sampling.max_rounds``;
        one without dynamic sampling), every round at the largest prompt bucket."""
        from grpo.engine.rollout.prompts import default_buckets

        cfg = self.config
        rounds = cfg.train.dynamic_sampling.max_rounds if cfg.train.dynamic_sampling.enabled else 1
        lp = max(cfg.rollout.prompt_buckets or default_buckets(cfg.rollout.max_prompt_length))
        out = self.sampler().abstract_output(prompts=cfg.train.prompts_per_step, prompt_length=lp)
        rows = jax.ShapeDtypeStruct((cfg.sequences_per_step,), jnp.int32, sharding=self.replicated)
        return self._gather_rows_jit(out).lower([out] * rounds, rows, lp, self.pad_id)



def build_programs(
    config: RunConfig,
    *,
    mesh: Mesh,
    layout: MeshLayout,
    graphdef: Any,
    eos_ids: Sequence[int],
    pad_id: int,
    plugins: dict[str, Any] | None = None,
    arch: Any = None,
    topology: Any = None,
    state: Any = None,
    chip: Any = None,
    detokenize: Any = None,
    conversations: Any = None,
    frozen: Any = None,
) -> RunPrograms:
    """The programs of ``config`` on ``mesh`` for the model ``graphdef`` (from
    ``nnx.split`` of a concrete or an abstract model).

    ``detokenize`` (``Policy.decode``) and ``conversations`` (a multi-turn task's) are the
    run's text side, which the samplers' ``sample`` needs; ``grpo plan`` and the
    benchmarks, which only compile and time programs, have none. ``frozen``: the LoRA
    base on ``mesh`` that the engines' weight preparation reads
    (:meth:`RunPrograms.prepare_weights`).

    A rollout style with its own layouts needs the model's config ``arch`` and the
    ``topology``; to pick among several (``tensor_parallel: auto``) it uses the chip
    figures ``chip`` (None: the smallest valid one) and the full model ``state``
    (concrete or abstract: its bytes)."""
    from grpo.engine.training.optim import make_optimizer, optimizer_schedule
    from grpo.engine.training.update import UpdateStep

    from grpo.engine.rollout.weights import rollout_placement
    from grpo.engine.training.packing import packing_active

    plugins = plugins or select_plugins(config)
    placement = rollout_placement(
        config, plugins["rollout"], mesh=mesh, layout=layout, arch=arch, topology=topology, state=state, chip=chip
    )
    # The trainer calls the optimizer ppo_epochs times a step: the schedule counts steps.
    opt_cfg, steps, epochs = config.train.optimizer, config.train.steps, config.train.ppo_epochs
    optimizer = make_optimizer(opt_cfg, steps, epochs)
    update_step = UpdateStep(
        graphdef=graphdef,
        loss=plugins["loss"].plugin,
        loss_options=plugins["loss"].options,
        settings=config.loss_settings,
        optimizer=optimizer,
        micro_batches=config.sequences_per_step // config.micro_batch_size,
        mesh=mesh,
        master_weights=config.master_weights,
        moe=config.model.moe,
    )
    return RunPrograms(
        packing=packing_active(config, plugins),
        config=config,
        mesh=mesh,
        layout=layout,
        graphdef=graphdef,
        plugins=plugins,
        batch_axes=placement.batch_axes,
        optimizer=optimizer,
        lr_schedule=optimizer_schedule(opt_cfg, steps, epochs),
        update_step=update_step,
        eos_ids=tuple(int(e) for e in eos_ids),
        pad_id=int(pad_id),
        rollout=placement,
        detokenize=detokenize,
        conversations=conversations,
        frozen=frozen,
    )


__all__ = ["RunPrograms", "build_programs", "eval_batch_size"]
