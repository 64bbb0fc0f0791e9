"""``grpo plan``: compile a run's programs for a TPU pod on any machine.

The programs are the ones ``grpo run`` executes (:mod:`grpo.engine.programs`), lowered on
abstract state — parameters and optimizer state as ``jax.ShapeDtypeStruct`` in their real
shardings on a ``Mesh`` of the topology's devices — and compiled by the TPU compiler
(libtpu). Nothing is allocated, downloaded or run. The counted costs are
:mod:`grpo.engine.planning.costs`'s, ``--search`` is :mod:`grpo.engine.planning.search`,
the text report :mod:`grpo.engine.planning.report`; the abstract state
:mod:`grpo.engine.planning.shapes`'s, one program's compile and report entry
:mod:`grpo.engine.planning.compiled`'s, the state's bytes
:mod:`grpo.engine.planning.memory`'s and the step's headline
:mod:`grpo.engine.planning.headline`'s.

Memory (per device, exact, from ``compiled.memory_analysis()``): a program needs
``argument + output - alias + temp + generated code`` bytes while it runs. Parameters and
optimizer state stay resident between programs, so a program that does not take some of
them as arguments (the rollout does not take the optimizer state) still has them beside
it: ``peak`` is the largest ``program bytes + resident state it does not take``. ``fits``
is ``peak <= usable HBM`` — the compiler does not always refuse a program that exceeds
HBM — and when the compiler does refuse one its message is reported, and the peak is the
temporaries it names plus the state the program takes and the resident state (a lower
bound: its other arguments and outputs are not known then).

Time: ``cost_analysis()`` counts the body of a while loop or scan once, whatever its trip
count (checked: the flops of a 1-, 10- and 100-step ``fori_loop`` are equal), and a Pallas
custom call reports no flops; the layers are a scan and decode is a loop. So ``flops`` and
``bytes_accessed`` are counted from the model's shapes (formulas in
:func:`~grpo.engine.planning.costs.program_costs`, kernels' matmuls included), and ``xla_flops`` /
``xla_bytes_accessed`` keep the compiler's figures for reference.

Communication is read from each compiled program's optimized HLO
(:mod:`grpo.engine.planning.hlo`): every collective, with the trip counts of the loops
around it, as the bytes one chip receives (``collective_bytes`` by kind per program
execution; for decode also ``collective_bytes_per_step``, per generated token), and
``ici_s = ici_bytes / (ICI bidirectional bandwidth / 2)``. ``roofline_s`` is
``max(flops / peak bf16 FLOP/s, bytes / HBM bandwidth, ici_s)`` per device (per decode
step for the decode loop, summed, plus the ICI time of what runs once): a lower bound
that ignores overheads and assumes communication overlaps nothing it does not have to.
``roofline_no_comm_s`` (and ``roofline_step_no_comm_s``) keep the figure without
communication. ``grpo plan --dump-hlo DIR`` writes the HLO the counts come from.

Evaluation (``eval.every_n_steps > 0``) runs the sampler on eval batches between steps:
``eval_prefill`` and ``eval_decode`` (and ``eval_append`` for a multi-turn task) are
compiled for one batch as the evaluator pads it and count in the peak like every program, but their time is not a step's:
``roofline_eval_s`` is one whole evaluation (``eval.num_examples`` prompts; unknown
without it), beside ``roofline_step_s``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

from grpo.core.config import RunConfig, resolve_layout
from grpo.core.contracts import NotPlanned, Topology
from grpo.core.errors import ConfigError, UserError
from grpo.engine.planning.compiled import ProgramResult, compile_program, compile_report, program_entry, run_shapes
from grpo.engine.planning.costs import Cost, program_costs
from grpo.engine.planning.headline import EVAL_PROGRAMS, rollout_headline, step_roofline, synchronous_step
from grpo.engine.planning.memory import bytes_per_device, lora_report, quantization_scales, state_bytes
from grpo.engine.planning.packed import PACKED_PROGRAMS, scheduled_collectives
from grpo.engine.planning.profiles import LengthProfile
from grpo.engine.planning.report import attention_report
from grpo.engine.planning.shapes import (abstract_eval_inputs, abstract_opt_state, abstract_rollout_inputs,
                                         abstract_update_batch)
from grpo.engine.planning.tpu import TpuTopology, parse_topology, require_libtpu

# The programs that read the sampler's state (with merged LoRA sampling: the merged copy).
ROLLOUT_PROGRAMS = ("prefill", "decode", "append", "eval_prefill", "eval_decode", "eval_append")


def rollout_append_length(config: RunConfig) -> int:
    """The largest append bucket of a multi-turn rollout (what its append program writes)."""
    from grpo.engine.rollout.multiturn import append_bucket

    return append_bucket(config.rollout.max_new_tokens)


# What the rollout programs do not depend on (a search recompiles only the update).
ROLLOUT_ONLY = ("train.micro_batch_size", "train.ppo_epochs", "train.optimizer", "train.steps", "loss", "eval",
                "checkpoint", "logging", "name")
# What the reference pass and the update do not depend on (comparing rollout layouts
# recompiles only the rollout programs).
ROLLOUT_LAYOUT_ONLY = ("rollout.style", "rollout.options")
# What the eval programs do not depend on.
EVAL_ONLY = ("train", "rollout.num_generations", "loss", "checkpoint", "logging", "name")


ROLLOUT_SIDE = ("start", "prefill", "decode", "append")  # an asynchronous rollout mesh's programs
TRAINING_SIDE = ("reference", "policy_logprobs", "update")  # an asynchronous update mesh's programs


def synchronous(config: RunConfig) -> RunConfig:
    """``config`` with ``train.async`` off: what each side of an asynchronous split runs
    (and the synchronous plan it is compared with)."""
    train = config.train.model_copy(update={"async_": config.train.async_.model_copy(update={"enabled": False,
                                                                                            "rollout_devices": None})})
    return config.model_copy(update={"train": train})


def engine_report(s: Any, lengths: LengthProfile | None, *, chip: Any = None, hbm: int | None = None,
                  entries: dict[str, Any] | None = None) -> dict[str, Any]:
    """The continuous engine's section of a plan of subject ``s``
    (:func:`grpo.engine.planning.engine.engine_section`; ``chip`` defaults to a v6e)."""
    from grpo.engine.planning.engine import engine_section
    from grpo.engine.planning.tpu import CHIPS

    chip = chip or CHIPS["v6e"]
    return engine_section(s, lengths, chip=chip, hbm=hbm or chip.hbm_bytes, entries=entries or {},
                          rollout_weight_bytes=s.state["rollout_parameters"] if s.programs.rollout.resharded else None)


def cache_key(config: RunConfig, name: str, exclude: tuple[str, ...]) -> tuple:
    """The compiled-program cache key of program ``name``: the config without the
    ``exclude``d sections / fields (``section`` or ``section.field``)."""
    data = config.model_dump(mode="json")
    for path in exclude:
        sec, _, field = path.partition(".")
        if field:
            data.get(sec, {}).pop(field, None)
        else:
            data.pop(sec, None)
    return (name, json.dumps(data, sort_keys=True))


@dataclasses.dataclass
class EvalBatch:
    """One eval batch as the Evaluator pads it, and the sampler that decodes it."""

    sampler: Any
    inputs: dict[str, Any]  # abstract prompt_tokens / prompt_mask
    prompts: int
    padded: int
    rows: int  # padded x eval.k
    kv_cache_bytes: int | None = None  # per device (None: the engine is not planned)


@dataclasses.dataclass
class Subject:
    """One config's programs on abstract state: what a plan compiles and counts."""

    config: RunConfig
    programs: Any  # grpo.engine.programs.RunPrograms
    arch: Any
    full: Any  # the whole policy state
    params: Any  # its trainable part (LoRA: the adapters)
    frozen: Any  # LoRA's frozen base, else None
    opt_state: Any
    batch: Any  # an abstract update batch
    sampler: Any
    inputs: dict[str, Any]  # abstract rollout prompts
    sampler_args: Any  # the state the rollout programs take
    prepared: Any  # that state before the engine's once-per-sync quantize_weights
    state: dict[str, int]  # state_bytes_per_device
    eval: EvalBatch | None  # with eval.every_n_steps > 0
    # Why the rollout engine is not planned (a planning method it lacks raised NotPlanned):
    # its programs, evaluation's and those taking its rows are left out. None: planned.
    not_planned: str | None = None

    @property
    def rows(self) -> int:
        """The rollout's rows: P x K."""
        return self.inputs["prompt_tokens"].shape[0] * self.config.rollout.num_generations


class Planner:
    """Plans one config on one topology; compiled program results are cached by the
    config fields they depend on, so a search recompiles only what changes."""

    def __init__(self, topology: str | TpuTopology, *, hbm_bytes: int | None = None, dump_hlo: str | None = None):
        require_libtpu()
        self.dump_hlo = dump_hlo  # a directory: each program's optimized HLO as <program>.hlo.txt
        self.topology = parse_topology(topology) if isinstance(topology, str) else topology
        self.devices = self.topology.devices()
        counts = self.topology.processes(self.devices)
        self.topo = Topology(
            process_count=len(counts), local_device_count=counts[0], devices_per_process=counts, platform="tpu"
        )
        self._cache: dict[tuple, ProgramResult] = {}
        chip_hbm = self.topology.chip.hbm_bytes
        if hbm_bytes is not None and not 0 < hbm_bytes <= chip_hbm:
            raise UserError(
                f"--hbm-limit must be above 0 and at most the {chip_hbm / (1 << 30):.2f} GiB a "
                f"{self.topology.chip.generation} chip has (got {hbm_bytes / (1 << 30):.3f} GiB)."
            )
        self.hbm_bytes = hbm_bytes or chip_hbm

    # ------------------------------------------------------------------ one config

    def build(self, config: RunConfig):
        from grpo.engine.parallel.mesh import build_mesh
        from grpo.engine.programs import build_programs
        from grpo.models.loading import abstract_model

        try:
            layout = resolve_layout(config, self.topo)
        except ConfigError as err:
            raise ConfigError(
                f"The config cannot run on {self.topology.name} ({self.topo.process_count} process(es) x "
                f"{self.topo.local_device_count} devices):",
                problems=list(err.problems) if getattr(err, "problems", None) else [str(err)],
            ) from None
        mesh = build_mesh(layout, self.devices)
        graphdef, params, arch = abstract_model(config.model, mesh)
        eos = arch.eos_token_id if arch.eos_token_id is not None else ()
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        pad = arch.pad_token_id if arch.pad_token_id is not None else (eos[0] if eos else 0)
        try:
            programs = build_programs(
                config, mesh=mesh, layout=layout, graphdef=graphdef, eos_ids=eos, pad_id=pad, arch=arch,
                topology=self.topo, state=params, chip=self.topology.chip,
            )
        except UserError as err:
            raise ConfigError(
                f"The config cannot run on {self.topology.name}:", problems=[str(err)]
            ) from None
        return programs, params, arch

    def subject(self, config: RunConfig) -> Subject:
        """``config``'s programs (:meth:`build`), its abstract state split as the run splits
        it, the samplers and the state's bytes per device."""
        import jax

        from grpo.models.lora import split_params

        programs, full, arch = self.build(config)
        params, frozen = split_params(full)  # LoRA: adapters train, the base is frozen
        opt_state = abstract_opt_state(programs, params)
        # A multi-turn task (tools): the turn decode and the append instead of one decode
        # (the turn-stop tokens are constants of the program; none are needed to plan it).
        sampler = programs.sampler()
        inputs = abstract_rollout_inputs(programs)
        batch = abstract_update_batch(programs)
        ro = programs.rollout
        rollout_state = None
        if ro.resharded:
            rollout_state = jax.tree.map(
                lambda leaf, sh: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh), full, ro.shardings(full))
        state = state_bytes(config, programs, full=full, opt_state=opt_state, frozen=frozen,
                            rollout_state=rollout_state)
        P, Lp = inputs["prompt_tokens"].shape
        prepared = rollout_state if rollout_state is not None else full
        sampler_args = sampler.quantize_weights(prepared)
        state["kv_cache"] = None  # the engine's (_ask_engine)
        # Evaluation (every eval.every_n_steps steps): the same sampler's programs with
        # eval.k samples of each prompt of an eval batch, padded as the Evaluator pads it.
        eval_batch = None
        if config.eval.every_n_steps > 0:
            eval_sampler = programs.eval_sampler()
            eval_inputs = abstract_eval_inputs(programs)
            eval_prompts, eval_padded = programs.eval_batch()
            eval_batch = EvalBatch(eval_sampler, eval_inputs, eval_prompts, eval_padded, eval_padded * config.eval.k)
        s = Subject(
            config=config, programs=programs, arch=arch, full=full, params=params, frozen=frozen, opt_state=opt_state,
            batch=batch, sampler=sampler, inputs=inputs,
            sampler_args=sampler_args, prepared=prepared, state=state, eval=eval_batch,
        )
        s.not_planned = self._ask_engine(s)
        return s

    def _ask_engine(self, s: Subject) -> str | None:
        """What the plan needs of ``s``'s rollout engine (the contract's planning methods):
        its KV cache bytes (into ``s.state`` and the eval batch), its programs, its
        abstract output (``gather_rows`` takes it) and its cost model. None, or why it is
        not planned: the :class:`NotPlanned` message of the first it lacks."""
        import jax

        P, Lp = s.inputs["prompt_tokens"].shape
        key = jax.random.key(s.config.train.seed)
        try:
            s.state["kv_cache"] = s.sampler.cache_bytes(s.sampler_args, rows=s.rows, prompt_length=Lp)
            if s.eval is not None:
                s.eval.kv_cache_bytes = s.eval.sampler.cache_bytes(s.sampler_args, rows=s.eval.rows, prompt_length=Lp)
                s.eval.sampler.lowerings(s.sampler_args, prompts=s.eval.inputs["prompt_tokens"].shape[0],
                                         prompt_length=Lp, key=key)
            s.sampler.lowerings(s.sampler_args, prompts=P, prompt_length=Lp, key=key)
            if s.programs.selects_rows:
                s.sampler.abstract_output(prompts=P, prompt_length=Lp)
            self._costs(s)
        except NotPlanned as err:
            return str(err) or type(err).__name__
        return None

    def programs_to_compile(self, s: Subject) -> list[tuple[str, Callable[[], Any], tuple, tuple[str, ...]]]:
        """``(name, lower, cache key, resident state it takes)`` of every program a step
        runs, in the order a step runs them (the report's order): the policy into the
        sampler's layout (reshard, or merge), the sampler's own programs (prefill, start,
        decode, append), the step's glue (row_sums, gather_rows, turn_advantages,
        to_train), the reference pass, LoRA dropout's keys and dropout-free pass, the
        update, then the eval programs. Every program ``grpo run`` executes is here
        (``tests/test_architecture.py`` runs one and compares)."""
        import jax

        config, programs, params, frozen = s.config, s.programs, s.params, s.frozen
        ro = programs.rollout
        rollout_takes = ("rollout_parameters",) if ro.resharded else ("parameters",)
        todo: list[tuple[str, Callable[[], Any], tuple, tuple[str, ...]]] = []
        if ro.resharded:
            def reshard() -> Any:
                fn = programs.reshard_jit(s.full)
                merging = programs.merged_sampling and frozen is not None
                return fn.lower(params, frozen) if merging else fn.lower(s.full)

            todo.append(("reshard", reshard, cache_key(config, "reshard", ROLLOUT_ONLY), ("parameters",)))
        glue = programs.step_lowerings(params, frozen, s.full, abstract_update_batch(programs, packed=False))
        if "merge" in glue:
            todo.append(("merge", glue.pop("merge"), cache_key(config, "merge", ROLLOUT_ONLY), ("parameters",)))
        key = jax.random.key(config.train.seed)
        P, Lp = s.inputs["prompt_tokens"].shape
        planned = s.not_planned is None  # else its programs and those taking its rows are left out
        lowerings = s.sampler.lowerings(s.sampler_args, prompts=P, prompt_length=Lp, key=key) if planned else {}
        for name, lower in {**s.sampler.quantize_lowerings(s.prepared), **lowerings}.items():
            todo.append((name, lower, cache_key(config, name, ROLLOUT_ONLY), rollout_takes))
        for name, lower in glue.items():
            if planned or name != "gather_rows":
                todo.append((name, lower, cache_key(config, name, ROLLOUT_ONLY), ()))
        todo += self._training_programs(s)
        if s.eval is not None and planned:
            P = s.eval.inputs["prompt_tokens"].shape[0]
            lowerings = s.eval.sampler.lowerings(s.sampler_args, prompts=P, prompt_length=Lp, key=key)
            for name, lower in {**s.eval.sampler.quantize_lowerings(s.prepared), **lowerings}.items():
                todo.append((f"eval_{name}", lower, cache_key(config, f"eval_{name}", EVAL_ONLY), rollout_takes))
        return todo

    @staticmethod
    def _training_programs(s: Subject) -> list[tuple[str, Callable[[], Any], tuple, tuple[str, ...]]]:
        """The reference pass (``beta > 0``), LoRA dropout's dropout-free pass and the
        update, as :meth:`programs_to_compile` lists them."""
        config, programs, params, frozen = s.config, s.programs, s.params, s.frozen
        todo: list[tuple[str, Callable[[], Any], tuple, tuple[str, ...]]] = []
        if config.loss.beta > 0:
            # The trainer runs it before the update, on the batch without ref log-probs;
            # LoRA's reference pass reads the policy's own base (adapters off).
            ref = params if frozen is not None else s.full
            ref_takes = ("reference_parameters",) if frozen is None else ("parameters",)
            unscored = s.batch._replace(ref_logprobs=None)
            todo.append(("reference", lambda: programs.reference().lower(ref, unscored, frozen),
                         cache_key(config, "reference", ROLLOUT_LAYOUT_ONLY), ref_takes))
        if programs.lora_dropout:
            todo.append(("policy_logprobs", lambda: programs.policy_logprobs().lower(params, s.batch, frozen),
                         cache_key(config, "policy_logprobs", ROLLOUT_LAYOUT_ONLY), ("parameters",)))
        todo.append(("update", lambda: programs.update(params, s.opt_state).lower(params, s.opt_state, s.batch, frozen),
                     cache_key(config, "update", ROLLOUT_LAYOUT_ONLY), ("parameters", "optimizer_state")))
        return todo

    def plan(self, config: RunConfig, lengths: LengthProfile | None = None) -> dict[str, Any]:
        """The plan of ``config`` (the report ``grpo plan --json`` prints); with a length
        profile also its ``packing`` section (:meth:`packing`); with ``train.async.enabled``
        the synchronous plan and its ``async`` section (:meth:`plan_async`)."""
        if config.train.async_.enabled:
            sync = synchronous(config)
            report = self.plan(sync, lengths)
            if not report.get("not_planned"):  # a split needs the rollout side's programs
                report["async"] = self.plan_async(sync, lengths, report,
                                                  rollout_devices=config.train.async_.rollout_devices, checked=config)
            return report
        s = self.subject(config)
        results, costs = self._compiled(s)
        self._dump(results)
        state = s.state
        # Partition id -> TPU slice (the program's device assignment is the mesh's order).
        slice_of = [getattr(d, "slice_index", 0) or 0 for d in s.programs.mesh.devices.flat]
        # Resident between programs: the training state (the rollout copy only while the
        # rollout programs run, which take it as their argument).
        resident_total = state["parameters"] + state["optimizer_state"] + state["reference_parameters"]
        entries: dict[str, Any] = {}
        peaks: list[int] = []
        errors: list[str] = []
        for r in results:
            if r.name in PACKED_PROGRAMS and getattr(s.programs, "packing", False):
                # The packed passes loop over a step's micro-batches (a traced trip count):
                # counted at the config's micro-batches, the padded step's.
                r = dataclasses.replace(r, collectives=scheduled_collectives(
                    r.collectives, micro_batches=config.sequences_per_step // config.micro_batch_size))
            resident = resident_total - sum(state[t] for t in r.takes if t != "rollout_parameters")
            if r.name in ROLLOUT_PROGRAMS:
                resident += state["merged_projections"]
            entries[r.name] = entry = program_entry(r, costs[r.name], resident=resident, state=state,
                                                    chip=self.topology.chip, slice_of=slice_of)
            if r.error is not None and r.memory is None:
                errors.append(f"{r.name}: {r.error}")
            if entry["peak_bytes"] is not None:
                peaks.append(entry["peak_bytes"])
        report = self._report(s, results, entries, costs, peaks, errors)
        report["compile"] = compile_report(results, run_shapes(s.programs, [r.name for r in results]))
        if lengths is not None:
            report["packing"] = self.packing(s, entries, lengths, slice_of)
        if s.sampler.simulates and s.not_planned is None:
            report["rollout_engine"] = engine_report(s, lengths, chip=self.topology.chip, hbm=self.hbm_bytes,
                                                     entries=entries)
        if s.not_planned is not None:
            report["not_planned"] = {"rollout_engine": config.rollout.engine, "why": s.not_planned,
                                     "left_out": "the rollout's programs (and evaluation's, gather_rows, an "
                                                 "asynchronous split): the peak, fit and roofline are the rest's"}
        return rollout_headline(report, engine=config.rollout.engine)

    def sub(self, devices: list[Any]) -> "Planner":
        """This planner on ``devices`` alone (one side of an asynchronous split)."""
        import copy

        p = copy.copy(self)
        p.devices = list(devices)
        counts = self.topology.processes(p.devices)
        p.topo = Topology(process_count=len(counts), local_device_count=counts[0], devices_per_process=counts,
                          platform="tpu")
        p._cache, p.dump_hlo = {}, None
        return p

    def _compiled(self, s: Subject, names: tuple[str, ...] | None = None) -> tuple[list[ProgramResult], dict[str, Cost]]:
        """The programs of ``s`` (those named in ``names``; None: every one) compiled, each
        once per cache key, and every program's counted cost."""
        results: list[ProgramResult] = []
        for name, lower, key, takes in self.programs_to_compile(s):
            if names is None or name in names:
                if key not in self._cache:
                    self._cache[key] = compile_program(name, lower, takes)
                results.append(self._cache[key])
        return results, self._costs(s)

    def _costs(self, s: Subject) -> dict[str, Cost]:
        """Every program's counted cost (the rollout's by its engine's cost model, unless
        it is not planned)."""
        ro = s.programs.rollout
        return program_costs(s.programs, s.arch, self.topology.chip,
                             rollout_weight_bytes=s.state["rollout_parameters"] if ro.resharded else None,
                             train_state_bytes=s.state["parameters"],
                             append_length=rollout_append_length(s.config) if s.programs.multi_turn else None,
                             rollout=s.not_planned is None)

    def side(self, config: RunConfig, names: tuple[str, ...],
             s: Subject | None = None) -> tuple[Subject, dict[str, Any], dict[str, Cost], list[int]]:
        """The programs ``names`` of ``config`` (its subject ``s`` on these devices, built
        if None) compiled on this planner's devices alone: ``(subject, entries, costs,
        slice_of)``. A side holds only its own state: the rollout mesh its weights (the
        programs' arguments), the update mesh the training state."""
        s = s or self.subject(config)
        results, costs = self._compiled(s, names)
        slice_of = [getattr(d, "slice_index", 0) or 0 for d in s.programs.mesh.devices.flat]
        training = s.state["parameters"] + s.state["optimizer_state"] + s.state["reference_parameters"]
        entries = {}
        for r in results:
            resident = 0 if r.name in ROLLOUT_PROGRAMS + ("start",) else training - sum(s.state[t] for t in r.takes)
            entries[r.name] = program_entry(r, costs[r.name], resident=resident, state=s.state,
                                            chip=self.topology.chip, slice_of=slice_of)
        return s, entries, costs, slice_of

    def plan_async(self, config: RunConfig, lengths: LengthProfile | None, report: dict[str, Any], *,
                   rollout_devices: int | None, checked: RunConfig | None = None) -> dict[str, Any]:
        """The ``async`` section (:mod:`grpo.engine.planning.pipeline`) of ``config`` (its
        synchronous form, whose plan is ``report``) split at ``rollout_devices``; the
        asynchronous config ``checked``'s split is first checked as the run checks it
        (:func:`~grpo.engine.parallel.split.check_split` on the topology's processes), so
        the plan refuses, with the run's message, every split the run would refuse."""
        import jax

        from grpo.engine.planning.pipeline import (async_section, split_devices, sync_link, weight_sync,
                                                   weight_sync_by_processes)

        if checked is not None:
            from grpo.engine.parallel.split import validate_split

            a = checked.train.async_.model_copy(update={"enabled": True, "rollout_devices": rollout_devices})
            validate_split(checked.model_copy(update={"train": checked.train.model_copy(update={"async_": a})}),
                           self.topo.process_count, self.topo.local_device_count)
        k, u = split_devices(devices=len(self.devices), per_process=self.topo.local_device_count,
                             processes=self.topo.process_count, rollout_devices=rollout_devices)
        # Both sides laid out before either compiles: a split one side cannot run is
        # refused without compiling the other (and a search skips it at no compile cost).
        built = {}
        for side, devices, names in (("rollout", self.devices[:k], ROLLOUT_SIDE),
                                     ("update", self.devices[k:], TRAINING_SIDE)):
            planner = self.sub(devices)
            try:
                built[side] = (planner, planner.subject(config), names)
            except ConfigError as err:
                problems = "; ".join(getattr(err, "problems", None) or [str(err)])
                raise UserError(f"train.async.rollout_devices={k}: the {side} side ({len(devices)} of "
                                f"{len(self.devices)} devices) cannot run this config: {problems}") from None
        if built["rollout"][1].not_planned:
            raise UserError(f"train.async.rollout_devices={k}: rollout engine {config.rollout.engine!r} is not "
                            f"planned ({built['rollout'][1].not_planned}): a split needs its programs")
        sides = {side: planner.side(config, names, s) for side, (planner, s, names) in built.items()}
        s_ro, e_ro, _, _ = sides["rollout"]
        s_up, e_up, c_up, slice_up = sides["update"]
        # The rollout side as the headline costs it (rollout_headline): the programs, or
        # the config's engine's simulated schedule.
        rollout = {"whole_s": sum(e["roofline_s"] for e in e_ro.values()), "engine": config.rollout.engine,
                   "costed_as": "programs"}
        if s_ro.sampler.simulates and lengths is not None:
            en = engine_report(s_ro, lengths, chip=self.topology.chip, hbm=self.hbm_bytes, entries=e_ro)
            best = en["steady_state_best"]
            rollout = {"whole_s": en["decode_roofline_s"] + en["prefill_roofline_s"] + e_ro["start"]["roofline_s"],
                       "engine": config.rollout.engine, "costed_as": "schedule",
                       "steady_s": best["s_per_valid_token"] * en["valid_tokens"] if best else None,
                       "slots": best["slots"] if best else None}
        if lengths is not None:
            pk = self.packing(s_up, e_up, lengths, slice_up)
            update_s, update_fits = pk["roofline_step_packed_s"], pk["fits"]
        else:
            update_s = step_roofline(e_up, c_up, config.train.ppo_epochs)[0]
            update_fits = all(e["peak_bytes"] is not None and e["peak_bytes"] <= self.hbm_bytes
                              and not e["compiler_error"] for e in e_up.values())
        weights = s_ro.state["rollout_parameters"] or s_ro.state["parameters"]
        sync = weight_sync(rollout_bytes_per_chip=weights, rollout_chips=k, update_chips=u,
                           ici_bandwidth=self.topology.chip.ici_bandwidth,  # LoRA: the adapters alone move
                           adapter_bytes_per_chip=None if s_ro.frozen is None else bytes_per_device(s_ro.params))
        if self.topo.process_count > 1:  # split by hosts: the sent tree, whole, to every rollout chip
            sent = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s_up.params))
            sync = weight_sync_by_processes(sent_bytes=sent, rollout_chips=k, update_chips=u,
                                            **sync_link(self.topology.chip, self.devices[:k], self.devices[k:]))
        rollout_fits = all(e["peak_bytes"] is not None and e["peak_bytes"] <= self.hbm_bytes
                           and not e["compiler_error"] for e in e_ro.values())
        out = async_section(split=(k, u), synchronous_s=synchronous_step(report), rollout=rollout, update_s=update_s,
                            sync=sync, valid_tokens=report["packing"]["valid_tokens_per_step"] if lengths else None,
                            update_fits=update_fits, rollout_fits=rollout_fits)
        out["rollout_peak_bytes"] = max((e["peak_bytes"] or 0) for e in e_ro.values())
        out["update_peak_bytes"] = max((e["peak_bytes"] or 0) for e in e_up.values())
        out["rollout_mesh"] = dict(s_ro.programs.layout.shape)
        out["update_mesh"] = dict(s_up.programs.layout.shape)
        return out

    def packing(self, s: Subject, entries: dict[str, Any], lengths: LengthProfile,
                slice_of: list[int]) -> dict[str, Any]:
        """The ``packing`` section of a plan under a length profile
        (:mod:`grpo.engine.planning.packed`): the bins, the packed passes beside the padded
        ones, and the memory of the update compiled at the bins (``fits``: every program's
        peak with the packed update in the padded one's place)."""
        from grpo.engine.planning.packed import packed_costs, packed_report, plan_bins, scheduled_ici_s

        config = s.config
        Lp = s.inputs["prompt_tokens"].shape[1]
        bp = plan_bins(s.programs, lengths, prompt_length=Lp)
        attention = self._report_attention(config)
        pcosts = packed_costs(s.programs, s.arch, self.topology.chip, bp, attention)
        name = f"update_packed_{bp.per}x{bp.devices}x{bp.bin_length}"
        key = cache_key(config, name, ROLLOUT_LAYOUT_ONLY)
        if key not in self._cache:
            lower, source = self._packed_update(s, per=bp.per, length=bp.bin_length)
            self._cache[key] = dataclasses.replace(compile_program("update", lower, ("parameters", "optimizer_state")),
                                                   hlo_source=source)
        r = self._cache[key]
        update = program_entry(r, pcosts["update"], resident=entries["update"]["resident_bytes"], state=s.state,
                               chip=self.topology.chip, slice_of=slice_of)
        if hasattr(s.programs, "schedule_shapes"):  # the micro-batch loop's collectives, once per micro-batch
            update["ici_s"] = scheduled_ici_s(r.collectives, micro_batches=bp.mean("micro_batches"),
                                              chip=self.topology.chip, slice_of=slice_of)
        rep = packed_report(bp, padded=entries, packed=pcosts, ppo_epochs=config.train.ppo_epochs,
                            update_entry=update, update_source=r.hlo_source or "", hbm=self.hbm_bytes)
        others = [e["peak_bytes"] for n, e in entries.items() if n != "update"]
        peaks = others + [update["peak_bytes"]]
        rep["peak_bytes_per_device"] = None if None in peaks else max(peaks)
        errors = [e.get("compiler_error") for n, e in entries.items() if n != "update"] + [update["compiler_error"]]
        rep["fits"] = bool(rep["peak_bytes_per_device"] is not None and rep["peak_bytes_per_device"] <= self.hbm_bytes
                           and not any(errors))
        return rep

    @staticmethod
    def _report_attention(config: RunConfig) -> str:
        return attention_report(config, ["update"])["programs"]["update"]

    @staticmethod
    def _packed_update(s: Subject, *, per: int, length: int) -> tuple[Callable[[], Any], str]:
        """The update lowered at micro-batches of ``per`` bins of ``length`` tokens per
        device: ``(lower, what it is)``. The run's packed update program where the builder
        has one (its micro-batch loop's trip count is traced); else the padded update at
        ``per`` x devices x the config's micro-batches rows of ``length`` tokens (prompt
        ``length - N`` + ``N``): the same tokens per micro-batch through the layers, the
        loss's head over the ``N`` completion slots of each row rather than all of a bin's
        (a lower bound)."""
        import jax

        programs, params, frozen = s.programs, s.params, s.frozen
        if hasattr(programs, "schedule_shapes"):  # the builder's packed passes
            batch = abstract_update_batch(programs, packed=True, per=per)
            assert batch.tokens.shape[1:] == (programs.update_devices * per, length), (batch.tokens.shape, per, length)
            fn = programs.update(params, s.opt_state)
            return (lambda: fn.lower(params, s.opt_state, batch, frozen)), "packed update program"
        config = s.config
        bins = per * programs.layout.data * (config.sequences_per_step // config.micro_batch_size)
        N = config.rollout.max_new_tokens

        def resize(leaf: Any, columns: int | None = None) -> Any:
            if leaf is None:
                return None
            shape = (bins,) + ((columns,) if columns is not None else tuple(leaf.shape[1:]))
            return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=leaf.sharding)

        batch = s.batch._make(resize(x, length - N if f in ("prompt_tokens", "prompt_mask") else None)
                              for f, x in zip(s.batch._fields, s.batch))
        fn = programs.update(params, s.opt_state)
        return (lambda: fn.lower(params, s.opt_state, batch, frozen)), "padded update at the bins (proxy)"

    def _dump(self, results: list[ProgramResult]) -> None:
        """``--dump-hlo``: each program's optimized HLO as ``<program>.hlo.txt``."""
        if not self.dump_hlo:
            return
        import os

        os.makedirs(self.dump_hlo, exist_ok=True)
        for r in results:
            if r.hlo:
                with open(os.path.join(self.dump_hlo, f"{r.name}.hlo.txt"), "w") as f:
                    f.write(r.hlo)

    @staticmethod
    def _eval_report(s: Subject, entries: dict[str, Any]) -> dict[str, Any] | None:
        """One eval batch; a whole evaluation runs ceil(examples / prompts) of them, and the
        split's size is known here only through eval.num_examples."""
        if s.eval is None or s.not_planned is not None:
            return None
        config, ev = s.config, s.eval
        batch_s = sum(entries[n]["roofline_s"] for n in EVAL_PROGRAMS if n in entries and n != "eval_quantize")
        batches = math.ceil(config.eval.num_examples / ev.prompts) if config.eval.num_examples else None
        return {
            "every_n_steps": config.eval.every_n_steps,
            "k": config.eval.k,
            "prompts_per_batch": ev.prompts,
            "padded_prompts_per_batch": ev.padded,
            "rows_per_batch": ev.rows,
            "kv_cache_bytes": ev.kv_cache_bytes,
            "batches": batches,
            "roofline_batch_s": batch_s,
        }

    def _report(self, s: Subject, results: list[ProgramResult], entries: dict[str, Any], costs: dict[str, Cost],
                peaks: list[int], errors: list[str]) -> dict[str, Any]:
        from grpo.models.lora import count_params

        config, programs, frozen = s.config, s.programs, s.frozen
        hbm = self.hbm_bytes
        peak = max(peaks) if peaks else None
        fits = peak is not None and peak <= hbm and not errors
        step_roofline_s, step_roofline_no_comm = step_roofline(entries, costs, config.train.ppo_epochs)
        eval_report = self._eval_report(s, entries)
        layout, ro = programs.layout, programs.rollout
        n_trainable = count_params(s.params)
        n_frozen = count_params(frozen) - sum(quantization_scales(frozen).values()) if frozen is not None else 0
        chip = self.topology.chip
        return {
            "topology": self.topology.name,
            "topology_raw": self.topology.raw,
            "processes": self.topo.process_count,
            "devices": len(self.devices),
            "devices_per_process": self.topo.local_device_count,
            "device_kind": self.devices[0].device_kind,
            "mesh": layout.shape,
            "mesh_warnings": list(layout.warnings),
            "hbm_bytes_per_device": hbm,
            "chip_hbm_bytes": chip.hbm_bytes,
            "state_bytes_per_device": s.state,
            "programs": entries,
            "peak_bytes_per_device": peak,
            "fits": bool(fits),
            "margin_bytes": (hbm - peak) if peak is not None else None,
            "compiler_error": "\n".join(errors) if errors else None,
            "roofline_step_s": step_roofline_s,
            "roofline_step_no_comm_s": step_roofline_no_comm,
            # One whole evaluation (not in the step's roofline: it runs every
            # eval.every_n_steps steps); None without eval or eval.num_examples.
            "roofline_eval_s": eval_report["roofline_batch_s"] * eval_report["batches"]
            if eval_report and eval_report["batches"] else None,
            "eval": eval_report,
            "attention": attention_report(config, [r.name for r in results]),
            "rollout_style": config.rollout.style,
            "rollout_layout": ro.describe() if ro.resharded else {
                "mesh": dict(layout.shape), "batch_axes": list(programs.batch_axes), "tensor_parallel": layout.tp,
                "resharded": False,
            },
            # Whole-model counts (not per device); a quantized base counts one code per
            # weight, its block scales are lora.quantization_scales.
            "trainable_params": n_trainable,
            "frozen_params": n_frozen,
            "lora": lora_report(config, s.arch, s.params, frozen),
            "chip": {
                "generation": chip.generation,
                "bf16_flops": chip.bf16_flops,
                "hbm_bandwidth_bytes_per_s": chip.hbm_bandwidth,
                "ici_bandwidth_bytes_per_s": chip.ici_bandwidth,
                "source": chip.source,
            },
            "shape": {
                "sequences_per_step": config.sequences_per_step,
                "rollout_sequences_per_step": config.rollout_sequences_per_step,
                "micro_batch_size": config.micro_batch_size,
                "prompt_length": s.inputs["prompt_tokens"].shape[1],
                "max_new_tokens": config.rollout.max_new_tokens,
                "loss": config.loss.impl,
                "remat": config.model.remat,
                "attention": config.model.attention,
                "param_dtype": config.model.param_dtype,
            },
        }


__all__ = ["Planner", "Subject", "engine_report", "rollout_append_length", "synchronous"]
