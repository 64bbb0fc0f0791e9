"""The one cost model: FLOPs, HBM bytes and roofline time per chip of a run's programs.

``grpo plan`` states it for every program of a step (:func:`program_costs`, with the
communication read from the compiled HLO: :func:`communication`), and a rollout style's
``tensor_parallel: auto`` picks its serving layout by it (:func:`decode_step_estimate`,
called by :func:`grpo.engine.rollout.layout.choose_layout`). Both count a decode step
with :func:`decode_step_cost`.

Why counted from the model's shapes and not read from the compiler: ``cost_analysis()``
counts the body of a while loop or scan once, whatever its trip count, and a Pallas
custom call reports no flops; the layers are a scan and decode is a loop.

This module imports no rollout module (the rollout room imports it): what it needs of a
sampler it reads from the sampler object it is given.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple


@dataclasses.dataclass(frozen=True)
class Cost:
    flops: float  # per device
    bytes: float  # per device
    roofline_s: float
    # decode: (steps, compute s, HBM s) per step of each segment, for a per-step roofline
    # that adds communication (see ``communication``).
    segments: tuple[tuple[int, float, float], ...] = ()


# --------------------------------------------------------------------------- decode


def matmul_params(dims: Any) -> int:
    """``Wm = Lyr (2 D H E + 2 D Hk E + 3 D F)``: the weight-matmul parameters of the
    layers (q/o, k/v and the three MLP projections; the head apart) that one token
    multiplies by. A mixture of experts: ``3 D k M + D X`` (its k routed experts of width
    M, and the router over X experts) in place of ``3 D F``."""
    d = dims
    D, F, H, Hk, E = d.hidden_size, d.intermediate_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim
    experts = getattr(d, "num_experts", 0)
    mlp = 3 * D * d.num_experts_per_tok * d.moe_intermediate_size + D * experts if experts else 3 * D * F
    return d.num_hidden_layers * (2 * D * H * E + 2 * D * Hk * E + mlp)


def kv_bytes_per_slot(dims: Any, *, itemsize: int, kv_split: int = 1) -> float:
    """Bytes of one cache slot of one row (k and v of every layer) on one chip, the KV
    heads split ``kv_split`` ways."""
    return 2 * dims.num_hidden_layers * dims.num_key_value_heads * dims.head_dim * itemsize / kv_split


class DecodeStep(NamedTuple):
    flops: float  # per chip
    weight_bytes: float  # the weights a chip reads (all it holds)
    cache_bytes: float  # the KV cache of its rows it reads

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.cache_bytes


def decode_step_cost(
    dims: Any, *, rows: float, slots: int, weight_bytes: float, itemsize: int, tp: int = 1, kv_split: int = 1,
    adapters: int = 0,
) -> DecodeStep:
    """One decode step on one chip: ``rows`` (per chip) each take one token through every
    layer against ``slots`` cached positions, all of them read.

    FLOPs ``rows (2 (Wm + Na) + 2 D V + 4 S H E Lyr) / tp`` (weight matmuls, LoRA
    adapters ``Na``, the head, attention over ``S`` slots), split ``tp`` ways; bytes: the
    chip's ``weight_bytes`` once plus the KV cache of its rows, split over ``kv_split``
    of the KV heads."""
    d = dims
    flops = rows * (
        2 * (matmul_params(d) + adapters) + 2 * d.hidden_size * d.vocab_size
        + 4 * slots * d.num_attention_heads * d.head_dim * d.num_hidden_layers
    ) / tp
    return DecodeStep(flops, weight_bytes, rows * slots * kv_bytes_per_slot(d, itemsize=itemsize, kv_split=kv_split))


def decode_step_estimate(
    layout: Any,
    dims: Any,
    *,
    rows: int,
    cache_slots: int,
    weight_bytes: float,
    chip: Any,
    compute_itemsize: int = 2,
    resident_bytes: float = 0.0,
) -> dict[str, float]:
    """Roofline of one decode step per chip in a serving ``layout`` (a
    :class:`~grpo.core.contracts.RolloutLayout`): ``max(compute, HBM, ICI)``.

    ``rows``: the global decode batch; ``cache_slots``: KV slots read per step (the
    final cache length: an upper bound); ``weight_bytes``: the whole sampler state's
    bytes (every weight once); ``resident_bytes``: per-chip training state that stays
    beside the rollout. HBM is the weights a chip holds (``1/tp`` of the matmul weights;
    the KV projections and the KV cache of its rows over the mesh's ``tp`` axis only,
    ``gcd(tp, KV heads)`` ways);
    ICI is two all-reduces of ``[rows, hidden]`` per layer (the attention and MLP
    outputs, ``2 (tp-1)/tp`` of the buffer into each chip, at half the chip's
    bidirectional ICI figure). It fits when the resident state, the chip's weights and
    its KV cache fit in its HBM."""
    tp = layout.tensor_parallel
    r = rows / layout.shards
    d = dims
    w = compute_itemsize
    kv_split = layout.mesh.tp  # KV heads split over the rollout mesh's tp axis only
    kv_proj = 2 * d.num_hidden_layers * d.hidden_size * d.num_key_value_heads * d.head_dim * w
    weights_chip = (weight_bytes - kv_proj) / tp + kv_proj / kv_split
    step = decode_step_cost(d, rows=r, slots=cache_slots, weight_bytes=weights_chip, itemsize=w, tp=tp,
                            kv_split=kv_split)
    ici_bytes = 2 * d.num_hidden_layers * 2 * (tp - 1) / tp * r * d.hidden_size * w if tp > 1 else 0.0
    compute_s = step.flops / chip.bf16_flops
    hbm_s = step.bytes / chip.hbm_bandwidth
    ici_in = getattr(chip, "ici_bandwidth", 0) / 2
    ici_s = ici_bytes / ici_in if ici_in else 0.0
    need = resident_bytes + step.weight_bytes + step.cache_bytes
    return {
        "step_s": max(compute_s, hbm_s, ici_s), "compute_s": compute_s, "hbm_s": hbm_s, "ici_s": ici_s,
        "memory_bytes": need, "fits": bool(need <= chip.hbm_bytes),
    }


# --------------------------------------------------------------------------- a run's programs


@dataclasses.dataclass(frozen=True)
class _Model:
    """One run's per-token figures (names as in :func:`program_costs`)."""

    dims: Any
    wm: int  # weight-matmul parameters
    na: int  # LoRA adapter parameters
    w: int  # compute dtype bytes
    base_bytes: float  # the (gathered) base weights one pass reads
    weight_bytes: float  # ... plus the f32 adapters
    peak: float  # FLOP/s
    bw: float  # HBM bytes/s

    def roof(self, flops: float, nbytes: float) -> float:
        return max(flops / self.peak, nbytes / self.bw)


def _model(arch: Any, cfg: Any, chip: Any) -> _Model:
    c = arch
    D, V = c.hidden_size, c.vocab_size
    wm = matmul_params(c)
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
    return _Model(c, wm, na, w, base_bytes, weight_bytes, peak, bw)


@dataclasses.dataclass(frozen=True)
class _RolloutSplit:
    """How a rollout's work splits over the chips."""

    prompt_length: int
    shards: int  # rollout batch shards
    tp: int  # matmul split (a serving layout's tensor parallelism; 1 on the training layout)
    kv_split: int
    weights: float  # the weights a chip reads per pass
    append_length: int | None  # multi-turn: the largest append bucket


def program_costs(
    programs: Any, arch: Any, chip: Any, *, rollout_weight_bytes: float | None = None, train_state_bytes: float = 0.0,
    append_length: int | None = None, rollout: bool = True,
) -> dict[str, Cost]:
    """Per-device flops, HBM bytes and roofline time of each program of one step (and of
    one evaluation batch). The rollout's programs are costed by its engine's cost model
    (:meth:`~grpo.core.contracts.RolloutEngine.plan`, or a multi-turn engine's ``width``,
    ``allocated``, ``cache_slots`` and ``max_turns``), which raises
    :class:`~grpo.core.contracts.NotPlanned` for an engine without one; ``rollout=False``
    leaves them out (the plan of an engine that is not planned).

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
      live KV cache once per step (:func:`decode_step_cost`), and the optimizer reads and
      writes parameters, gradients and its state, split over ``fsdp x tp`` (``dp``
      replicates them);
    - rows per device: the update's ``P keep / (dp fsdp)`` (``keep``: ``train.down_sampling.keep``,
      else ``K``), decode's ``P K / rollout shards``;
      prefill's prompts are split over the part of the rollout shards they divide;
    - a multi-turn task (``programs.multi_turn``; ``append_length``: the largest append
      bucket) decodes every turn against the final cache and appends the replies
      between turns;
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
    from grpo.engine.planning.shapes import abstract_rollout_inputs

    cfg = programs.config
    m = _model(arch, cfg, chip)
    if programs.multi_turn and append_length is None:
        raise ValueError("a multi-turn rollout's costs need append_length (its largest append bucket)")
    P, Lp = abstract_rollout_inputs(programs)["prompt_tokens"].shape
    split = _rollout_split(programs, arch, m, rollout_weight_bytes, append_length)
    out: dict[str, Cost] = {}
    names = ("prefill", "decode", "append")
    if rollout:
        out.update(zip(names, _rollout_costs(m, programs, split, P, cfg.rollout.num_generations, programs.sampler())))
    if rollout and cfg.eval.every_n_steps > 0:
        # One eval batch, padded as the Evaluator pads it (padding rows cost like real ones).
        eval_names = ("eval_prefill", "eval_decode", "eval_append")
        out.update(zip(eval_names, _rollout_costs(m, programs, split, programs.eval_batch()[1], cfg.eval.k,
                                                  programs.eval_sampler())))
    if programs.rollout.resharded:
        # The once-per-step reshard reads the training shard and writes the rollout copy.
        nbytes = (rollout_weight_bytes or 0) + train_state_bytes
        out["reshard"] = Cost(0.0, nbytes, m.roof(0.0, nbytes))
    if rollout and cfg.rollout.quantization.weights != "none":
        # The once-per-sync quantize (each engine's: evaluation's too): reads the rollout's
        # weights, writes their codes (one byte a weight; at most, the projections are most).
        nbytes = split.weights * (1 + 1 / m.w)
        for name in ("quantize", "eval_quantize") if cfg.eval.every_n_steps > 0 else ("quantize",):
            out[name] = Cost(0.0, nbytes, m.roof(0.0, nbytes))
    rows = P * cfg.group_size / programs.layout.data  # the update's rows per device
    out.update(_training_costs(m, programs, padded_work(rows=rows, prompt_length=Lp,
                                                        max_new_tokens=cfg.rollout.max_new_tokens)))
    out.update(_glue_costs(m, programs, split, P, Lp, rollout=rollout))
    return out


def _rollout_split(programs: Any, arch: Any, m: _Model, rollout_weight_bytes: float | None,
                   append_length: int | None) -> _RolloutSplit:
    """How ``programs``' rollout splits over the chips."""
    from grpo.engine.planning.shapes import abstract_rollout_inputs

    ro = programs.rollout
    Lp = abstract_rollout_inputs(programs)["prompt_tokens"].shape[1]
    return _RolloutSplit(
        prompt_length=Lp,
        shards=math.prod(ro.mesh.shape[a] for a in programs.batch_axes),
        # The rollout's weights per chip: on the training layout all of them (FSDP gathers
        # every layer for each pass); in a serving layout its shard (1/tp of the split
        # matrices), which is also all the matmul work a chip does.
        tp=ro.tensor_parallel if ro.resharded else 1,
        kv_split=math.gcd(int(ro.mesh.shape["tp"]), arch.num_key_value_heads) if ro.resharded else 1,
        weights=rollout_weight_bytes if rollout_weight_bytes is not None else m.weight_bytes,
        append_length=append_length if programs.multi_turn else None,
    )


def _glue_costs(m: _Model, programs: Any, split: _RolloutSplit, P: int, Lp: int,
                rollout: bool = True) -> dict[str, Cost]:
    """The step's small programs, as the bytes they move per device (no matmuls): a
    multi-turn rollout's ``start`` (the prefilled cache copied into its final size) for
    the step and an eval batch (the continuous engine's multi-turn ``read`` too: the
    turns finished at a chunk boundary, a slot's row each), LoRA's ``merge`` (merged sampling on the training layout:
    reads the base and adapters, writes the merged projections), ``row_sums`` (reward
    errors), ``gather_rows`` (the rows trained on, gathered from every round),
    ``turn_advantages``, ``to_train`` (every update-batch array resharded), LoRA
    dropout's ``dropout_keys`` (its ``policy_logprobs`` pass is one of the passes over the
    batch: :func:`_training_costs`) and packing's ``sequence_lengths``, ``pack`` and
    ``unpack``. ``rollout=False``: without the engine's (``start``, ``read``)."""
    cfg, layout, d = programs.config, programs.layout, m.dims
    N, K = cfg.rollout.max_new_tokens, cfg.rollout.num_generations
    devices = layout.size
    rows_ro, rows = P * K / split.shards, P * cfg.group_size / layout.data
    # Every update-batch array: prompts and masks [Lp] x 2, tokens, mask, advantages,
    # sampler log-probs and the loss mask [N], 4 bytes each, read and written.
    batch_bytes = 2 * 4 * rows * (2 * Lp + 5 * N)

    def moved(nbytes: float) -> Cost:
        return Cost(0.0, nbytes, m.roof(0.0, nbytes))

    out: dict[str, Cost] = {}
    # The multi-turn sampler's and the continuous engine's ``start``: the cache (the page
    # pool: its slots at the cap) written once.
    paged = programs.sampler().simulates  # a page pool (the continuous engine)
    if rollout and (programs.multi_turn or paged):
        kv_tok = kv_bytes_per_slot(d, itemsize=m.w, kv_split=split.kv_split)
        for name, prompts, k, sampler in (("start", P, K, programs.sampler()),
                                          ("eval_start", programs.eval_batch()[1], cfg.eval.k,
                                           programs.eval_sampler() if cfg.eval.every_n_steps > 0 else None)):
            if sampler is not None:
                rows = sampler.slots_for(prompts * k, Lp) if paged else prompts * k
                out[name] = moved(rows / split.shards * (Lp + sampler.cache_slots(Lp)) * kv_tok)
                if "read" in sampler.jitted():  # the continuous engine's multi-turn turn reads
                    read = name.replace("start", "read")
                    out[read] = moved(sampler.slots_for(prompts * k, Lp) / split.shards * N * 4 * 3)
    if programs.merged_sampling and cfg.model.lora is not None and not programs.rollout.resharded:
        out["merge"] = moved((m.weight_bytes + m.base_bytes) / (layout.fsdp * layout.ep * layout.tp))
    out["row_sums"] = moved(4 * rows_ro * 8)
    if programs.selects_rows:
        rounds = cfg.train.dynamic_sampling.max_rounds if cfg.train.dynamic_sampling.enabled else 1
        out["gather_rows"] = moved(rounds * P * K / devices * 4 * (2 * Lp + 5 * N) + batch_bytes / 2)
    if cfg.train.advantage.credit == "turn":
        out["turn_advantages"] = moved(2 * 4 * rows * N)
    out["to_train"] = moved(batch_bytes)
    if programs.lora_dropout:
        out["dropout_keys"] = moved(8 * rows)
    if getattr(programs, "packing", False):
        # Packing (at the most bins a step compiles, one per sequence, of L tokens): the
        # rows' lengths read from the masks; the batch gathered into the bins (about 10
        # int32/f32 arrays [bins, L] written, the padded batch read); the log-probs
        # scattered back to the rows (values and 3 placement arrays read, [rows, N] written).
        L = cfg.bin_length
        out["sequence_lengths"] = moved(4 * rows * (Lp + N))
        out["pack"] = moved(batch_bytes / 2 + 4 * 10 * rows * L)
        out["unpack"] = moved(4 * (4 * rows * L + rows * N))
    return out


def _rollout_costs(m: _Model, programs: Any, split: _RolloutSplit, prompts: int, k: int,
                   sampler: Any) -> tuple[Cost, ...]:
    """Prefill, decode (and a multi-turn rollout's append) of ``prompts`` x ``k`` rows."""
    d, Lp, tp = m.dims, split.prompt_length, split.tp
    D, V, H, E, Lyr = d.hidden_size, d.vocab_size, d.num_attention_heads, d.head_dim, d.num_hidden_layers
    kv_tok = kv_bytes_per_slot(d, itemsize=m.w, kv_split=split.kv_split)
    # prefill: the prompts of Lp tokens, split over the part of the rollout shards
    # they divide (replicated at worst); logits of the last position only; the cache
    # written k times over, split like the decode rows.
    p_rows = programs.prompt_sharding((prompts, Lp)).shard_shape((prompts, Lp))[0]
    rows = prompts * k / split.shards
    flops = p_rows * (Lp * 2 * (m.wm + m.na) + 4 * Lp * Lp * H * E * Lyr + 2 * D * V) / tp
    nbytes = split.weights + rows * Lp * kv_tok
    prefill = Cost(flops, nbytes, m.roof(flops, nbytes))
    # decode: step 0 samples from the prefill logits; each later step is one token per row.
    f_tot = b_tot = t_tot = 0.0
    segs = []
    # A multi-turn rollout's cache has its final size from the start: all turns
    # together sample at most N tokens per row, each step reading every slot.
    multi = split.append_length is not None
    plan = ((0, sampler.width() - 1),) if multi else sampler.plan()
    for a, b in plan:
        steps = b - a
        slots = sampler.allocated(Lp) if multi else Lp + b  # the cache length, all read every step
        step = decode_step_cost(d, rows=rows, slots=slots, weight_bytes=split.weights, itemsize=m.w, tp=tp,
                                kv_split=split.kv_split, adapters=m.na)
        f, by = step.flops, step.bytes
        f_tot += steps * f
        b_tot += steps * by
        t_tot += steps * m.roof(f, by)
        segs.append((steps, f / m.peak, by / m.bw))
    if not multi:
        return prefill, Cost(f_tot, b_tot, t_tot, tuple(segs))
    # append: one forward of the largest append bucket's L tokens per row against the
    # whole cache, once between turns (max_turns - 1 times at most).
    L, slots, turns = split.append_length, sampler.cache_slots(Lp), sampler.max_turns - 1
    f = rows * (L * 2 * (m.wm + m.na) + 4 * L * slots * H * E * Lyr + 2 * D * V) / tp
    by = split.weights + rows * slots * kv_tok
    return prefill, Cost(f_tot, b_tot, t_tot, tuple(segs)), Cost(turns * f, turns * by, turns * m.roof(f, by))


@dataclasses.dataclass(frozen=True)
class TrainingWork:
    """The token work of one pass over a step's batch, per device: what the update, the
    reference pass and the policy log-prob pass cost in FLOPs.

    ``tokens``: positions run through the layers; ``attn_pairs``: (query, key) pairs the
    attention computes (the full square of each attended block: a padded row's ``S^2``,
    a packed bin's ``sum s_i^2`` over its sequences with a segment-aware kernel, or
    ``L^2`` with XLA's masked square); ``head_tokens``: positions whose logits the loss
    (or log-prob pass) computes (a padded row's ``N`` completion slots, every slot of a
    packed bin)."""

    tokens: float
    attn_pairs: float
    head_tokens: float
    # Micro-batches (each reads the weights once per pass); None: the config's. A packed
    # step's schedule picks its own (grpo.engine.training.packing.micro_schedule).
    micro_batches: float | None = None


def padded_work(*, rows: float, prompt_length: int, max_new_tokens: int) -> TrainingWork:
    """``rows`` per device, each ``S = Lp + N`` long: the padded layout."""
    S = prompt_length + max_new_tokens
    return TrainingWork(tokens=rows * S, attn_pairs=rows * S * S, head_tokens=rows * max_new_tokens)


def packed_work(*, bins: float, bin_length: int, square_sum: float, segment_attention: bool,
                micro_batches: float | None = None, head_tokens: float | None = None) -> TrainingWork:
    """``bins`` per device of ``bin_length`` slots in ``micro_batches`` micro-batches (None:
    the config's); ``square_sum``: the sum over the device's sequences of (prompt +
    completion tokens)^2 (what a kernel that skips the blocks between segments computes;
    without one, XLA computes each bin's full square); ``head_tokens``: the slots the loss's
    head runs on per device (the head layout's micro-batches x ``K``; None: every slot)."""
    pairs = square_sum if segment_attention else bins * bin_length * bin_length
    head = bins * bin_length if head_tokens is None else head_tokens
    return TrainingWork(tokens=bins * bin_length, attn_pairs=pairs, head_tokens=head, micro_batches=micro_batches)


def rollout_figures(programs: Any, arch: Any, chip: Any, *, rollout_weight_bytes: float | None = None) -> dict[str, Any]:
    """What a rollout pass costs a chip, as :func:`program_costs` counts it: the weights it
    reads, its matmul split ``tp``, the KV heads' split, the rollout's batch shards, the
    compute dtype's bytes, LoRA adapter parameters and the chip's peak FLOP/s (f32: a third)
    and HBM bandwidth (what :mod:`grpo.engine.planning.engine` costs a schedule with)."""
    m = _model(arch, programs.config, chip)
    sp = _rollout_split(programs, arch, m, rollout_weight_bytes, None)
    return {"weight_bytes": sp.weights, "tp": sp.tp, "kv_split": sp.kv_split, "shards": sp.shards, "itemsize": m.w,
            "adapters": m.na, "peak": m.peak, "bw": m.bw, "prompt_length": sp.prompt_length}


def training_costs(programs: Any, arch: Any, chip: Any, work: TrainingWork) -> dict[str, Cost]:
    """The passes over a step's batch (:func:`_training_costs`) for ``work``: what a plan
    under a length profile counts for the packed layout."""
    return _training_costs(_model(arch, programs.config, chip), programs, work)


def _training_costs(m: _Model, programs: Any, work: TrainingWork) -> dict[str, Cost]:
    """The reference pass (``loss.beta > 0``), LoRA dropout's ``policy_logprobs`` (a
    forward pass per micro-batch like the reference's, twice with ``loss.mismatch``) and
    the update (with the optimizer), for ``work`` per device."""
    cfg, layout, d = programs.config, programs.layout, m.dims
    D, V, H, E, Lyr = d.hidden_size, d.vocab_size, d.num_attention_heads, d.head_dim, d.num_hidden_layers
    lora = cfg.model.lora
    out: dict[str, Cost] = {}
    attn = 4 * H * E * Lyr * work.attn_pairs  # one forward's attention (scores and values)
    micro = work.micro_batches or cfg.sequences_per_step // cfg.micro_batch_size
    if cfg.loss.beta > 0:
        # LoRA: the base alone. Micro-batched like the update: one forward pass reads the
        # weights per micro-batch.
        ref_bytes = micro * (m.base_bytes if lora is not None else m.weight_bytes)
        flops = work.tokens * 2 * m.wm + attn + work.head_tokens * 2 * D * V
        out["reference"] = Cost(flops, ref_bytes, m.roof(flops, ref_bytes))
    if programs.lora_dropout:
        passes = 2 if cfg.loss.mismatch is not None else 1
        flops = passes * (work.tokens * 2 * (m.wm + m.na) + attn + work.head_tokens * 2 * D * V)
        nbytes = passes * micro * m.weight_bytes
        out["policy_logprobs"] = Cost(flops, nbytes, m.roof(flops, nbytes))

    remat = cfg.model.remat
    # Backward: input and weight gradients of every trained matmul, input gradients only
    # through a frozen base; attention's two matmuls have no weights (twice the forward's).
    fwd_lin = 2 * (m.wm + m.na)
    bwd_lin = 2 * m.wm + 4 * m.na if lora is not None else 4 * m.wm
    lin = fwd_lin + bwd_lin + (fwd_lin if remat == "full" else 0)
    attn_passes = 3 + (1 if remat in ("full", "dots") else 0)
    head = (5 if cfg.loss.impl == "pallas" else 3) * 2 * D * V
    flops = work.tokens * lin + attn_passes * attn + work.head_tokens * head
    # Weight reads per micro-batch: forward, backward (twice for weight gradients; once for
    # LoRA's frozen base, input gradients only), remat's recomputed forward.
    passes = (2 if lora is not None else 3) + (1 if remat in ("full", "dots") else 0)
    # Parameters, gradients and optimizer state are split over fsdp x ep x tp; dp replicates
    # them (every dp group runs the same optimizer step on its own copy).
    shards = layout.fsdp * layout.ep * layout.tp
    if lora is not None:
        # f32 adapters and gradients, two f32 moments, read and written.
        opt_bytes = 2 * m.na / shards * (2 * 4 + 2 * 4)
    else:
        n_params = d.num_params()
        p_item = 2 if cfg.model.param_dtype == "bfloat16" else 4
        # optimizer: read params + grads (+ f32 copies and two moments) and write them back.
        opt_bytes = 2 * n_params / shards * (2 * p_item + 3 * 4)
    nbytes = micro * passes * m.weight_bytes + opt_bytes
    out["update"] = Cost(flops, nbytes, m.roof(flops, nbytes))
    return out


def _adapter_count(arch: Any, lora: Any) -> int:
    """Parameters of the adapters ``lora`` (a ``model.lora`` section) gives ``arch``."""
    from grpo.models.lora import adapter_specs, resolve_spec

    return sum(math.prod(shape) for shape, _ in adapter_specs(arch, resolve_spec(arch, lora)).values())


# --------------------------------------------------------------------------- communication


def communication(collectives: list[Any] | None, hlo_source: str | None, cost: Cost, chip: Any,
                  slice_of: list[int]) -> dict[str, Any]:
    """A program's collectives (see :mod:`grpo.engine.planning.hlo`; None: no HLO) and its
    roofline with them: ``max(compute, HBM, ICI)``, per decode step for the decode loop.

    ICI time is the bytes one chip receives over ``ici_bandwidth / 2`` (a chip takes in at
    most half of its published bidirectional figure). Collectives whose groups span TPU
    slices go over the data-center network instead: ``dcn_bytes`` over the chip's share of
    its host's NICs (``dcn_bandwidth``: ``dcn_s``, in the roofline beside ICI). Chips of
    one slice are linked by ICI even across hosts (v6e-16: 4 hosts, one ICI torus), so
    single-slice plans have no DCN traffic.
    """
    from grpo.engine.planning import hlo

    none: dict[str, Any] = {"collective_bytes": None, "ici_bytes": None, "dcn_bytes": None, "ici_s": None,
                            "dcn_s": None, "roofline_no_comm_s": cost.roofline_s, "roofline_s": cost.roofline_s,
                            "hlo_source": hlo_source}
    if collectives is None:
        return none
    ops = collectives
    dcn = [op for op in ops if hlo.crosses(op, slice_of)]
    ici = [op for op in ops if not hlo.crosses(op, slice_of)]
    in_chip = chip.ici_bandwidth / 2
    ici_bytes = sum(op.total_bytes for op in ici)
    dcn_bytes = sum(op.total_bytes for op in dcn)
    dcn_s = dcn_bytes / chip.dcn_bandwidth if dcn_bytes and getattr(chip, "dcn_bandwidth", 0) else 0.0
    out: dict[str, Any] = {
        "collective_bytes": hlo.by_kind(ops),
        "ici_bytes": ici_bytes,
        "dcn_bytes": dcn_bytes,
        "ici_s": ici_bytes / in_chip,
        "dcn_s": dcn_s,
        "roofline_no_comm_s": cost.roofline_s,
        "roofline_s": max(cost.roofline_s, ici_bytes / in_chip, dcn_s),
        "hlo_source": hlo_source,
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


__all__ = ["Cost", "DecodeStep", "rollout_figures", "TrainingWork", "packed_work", "padded_work", "training_costs", "communication", "decode_step_cost", "decode_step_estimate", "kv_bytes_per_slot",
           "matmul_params", "program_costs"]
