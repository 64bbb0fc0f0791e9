"""``grpo plan``: compile a run's programs for a TPU pod on any machine.

The programs are the ones ``grpo run`` executes (:mod:`grpo.engine.programs`), lowered on
abstract state — parameters and optimizer state as ``jax.ShapeDtypeStruct`` in their real
shardings on a ``Mesh`` of the topology's devices — and compiled by the TPU compiler
(libtpu). Nothing is allocated, downloaded or run.

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
:func:`program_costs`, kernels' matmuls included), and ``xla_flops`` /
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
compiled for one batch as the evaluator pads it
and count in the peak like every program, but their time is not a step's:
``roofline_eval_s`` is one whole evaluation (``eval.num_examples`` prompts; unknown
without it), beside ``roofline_step_s``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Callable

from grpo.core.config import RunConfig, load_config, resolve_layout
from grpo.core.contracts import Topology
from grpo.core.errors import ConfigError, UserError
from grpo.engine.planning.tpu import TpuTopology, parse_topology, require_libtpu

SEARCH_FIELDS = ("train.micro_batch_size", "train.prompts_per_step")
EVAL_PROGRAMS = ("eval_prefill", "eval_decode", "eval_append")
# The programs that read the sampler's state (with merged LoRA sampling: the merged copy).
ROLLOUT_PROGRAMS = ("prefill", "decode", "append", *EVAL_PROGRAMS)


# --------------------------------------------------------------------------- helpers


def _bytes_per_device(tree: Any) -> int:
    import jax

    from grpo.models import quant

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += (math.prod(shape) * quant.bits_per_element(leaf.dtype) + 7) // 8
    return total


def _merged_projection_bytes(full: Any) -> int:
    """Per-device bytes of the LoRA-targeted projections (what a merged copy holds)."""
    from flax import nnx

    from grpo.models.lora import LORA_COLLECTION

    targets = {path[1].removesuffix("_a") for path, _ in nnx.to_flat_state(full)
               if path[0] == LORA_COLLECTION and str(path[1]).endswith("_a")}
    return sum(_bytes_per_device(var.get_value()) for path, var in nnx.to_flat_state(full)
               if path[0] == "layers" and path[1] in targets)


def _scales(tree: Any) -> dict[str, int]:
    """``projection -> elements`` of a QLoRA base's block scales (``layers.<proj>_scale``)
    in ``tree``: what the model actually quantized."""
    import jax

    out: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        for k in path:
            name = str(getattr(k, "key", ""))
            if name.endswith("_scale"):
                out[name[: -len("_scale")]] = out.get(name[: -len("_scale")], 0) + math.prod(leaf.shape)
    return out


_SIZE = re.compile(r"\(([\d.]+)([KMGT])\)")


def _first_size(message: str) -> int | None:
    """The first ``(12.34G)`` size in a compiler OOM message, in bytes."""
    m = _SIZE.search(message)
    if not m:
        return None
    return int(float(m.group(1)) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2)])


def _compiler_text(err: Exception) -> str:
    text = str(err).strip() or type(err).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[:20])[:4000]


def _read_dump(directory: str) -> str | None:
    """The optimized HLO text XLA dumped into ``directory`` (one module), or None."""
    import glob
    import os

    files = sorted(glob.glob(os.path.join(directory, "*.after_optimizations.txt")))
    if not files:
        return None
    with open(files[-1]) as f:
        return f.read()


def _communication(r: Any, cost: Cost, chip: Any, slice_of: list[int]) -> dict[str, Any]:
    """A program's collectives (see :mod:`grpo.engine.planning.hlo`) and its roofline with
    them: ``max(compute, HBM, ICI)``, per decode step for the decode loop.

    ICI time is the bytes one chip receives over ``ici_bandwidth / 2`` (a chip takes in at
    most half of its published bidirectional figure). Collectives whose groups span TPU
    slices go over the data-center network instead: ``dcn_bytes``, reported as bytes only
    (no time: DCN bandwidth is a per-host NIC figure shared by its chips and not in the
    chip table). Chips of one slice are linked by ICI even across hosts (v6e-16: 4 hosts,
    one ICI torus), so single-slice plans have no DCN traffic.
    """
    from grpo.engine.planning import hlo

    none: dict[str, Any] = {"collective_bytes": None, "ici_bytes": None, "dcn_bytes": None, "ici_s": None,
                            "dcn_s": None, "roofline_no_comm_s": cost.roofline_s, "roofline_s": cost.roofline_s,
                            "hlo_source": r.hlo_source}
    if r.collectives is None:
        return none
    ops = r.collectives
    dcn = [op for op in ops if hlo.crosses(op, slice_of)]
    ici = [op for op in ops if not hlo.crosses(op, slice_of)]
    in_chip = chip.ici_bandwidth / 2
    ici_bytes = sum(op.total_bytes for op in ici)
    out: dict[str, Any] = {
        "collective_bytes": hlo.by_kind(ops),
        "ici_bytes": ici_bytes,
        "dcn_bytes": sum(op.total_bytes for op in dcn),
        "ici_s": ici_bytes / in_chip,
        "dcn_s": None,
        "roofline_no_comm_s": cost.roofline_s,
        "roofline_s": max(cost.roofline_s, ici_bytes / in_chip),
        "hlo_source": r.hlo_source,
        "unknown_trip_counts": sorted({n for op in ops for n in op.unknown_trips}),
        "largest_collectives": [hlo.summary(op) for op in sorted(ops, key=lambda o: -o.total_bytes)[:6]],
    }
    if cost.segments:
        # Decode: what the loops move is per generated token (the decode loop body's share,
        # its layer scan included); what runs once sits outside them.
        steps = sum(n for n, _, _ in cost.segments)
        loop_ici = sum(op.total_bytes for op in ici if op.in_loop)
        per_step = loop_ici / max(steps, 1) / in_chip
        out["collective_bytes_per_step"] = {k: v / max(steps, 1) for k, v in hlo.by_kind(ops, in_loop=True).items()}
        out["ici_s_per_step"] = per_step
        out["roofline_s"] = (sum(n * max(c, h, per_step) for n, c, h in cost.segments)
                             + (ici_bytes - loop_ici) / in_chip)
    return out


# --------------------------------------------------------------------------- costs


@dataclasses.dataclass(frozen=True)
class Cost:
    flops: float  # per device
    bytes: float  # per device
    roofline_s: float
    # decode: (steps, compute s, HBM s) per step of each segment, for a per-step roofline
    # that adds communication (see ``_communication``).
    segments: tuple[tuple[int, float, float], ...] = ()


def program_costs(
    programs: Any, arch: Any, chip: Any, *, rollout_weight_bytes: float | None = None, train_state_bytes: float = 0.0,
) -> dict[str, Cost]:
    """Per-device flops, HBM bytes and roofline time of each program of one step (and of
    one evaluation batch).

    With ``D`` hidden, ``F`` MLP width, ``H``/``Hk`` query/KV heads of ``E`` dims, ``V``
    vocabulary, ``Lyr`` layers, ``Wm = Lyr (2 D H E + 2 D Hk E + 3 D F)`` weight-matmul
    parameters and ``w`` the compute dtype's bytes:

    - a forward token costs ``2 Wm`` FLOPs plus attention ``4 S H E Lyr`` over ``S``
      attended slots (XLA computes the full masked square in training and prefill);
      the head ``2 D V`` per token whose logits are needed;
    - backward is twice the forward; ``remat: full`` adds one forward, ``dots`` the
      attention part of one;
    - the loss's head: ``jax`` 3 matmuls per completion token (forward, two in backward),
      ``pallas`` 5 (its custom VJP recomputes the logits in both backward kernels);
    - bytes: every program reads the whole (all-gathered) weights once per forward and
      twice per backward pass — the update and the reference pass once per micro-batch
      (``micro = sequences / micro_batch_size`` passes, the reference pass a forward
      each) — prefill writes the KV cache of its rows, decode reads the weights and the
      live KV cache once per step, and the optimizer reads and writes parameters,
      gradients and its state, split over ``fsdp x tp`` (``dp`` replicates them);
    - rows per device: the update's ``P keep / (dp fsdp)`` (``keep``: ``train.down_sampling.keep``,
      else ``K``), decode's ``P K / rollout shards``;
      prefill's prompts are split over the part of the rollout shards they divide;
    - evaluation (``eval.every_n_steps > 0``): ``eval_prefill`` and ``eval_decode`` are
      prefill and decode of one eval batch — ``eval.k`` samples of each of its prompts,
      padded as :meth:`~grpo.engine.programs.RunPrograms.eval_batch` pads it;
    - a rollout in its own layout (``serving``, ``rollout_weight_bytes`` per chip) reads
      its shard of the weights instead of all of them, its prefill/decode FLOPs split
      ``tp`` ways, and its KV cache too when the KV heads divide over ``tp``; the
      ``reshard`` program reads the training shard (``train_state_bytes``) and writes
      the copy once per step.

    LoRA (``Na`` adapter parameters, ``r (in + out)`` per targeted projection and layer):
    a forward token adds ``2 Na``; backward computes the frozen base's input gradients
    only (``2 Wm``, no weight gradients, so the base is read once, not twice) and the
    adapters' input and weight gradients (``4 Na``); the reference pass runs the base
    alone. QLoRA's base projections are read as their codes (4 or 8 bits) plus one f32
    scale per block. The optimizer reads and writes the f32 adapters, their gradients and
    two moments (no master copy).
    """
    from grpo.engine.rollout.multiturn import MultiTurnSampler, append_bucket

    cfg = programs.config
    c = arch
    D, F, H, Hk, E, V, Lyr = (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                              c.head_dim, c.vocab_size, c.num_hidden_layers)
    wm = Lyr * (2 * D * H * E + 2 * D * Hk * E + 3 * D * F)
    w = 2 if cfg.model.compute_dtype == "bfloat16" else 4
    lora = cfg.model.lora
    na = _adapter_count(c, lora) if lora is not None else 0
    proj_bytes = float(w)  # bytes per projection weight read by one pass
    if lora is not None and lora.base_quantization != "none":
        proj_bytes = (4 if lora.base_quantization == "nf4" else 8) / 8 + 4 / lora.quantization_block
    base_bytes = wm * proj_bytes + D * V * w
    weight_bytes = base_bytes + na * 4  # gathered weights (+ f32 adapters) read by one pass
    peak, bw = chip.bf16_flops, chip.hbm_bandwidth
    if w == 4:
        peak = peak / 3  # f32 matmuls run as ~3 bf16 passes on the MXU (a generous bound)

    def roof(flops: float, nbytes: float) -> float:
        return max(flops / peak, nbytes / bw)

    out: dict[str, Cost] = {}
    layout = programs.layout
    ro = programs.rollout
    rollout_shards = math.prod(ro.mesh.shape[a] for a in programs.batch_axes)
    train_shards = layout.dp * layout.fsdp
    # The rollout's weights per chip: on the training layout all of them (FSDP gathers
    # every layer for each pass); in a serving layout its shard (1/tp of the split
    # matrices), which is also all the matmul work a chip does.
    tp = ro.tensor_parallel if ro.resharded else 1
    kv_split = math.gcd(int(ro.mesh.shape["tp"]), Hk) if ro.resharded else 1
    rollout_weights = rollout_weight_bytes if rollout_weight_bytes is not None else weight_bytes
    inputs = programs.abstract_rollout_inputs()
    P, Lp = inputs["prompt_tokens"].shape
    K = cfg.rollout.num_generations
    B = P * cfg.group_size  # the update's rows (down-sampling trains on keep of the K rolled out)
    kv_tok = 2 * Lyr * Hk * E * w / kv_split

    def rollout(prompts: int, k: int, sampler: Any) -> tuple[Cost, ...]:
        # prefill: the prompts of Lp tokens, split over the part of the rollout shards
        # they divide (replicated at worst); logits of the last position only; the cache
        # written k times over, split like the decode rows.
        p_rows = programs.prompt_sharding((prompts, Lp)).shard_shape((prompts, Lp))[0]
        rows = prompts * k / rollout_shards
        flops = p_rows * (Lp * 2 * (wm + na) + 4 * Lp * Lp * H * E * Lyr + 2 * D * V) / tp
        nbytes = rollout_weights + rows * Lp * kv_tok
        prefill = Cost(flops, nbytes, roof(flops, nbytes))
        # decode: step 0 samples from the prefill logits; each later step is one token per row.
        f_tot = b_tot = t_tot = 0.0
        segs = []
        # A multi-turn rollout's cache has its final size from the start: all turns
        # together sample at most N tokens per row, each step reading every slot.
        multi = isinstance(sampler, MultiTurnSampler)
        plan = ((0, sampler.width() - 1),) if multi else sampler.plan()
        for a, b in plan:
            steps = b - a
            slots = sampler.allocated(Lp) if multi else Lp + b  # the cache length, all read every step
            f = rows * (2 * (wm + na) + 2 * D * V + 4 * slots * H * E * Lyr) / tp
            by = rollout_weights + rows * slots * kv_tok
            f_tot += steps * f
            b_tot += steps * by
            t_tot += steps * roof(f, by)
            segs.append((steps, f / peak, by / bw))
        if not multi:
            return prefill, Cost(f_tot, b_tot, t_tot, tuple(segs))
        # append: one forward of the largest append bucket's L tokens per row against the
        # whole cache, once between turns (max_turns - 1 times at most).
        L, slots, turns = append_bucket(cfg.rollout.max_new_tokens), sampler.allocated(Lp), sampler.max_turns - 1
        f = rows * (L * 2 * (wm + na) + 4 * L * slots * H * E * Lyr + 2 * D * V) / tp
        by = rollout_weights + rows * slots * kv_tok
        return prefill, Cost(f_tot, b_tot, t_tot, tuple(segs)), Cost(turns * f, turns * by, turns * roof(f, by))

    stops = () if programs.multi_turn else None
    names = ("prefill", "decode", "append")
    out.update(zip(names, rollout(P, K, programs.sampler(turn_stop_ids=stops))))
    if cfg.eval.every_n_steps > 0:
        # One eval batch, padded as the Evaluator pads it (padding rows cost like real ones).
        out.update(zip(EVAL_PROGRAMS, rollout(programs.eval_batch()[1], cfg.eval.k, programs.eval_sampler(stops))))
    if ro.resharded:
        # The once-per-step reshard reads the training shard and writes the rollout copy.
        nbytes = (rollout_weight_bytes or 0) + train_state_bytes
        out["reshard"] = Cost(0.0, nbytes, roof(0.0, nbytes))

    S = Lp + cfg.rollout.max_new_tokens
    N = cfg.rollout.max_new_tokens
    rows = B / train_shards
    attn_tok = 4 * S * H * E * Lyr
    fwd_tok = 2 * (wm + na) + attn_tok
    micro = cfg.sequences_per_step // cfg.micro_batch_size
    if cfg.loss.beta > 0:
        ref_tok = 2 * wm + attn_tok  # LoRA: the base alone
        # Micro-batched like the update: one forward pass reads the weights per micro-batch.
        ref_bytes = micro * (base_bytes if lora is not None else weight_bytes)
        flops = rows * (S * ref_tok + N * 2 * D * V)
        out["reference"] = Cost(flops, ref_bytes, roof(flops, ref_bytes))

    remat = cfg.model.remat
    # Backward: input and weight gradients of every trained matmul, input gradients only
    # through a frozen base; attention's two matmuls have no weights.
    bwd_tok = (2 * wm + 4 * na if lora is not None else 4 * wm) + 2 * attn_tok
    body = fwd_tok + bwd_tok + (fwd_tok if remat == "full" else attn_tok if remat == "dots" else 0)
    head = (5 if cfg.loss.impl == "pallas" else 3) * 2 * D * V
    flops = rows * (S * body + N * head)
    # Weight reads per micro-batch: forward, backward (twice for weight gradients; once for
    # LoRA's frozen base, input gradients only), remat's recomputed forward.
    passes = (2 if lora is not None else 3) + (1 if remat in ("full", "dots") else 0)
    # Parameters, gradients and optimizer state are split over fsdp x tp; dp replicates them
    # (every dp group runs the same optimizer step on its own copy).
    shards = layout.fsdp * layout.tp
    if lora is not None:
        # f32 adapters and gradients, two f32 moments, read and written.
        opt_bytes = 2 * na / shards * (2 * 4 + 2 * 4)
    else:
        n_params = c.num_params()
        p_item = 2 if cfg.model.param_dtype == "bfloat16" else 4
        # optimizer: read params + grads (+ f32 copies and two moments) and write them back.
        opt_bytes = 2 * n_params / shards * (2 * p_item + 3 * 4)
    nbytes = micro * passes * weight_bytes + opt_bytes
    out["update"] = Cost(flops, nbytes, roof(flops, nbytes))
    return out


def _adapter_count(arch: Any, lora: Any) -> int:
    """Parameters of the adapters ``lora`` (a ``model.lora`` section) gives ``arch``."""
    from grpo.models.lora import adapter_specs, resolve_spec

    return sum(math.prod(shape) for shape, _ in adapter_specs(arch, resolve_spec(arch, lora)).values())


# --------------------------------------------------------------------------- planning


@dataclasses.dataclass
class ProgramResult:
    name: str
    memory: dict[str, int] | None
    xla: dict[str, float]
    error: str | None
    takes: tuple[str, ...]  # resident state it takes as arguments
    hlo: str | None = None  # the optimized HLO text
    hlo_source: str | None = None  # "xla_dump" or "as_text" (see ``_compile``)
    collectives: list[Any] | None = None  # hlo.Collective, None without HLO


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

    def plan(self, config: RunConfig) -> dict[str, Any]:
        import jax

        from grpo.models.lora import count_params, split_params

        programs, full, arch = self.build(config)
        params, frozen = split_params(full)  # LoRA: adapters train, the base is frozen
        lora = config.model.lora
        lora_report = None
        if lora is not None:
            from grpo.models.lora import resolve_spec

            resolved = resolve_spec(arch, lora)
            scales = _scales(frozen)
            lora_report = {
                "rank": resolved.rank,
                "alpha": resolved.alpha,
                "targets": list(resolved.targets),
                "base_quantization": lora.base_quantization,
                # nf4/int8 quantize every projection of the base, targeted or not.
                "quantized": list(scales),
                "quantization_block": lora.quantization_block,
                "quantization_scales": sum(scales.values()),
                # Per device, as state_bytes_per_device counts them (uint4 codes at 4 bits).
                "adapter_bytes": _bytes_per_device(params),
                "base_bytes": _bytes_per_device(frozen),
            }
        opt_state = programs.abstract_opt_state(params)
        # A multi-turn task (tools): the turn decode and the append instead of one decode
        # (the turn-stop tokens are constants of the program; none are needed to plan it).
        stops = () if programs.multi_turn else None
        sampler = programs.sampler(turn_stop_ids=stops)
        inputs = programs.abstract_rollout_inputs()
        batch = programs.abstract_update_batch()
        state = {
            "parameters": _bytes_per_device(full),
            "optimizer_state": _bytes_per_device(opt_state),
            # Full fine-tuning keeps a frozen copy; LoRA's reference is the base itself.
            "reference_parameters": _bytes_per_device(full) if config.loss.beta > 0 and frozen is None else 0,
        }
        # model.lora.sampler=merged: the rollout reads a merged copy of every targeted
        # projection, made once per step and dropped before the update; the programs take
        # the merged state, and the base's own projections stay resident beside it.
        ro = programs.rollout
        state["merged_projections"] = (
            _merged_projection_bytes(full) if programs.merged_sampling and not ro.resharded else 0)
        # A rollout in its own layout reads a copy of the policy made once per step
        # (merged on the way with model.lora.sampler=merged), dropped before the update.
        rollout_state = None
        if ro.resharded:
            rollout_state = jax.tree.map(
                lambda leaf, sh: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh), full, ro.shardings(full))
        state["rollout_parameters"] = _bytes_per_device(rollout_state) if rollout_state is not None else 0
        sampler_args = rollout_state if rollout_state is not None else full

        P, Lp = inputs["prompt_tokens"].shape
        B = P * config.rollout.num_generations
        seg = sampler.plan()
        dt = jax.numpy.dtype(config.model.compute_dtype)

        def kv_bytes(sampler: Any, rows: int) -> int:
            """Per-device bytes of the final KV cache of ``rows`` sampled rows."""
            slots = sampler.allocated(Lp) if stops is not None else Lp + (seg[-1][1] if seg else 0)
            cache_shape = (arch.num_hidden_layers, rows, slots, arch.num_key_value_heads, arch.head_dim)
            return 2 * math.prod(sampler.cache_sharding(cache_shape).shard_shape(cache_shape)) * dt.itemsize

        state["kv_cache"] = kv_bytes(sampler, B)
        # Evaluation (every eval.every_n_steps steps): the same sampler's programs with
        # eval.k samples of each prompt of an eval batch, padded as the Evaluator pads it.
        evaluating = config.eval.every_n_steps > 0
        if evaluating:
            eval_sampler = programs.eval_sampler(stops)
            eval_inputs = programs.abstract_eval_inputs()
            eval_prompts, eval_padded = programs.eval_batch()
            eval_rows = eval_padded * config.eval.k

        def keyed(name: str, exclude: tuple[str, ...]) -> tuple:
            data = config.model_dump(mode="json")
            for path in exclude:
                sec, _, field = path.partition(".")
                if field:
                    data.get(sec, {}).pop(field, None)
                else:
                    data.pop(sec, None)
            return (name, json.dumps(data, sort_keys=True))

        # What the rollout programs do not depend on (a search recompiles only the update).
        rollout_only = ("train.micro_batch_size", "train.ppo_epochs", "train.optimizer", "train.steps", "loss",
                        "eval", "checkpoint", "logging", "name")
        # What the reference pass and the update do not depend on (comparing rollout layouts
        # recompiles only the rollout programs).
        rollout_layout_only = ("rollout.style", "rollout.options")
        # What the eval programs do not depend on.
        eval_only = ("train", "rollout.num_generations", "loss", "checkpoint", "logging", "name")
        results: list[ProgramResult] = []

        def reshard_lower():
            fn = programs.reshard_jit(full)
            return fn.lower(params, frozen) if programs.merged_sampling and frozen is not None else fn.lower(full)

        def prefill_lower(sampler: Any = sampler, inputs: dict = inputs) -> Any:
            return sampler.prefill_jit.lower(sampler_args, inputs["prompt_tokens"], inputs["prompt_mask"])

        def rows_of(sampler: Any, B: int, *rest: int, dtype: Any = jax.numpy.int32, names=("length",)):
            shape = (B, *rest)
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sampler._sharding(shape, ("batch", *names[: len(rest)])))

        def rollout_state(sampler: Any, B: int, slots: int) -> tuple:
            from grpo.models.decoder import KVCache

            shape = (arch.num_hidden_layers, B, slots, arch.num_key_value_heads, arch.head_dim)
            kv = jax.ShapeDtypeStruct(shape, dt, sharding=sampler.cache_sharding(shape))
            logits = rows_of(sampler, B, arch.vocab_size, dtype=jax.numpy.float32, names=("vocab",))
            key = jax.random.key(config.train.seed)
            data = jax.random.key_data(key)
            raw = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=ro.replicated())
            return KVCache(k=kv, v=kv), logits, raw, jax.random.key_impl(key)

        def decode_lower(sampler: Any = sampler, B: int = B) -> Any:
            if stops is not None:
                return turn_lower(sampler, B)
            cache, logits, raw, impl = rollout_state(sampler, B, Lp + (seg[0][1] if seg else 0))
            toks = rows_of(sampler, B, Lp)
            return sampler.decode_jit().lower(sampler_args, cache, logits, toks, toks, raw, key_impl=impl)

        scalar = jax.ShapeDtypeStruct((), jax.numpy.int32, sharding=ro.replicated())

        def turn_lower(sampler: Any, B: int) -> Any:
            slots = sampler.allocated(Lp)
            cache, logits, raw, impl = rollout_state(sampler, B, slots)
            return sampler.turn_jit.lower(sampler_args, cache, rows_of(sampler, B, slots, dtype=bool), logits,
                                          rows_of(sampler, B), scalar, rows_of(sampler, B), raw, scalar, key_impl=impl)

        def append_lower(sampler: Any = sampler, B: int = B) -> Any:
            from grpo.engine.rollout.multiturn import append_bucket

            slots, L = sampler.allocated(Lp), append_bucket(config.rollout.max_new_tokens)
            cache, logits, _, _ = rollout_state(sampler, B, slots)
            return sampler.append_jit.lower(sampler_args, cache, rows_of(sampler, B, slots, dtype=bool), logits,
                                            rows_of(sampler, B), scalar, rows_of(sampler, B, L), rows_of(sampler, B, L))

        def reference_lower():
            # The trainer runs it before the update, on the batch without ref log-probs.
            ref = params if frozen is not None else full
            return programs.reference().lower(ref, batch._replace(ref_logprobs=None), frozen)

        def update_lower():
            return programs.update(params, opt_state).lower(params, opt_state, batch, frozen)

        rollout_takes = ("rollout_parameters",) if ro.resharded else ("parameters",)
        todo: list[tuple[str, Callable, tuple, tuple[str, ...]]] = []
        if ro.resharded:
            todo.append(("reshard", reshard_lower, keyed("reshard", rollout_only), ("parameters",)))
        todo += [
            ("prefill", prefill_lower, keyed("prefill", rollout_only), rollout_takes),
            ("decode", decode_lower, keyed("decode", rollout_only), rollout_takes),
        ]
        if stops is not None:
            todo.append(("append", append_lower, keyed("append", rollout_only), rollout_takes))
        if config.loss.beta > 0:
            # LoRA's reference pass reads the policy's own base (adapters off).
            ref_takes = ("reference_parameters",) if frozen is None else ("parameters",)
            todo.append(("reference", reference_lower, keyed("reference", rollout_layout_only), ref_takes))
        todo.append(("update", update_lower, keyed("update", rollout_layout_only), ("parameters", "optimizer_state")))
        if evaluating:
            todo += [
                ("eval_prefill", lambda: prefill_lower(eval_sampler, eval_inputs), keyed("eval_prefill", eval_only),
                 rollout_takes),
                ("eval_decode", lambda: decode_lower(eval_sampler, eval_rows), keyed("eval_decode", eval_only),
                 rollout_takes),
            ]
            if stops is not None:
                todo.append(("eval_append", lambda: append_lower(eval_sampler, eval_rows),
                             keyed("eval_append", eval_only), rollout_takes))
        for name, lower, key, takes in todo:
            if key not in self._cache:
                self._cache[key] = self._compile(name, lower, takes)
            results.append(self._cache[key])

        costs = program_costs(programs, arch, self.topology.chip,
                              rollout_weight_bytes=state["rollout_parameters"] if ro.resharded else None,
                              train_state_bytes=state["parameters"])
        # Partition id -> TPU slice (the program's device assignment is the mesh's order).
        slice_of = [getattr(d, "slice_index", 0) or 0 for d in programs.mesh.devices.flat]
        if self.dump_hlo:
            import os

            os.makedirs(self.dump_hlo, exist_ok=True)
            for r in results:
                if r.hlo:
                    with open(os.path.join(self.dump_hlo, f"{r.name}.hlo.txt"), "w") as f:
                        f.write(r.hlo)
        hbm = self.hbm_bytes
        # Resident between programs: the training state (the rollout copy only while the
        # rollout programs run, which take it as their argument).
        resident_total = state["parameters"] + state["optimizer_state"] + state["reference_parameters"]
        report_programs: dict[str, Any] = {}
        peaks: list[int] = []
        errors: list[str] = []
        for r in results:
            resident = resident_total - sum(state[t] for t in r.takes if t != "rollout_parameters")
            if r.name in ROLLOUT_PROGRAMS:
                resident += state["merged_projections"]
            cost = costs[r.name]
            entry: dict[str, Any] = {
                "argument_bytes": None, "output_bytes": None, "alias_bytes": None, "temp_bytes": None,
                "generated_code_bytes": None, "program_bytes": None, "resident_bytes": resident,
                "peak_bytes": None,
                "flops": cost.flops, "bytes_accessed": cost.bytes, "roofline_s": cost.roofline_s,
                "xla_flops": r.xla.get("flops"), "xla_bytes_accessed": r.xla.get("bytes accessed"),
                "compiler_error": r.error,
            }
            entry.update(_communication(r, cost, self.topology.chip, slice_of))
            if r.memory is not None:
                entry.update({k: v for k, v in r.memory.items()})
                entry["peak_bytes"] = r.memory["program_bytes"] + resident
                peaks.append(entry["peak_bytes"])
            elif r.error is not None:
                errors.append(f"{r.name}: {r.error}")
                need = _first_size(r.error) if "memory" in r.error.lower() or "hbm" in r.error.lower() else None
                if need is not None:
                    # The message counts the program's temporaries; its state arguments
                    # (parameters, optimizer state) come on top: a lower bound on the peak.
                    entry["peak_bytes"] = need + sum(state[t] for t in r.takes) + resident
                    peaks.append(entry["peak_bytes"])
            report_programs[r.name] = entry

        peak = max(peaks) if peaks else None
        fits = peak is not None and peak <= hbm and not errors
        step_roofline = sum(
            p["roofline_s"] * (config.train.ppo_epochs if n == "update" else 1)
            for n, p in report_programs.items() if n not in EVAL_PROGRAMS
        )
        step_roofline_no_comm = sum(
            costs[n].roofline_s * (config.train.ppo_epochs if n == "update" else 1)
            for n in report_programs if n not in EVAL_PROGRAMS
        )
        eval_report = None
        if evaluating:
            # One eval batch; a whole evaluation runs ceil(examples / prompts) of them, and
            # the split's size is known here only through eval.num_examples.
            batch_s = sum(report_programs[n]["roofline_s"] for n in EVAL_PROGRAMS if n in report_programs)
            batches = math.ceil(config.eval.num_examples / eval_prompts) if config.eval.num_examples else None
            eval_report = {
                "every_n_steps": config.eval.every_n_steps,
                "k": config.eval.k,
                "prompts_per_batch": eval_prompts,
                "padded_prompts_per_batch": eval_padded,
                "rows_per_batch": eval_rows,
                "kv_cache_bytes": kv_bytes(eval_sampler, eval_rows),
                "batches": batches,
                "roofline_batch_s": batch_s,
            }
        layout = programs.layout
        n_trainable = count_params(params)
        n_frozen = count_params(frozen) - sum(_scales(frozen).values()) if frozen is not None else 0
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
            "chip_hbm_bytes": self.topology.chip.hbm_bytes,
            "state_bytes_per_device": state,
            "programs": report_programs,
            "peak_bytes_per_device": peak,
            "fits": bool(fits),
            "margin_bytes": (hbm - peak) if peak is not None else None,
            "compiler_error": "\n".join(errors) if errors else None,
            "roofline_step_s": step_roofline,
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
            "lora": lora_report,
            "chip": {
                "generation": self.topology.chip.generation,
                "bf16_flops": self.topology.chip.bf16_flops,
                "hbm_bandwidth_bytes_per_s": self.topology.chip.hbm_bandwidth,
                "ici_bandwidth_bytes_per_s": self.topology.chip.ici_bandwidth,
                "source": self.topology.chip.source,
            },
            "shape": {
                "sequences_per_step": config.sequences_per_step,
                "rollout_sequences_per_step": config.rollout_sequences_per_step,
                "micro_batch_size": config.micro_batch_size,
                "prompt_length": Lp,
                "max_new_tokens": config.rollout.max_new_tokens,
                "loss": config.loss.impl,
                "remat": config.model.remat,
                "attention": config.model.attention,
                "param_dtype": config.model.param_dtype,
            },
        }

    def _compile(self, name: str, lower: Callable, takes: tuple[str, ...]) -> ProgramResult:
        """Compile one program; its memory, the compiler's cost figures and its optimized
        HLO (for the collectives).

        The HLO comes from XLA's own dump (``xla_dump_to`` + ``xla_dump_hlo_as_text`` as
        per-compile ``compiler_options``, which a compile-only TPU client honours; the
        ``*.after_optimizations.txt`` file), else from ``compiled.as_text()``: with jax
        0.10.2 + libtpu 0.0.52, ``as_text()`` raises for the update program
        (``RET_CHECK ... async-update instruction should have 1 operands but sees 3``).
        """
        import shutil
        import tempfile

        import jax

        # A compile-only TPU client can neither read nor usefully write the persistent
        # compilation cache of this host's backend.
        cache_on = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        dump = tempfile.mkdtemp(prefix="grpo-plan-hlo-")
        try:
            lowered = lower()
            try:
                compiled = lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
            except Exception as err:  # a compiler that refuses the dump options
                if "xla_dump" not in str(err):
                    raise
                compiled = lowered.compile()
        except Exception as err:  # noqa: BLE001 - the compiler's verdict is the plan's result
            shutil.rmtree(dump, ignore_errors=True)
            return ProgramResult(name, None, {}, _compiler_text(err), takes)
        finally:
            jax.config.update("jax_enable_compilation_cache", cache_on)
        hlo_text, source = _read_dump(dump), "xla_dump"
        shutil.rmtree(dump, ignore_errors=True)
        if hlo_text is None:
            try:
                hlo_text, source = compiled.as_text(), "as_text"
            except Exception:  # noqa: BLE001 - no HLO: the plan reports no communication
                hlo_text, source = None, None
        ops = None
        if hlo_text:
            from grpo.engine.planning import hlo

            ops = hlo.collectives(hlo_text)
        ma = compiled.memory_analysis()
        arg, out, alias, temp = (ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
                                 ma.temp_size_in_bytes)
        code = ma.generated_code_size_in_bytes
        memory = {
            "argument_bytes": int(arg), "output_bytes": int(out), "alias_bytes": int(alias),
            "temp_bytes": int(temp), "generated_code_bytes": int(code),
            "program_bytes": int(arg + out - alias + temp + code),
        }
        xla: dict[str, float] = {}
        try:
            ca = compiled.cost_analysis()
            if isinstance(ca, (list, tuple)):
                ca = ca[0] if ca else {}
            xla = {k: float(v) for k, v in (ca or {}).items() if k in ("flops", "bytes accessed")}
        except Exception:  # noqa: BLE001 - cost analysis is optional
            pass
        return ProgramResult(name, memory, xla, None, takes, hlo_text, source, ops)


# --------------------------------------------------------------------------- search


def _candidates_micro(config: RunConfig, planner: Planner) -> list[int]:
    seqs = config.sequences_per_step
    out = []
    for mb in range(1, seqs + 1):
        if seqs % mb:
            continue
        try:
            resolve_layout(config.model_copy(update={"train": config.train.model_copy(update={"micro_batch_size": mb})}),
                           planner.topo)
        except ConfigError:
            continue
        out.append(mb)
    return out


def search(config_path: str, overrides: list[str], field: str, planner: Planner,
           limit: int = 1 << 16) -> dict[str, Any]:
    """The largest value of ``field`` whose plan fits: doubling over the valid values,
    then bisection between the last that fits and the first that does not."""
    if field not in SEARCH_FIELDS:
        raise UserError(f"--search {field!r}: searchable fields are {', '.join(SEARCH_FIELDS)}.")
    base = load_config(config_path, overrides)
    reports: dict[int, dict[str, Any]] = {}
    tried: list[list[Any]] = []

    def valid(value: int) -> RunConfig | None:
        try:
            cfg = load_config(config_path, list(overrides) + [f"{field}={value}"])
            resolve_layout(cfg, planner.topo)
            return cfg
        except ConfigError:
            return None

    def fits(value: int) -> bool:
        cfg = valid(value)
        rep = planner.plan(cfg)
        reports[value] = rep
        tried.append([value, rep["fits"]])
        return rep["fits"]

    if field == "train.micro_batch_size":
        values = _candidates_micro(base, planner)
    else:
        values = [p for p in range(1, limit + 1) if valid_prompts(base, p, planner)][:4096]
    if not values:
        raise UserError(f"--search {field}: no value is valid for this config on {planner.topology.name}.")
    # Start at the config's value; double up while it fits (halve down while it does not),
    # then bisect between the last value that fits and the first that does not.
    current = base.micro_batch_size if field == "train.micro_batch_size" else base.train.prompts_per_step
    i = values.index(current) if current in values else 0
    lo: int | None = None  # index of the largest value known to fit
    hi: int | None = None  # index of the smallest value known not to fit
    if fits(values[i]):
        lo = i
        while hi is None and lo < len(values) - 1:
            j = next((k for k in range(lo + 1, len(values)) if values[k] >= 2 * values[lo]), len(values) - 1)
            if fits(values[j]):
                lo = j
            else:
                hi = j
    else:
        hi = i
        while lo is None and hi > 0:
            j = max((k for k in range(hi) if values[k] <= values[hi] // 2), default=0)
            if fits(values[j]):
                lo = j
            else:
                hi = j
    if lo is not None and hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(values[mid]):
                lo = mid
            else:
                hi = mid
    best = values[lo] if lo is not None else None
    return {
        "field": field,
        "max_fitting": best,
        "tried": tried,
        "candidates": values,
        "plan": reports[best] if best is not None else reports[values[0]],
    }


def valid_prompts(config: RunConfig, prompts: int, planner: Planner) -> bool:
    cfg = config.model_copy(update={"train": config.train.model_copy(update={"prompts_per_step": prompts})})
    mb = cfg.train.micro_batch_size
    if mb is not None and cfg.sequences_per_step % mb:
        return False
    try:
        resolve_layout(cfg, planner.topo)
    except ConfigError:
        return False
    return True


WHOLE_SEQUENCE_PROGRAMS = ("prefill", "reference", "update", "eval_prefill")
"""Programs whose attention is ``model.attention``'s kernel; the rest (decode) use XLA's."""


def attention_report(config: RunConfig, programs: list[str]) -> dict[str, Any]:
    """``model.attention`` as resolved for TPU, and the attention each program runs."""
    from grpo.core.config import attention_plugin

    name, _, options = attention_plugin(config.model, "tpu")
    return {
        "name": name,
        "options": options.model_dump(mode="json"),
        "programs": {p: (name if p in WHOLE_SEQUENCE_PROGRAMS else "xla") for p in programs if p != "reshard"},
    }


# --------------------------------------------------------------------------- text


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f}"


def format_report(rep: dict[str, Any]) -> str:
    lines = [
        f"{rep['topology']} ({rep['topology_raw']}): {rep['processes']} process(es) x {rep['devices_per_process']} "
        f"{rep['device_kind']}; mesh " + ", ".join(f"{k}={v}" for k, v in rep["mesh"].items()),
        f"shape: {rep['shape']['sequences_per_step']} sequences/step"
        + (f" (of {rep['shape']['rollout_sequences_per_step']} rolled out)"
           if rep["shape"]["rollout_sequences_per_step"] != rep["shape"]["sequences_per_step"] else "")
        + f", micro-batch {rep['shape']['micro_batch_size']}, "
        f"prompt {rep['shape']['prompt_length']} + {rep['shape']['max_new_tokens']} new tokens, loss "
        f"{rep['shape']['loss']}, remat {rep['shape']['remat']}, params {rep['shape']['param_dtype']}",
        "state per device (GiB): " + ", ".join(
            f"{k} {_gib(v)}" for k, v in rep["state_bytes_per_device"].items()
            if v or k not in ("merged_projections", "rollout_parameters")),
    ]
    ro = rep.get("rollout_layout")
    if ro:
        how = ("resharded once per step into mesh " + ", ".join(f"{k}={v}" for k, v in ro["mesh"].items())
               if ro.get("resharded") else "on the training layout (weights gathered per token)")
        lines.append(f"rollout: style {rep.get('rollout_style')}, tensor_parallel {ro['tensor_parallel']}, {how}")
    att = rep.get("attention")
    if att:
        by: dict[str, list[str]] = {}
        for prog, kernel in att["programs"].items():
            by.setdefault(kernel, []).append(prog)
        lines.append("attention: " + "; ".join(f"{k} ({', '.join(v)})" for k, v in by.items()))
    lora = rep.get("lora")
    if lora:
        base = f"{rep['shape']['param_dtype'] if lora['base_quantization'] == 'none' else lora['base_quantization']} base"
        lines.append(
            f"LoRA r={lora['rank']} alpha={lora['alpha']:g} on {', '.join(lora['targets'])}; {base}: "
            f"{rep['trainable_params'] / 1e6:,.2f} M trainable "
            f"({100 * rep['trainable_params'] / max(1, rep['trainable_params'] + rep['frozen_params']):.2f}%), "
            f"{rep['frozen_params'] / 1e6:,.1f} M frozen; per device: adapters {_gib(lora['adapter_bytes'])} GiB, "
            f"base {_gib(lora['base_bytes'])} GiB"
        )
    elif "trainable_params" in rep:
        lines.append(f"full fine-tuning: {rep['trainable_params'] / 1e6:,.1f} M trainable parameters")
    lines += [
        "",
        f"{'PROGRAM':<12} {'ARGS':>7} {'OUT':>7} {'TEMP':>7} {'RESIDENT':>9} {'PEAK':>7}  {'TFLOP':>8} "
        f"{'GB READ':>8} {'COMM GB':>8} {'ICI':>8} {'ROOFLINE':>9}",
    ]
    for name, p in rep["programs"].items():
        comm = p.get("ici_bytes")
        lines.append(
            f"{name:<12} {_gib(p['argument_bytes']):>7} {_gib(p['output_bytes']):>7} {_gib(p['temp_bytes']):>7} "
            f"{_gib(p['resident_bytes']):>9} {_gib(p['peak_bytes']):>7}  {p['flops'] / 1e12:>8.2f} "
            f"{p['bytes_accessed'] / 1e9:>8.2f} "
            + (f"{comm / 1e9:>8.2f} {p['ici_s']:>7.3f}s" if comm is not None else f"{'-':>8} {'-':>8}")
            + f" {p['roofline_s']:>8.3f}s"
        )
    lines.append("(GiB per device; TFLOP and GB per device; COMM: GB one chip receives per program run, ICI: that "
                 "over half its ICI bandwidth)")
    dec = rep["programs"].get("decode", {})
    if dec.get("collective_bytes_per_step") is not None:
        total = sum(dec["collective_bytes_per_step"].values())
        kinds = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in dec["collective_bytes_per_step"].items()
                          if v and v >= 1e-3 * total)
        lines.append(
            f"decode per generated token: {total / 1e9:.3f} GB per chip "
            f"({kinds or 'none'}), ICI {dec['ici_s_per_step'] * 1e3:.2f} ms"
        )
    lines.append("")
    verdict = "fits" if rep["fits"] else "DOES NOT FIT"
    margin = rep["margin_bytes"]
    lines.append(
        f"peak {_gib(rep['peak_bytes_per_device'])} GiB of {_gib(rep['hbm_bytes_per_device'])} GiB HBM per device: "
        f"{verdict}" + (f" (margin {_gib(margin)} GiB)" if margin is not None else "")
    )
    lines.append(f"roofline lower bound of one step: {rep['roofline_step_s']:.2f} s"
                 + (f" ({rep['roofline_step_no_comm_s']:.2f} s without communication)"
                    if "roofline_step_no_comm_s" in rep else ""))
    ev = rep.get("eval")
    if ev:
        whole = (f", of one evaluation ({ev['batches']} batches): {rep['roofline_eval_s']:.2f} s"
                 if ev["batches"] else "")
        lines.append(
            f"evaluation every {ev['every_n_steps']} steps: batches of {ev['prompts_per_batch']} prompts (padded to "
            f"{ev['padded_prompts_per_batch']}) x k={ev['k']} = {ev['rows_per_batch']} rows, KV cache "
            f"{_gib(ev['kv_cache_bytes'])} GiB per device; roofline of one batch {ev['roofline_batch_s']:.2f} s{whole}"
        )
    if rep["compiler_error"]:
        lines.append("compiler: " + rep["compiler_error"])
    for w in rep.get("mesh_warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)


__all__ = ["Planner", "SEARCH_FIELDS", "format_report", "program_costs", "search"]
