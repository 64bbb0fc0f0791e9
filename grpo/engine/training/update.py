"""The policy update: loss plugin on the model's hidden states, exact gradient
accumulation over micro-batches, optimizer step that skips non-finite gradients.

Micro-batch ``m`` takes rows ``m, m + M, m + 2M, ...`` of the batch (a reshape
``[B] -> [B/M, M]`` and a transpose), so every micro-batch keeps the batch's even spread
over the data-parallel devices. A packed batch in the scheduled layout
(:func:`~grpo.engine.training.packing.schedule_packing`, [m_cap, W, L]) brings its own
micro-batches: the step's ``micro_batches`` of them run, in a loop whose trip count is
traced, so one compiled program serves every micro-batch count at a width ``W`` (and a
head width ``K``: the loss runs on the head layout, only the slots predicting a
completion token, its per-token log-probs scattered back to the bins). Each micro-batch loss is divided by the *global*
normaliser (valid tokens, sequences, or sequences x max length of the whole batch), so
summing the micro-batch losses and gradients gives the full-batch ones exactly (up to
float summation order).

Mixed precision (``master_weights``): the parameters the sampler and the reference pass
read stay in their storage dtype (bf16 in the recipes); the optimizer state holds an f32
master copy (:class:`MasterWeights`) and f32 moments. The update's forward and backward
run on the master (the model casts each weight to the compute dtype where it uses it), so
its gradients and their accumulation are f32 and equal those of an f32-parameter run
computing in bf16; after each step the parameters are the new master rounded. An AdamW update at lr 1e-6 is far below
half a bf16 ulp of a typical weight, so without the master it would round away.

Memory per parameter with AdamW: bf16 params 2 B + f32 master 4 B + two f32 moments 8 B
(+ 4 B f32 accumulator while micro-batching) = 14 (18) B, sharded like the parameters.

One precision rule for the output head on every path (sampler, policy loss, reference
pass): both operands of the head matmul in the compute dtype, accumulated in f32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from pydantic import BaseModel

from grpo.core.contracts import LossPlugin, LossSettings, compiling_for
from grpo.engine.training.optim import is_schedule_state
from grpo.engine.training.packing import PackedBatch, from_head, to_head
from grpo.engine.training.routing import is_moe, moe_call, router_losses, routing_metrics
from grpo.sharding import DATA_AXES


class UpdateBatch(NamedTuple):
    """One rollout batch laid out for the update (every array [B, ...], global)."""

    prompt_tokens: jax.Array  # B Lp
    prompt_mask: jax.Array  # B Lp
    tokens: jax.Array  # B N completion tokens
    mask: jax.Array  # B N completion mask (incl. stop token)
    advantages: jax.Array  # B
    old_logprobs: jax.Array | None  # B N
    ref_logprobs: jax.Array | None  # B N
    # B N, the sampler's behaviour log-probs (under the top-k/top-p truncated, renormalised
    # distribution that drew each token; the full-vocabulary ones without a filter); loss.mismatch only
    sampler_logprobs: jax.Array | None = None
    dropout_keys: jax.Array | None = None  # B 2 uint32 key data per row; LoRA dropout > 0 only
    truncated: jax.Array | None = None  # B bool; loss.mask_truncated only: these rows get no loss
    # B N, multi-turn rollouts: 1 on the model's own tokens. ``mask`` then also covers the
    # environment's inserted tokens: the forward attends to them, the loss never sees them.
    loss_mask: jax.Array | None = None
    # B N layers k int16, MoE with model.moe.router_replay on: the sampler's routed experts
    # of each completion token (-1: none; grpo.engine.training.routing)
    routed_experts: jax.Array | None = None

    @property
    def trained(self) -> jax.Array:
        """The tokens the loss, its normaliser and the log-prob metrics count: ``loss_mask``
        when there is one, else ``mask``."""
        return self.mask if self.loss_mask is None else self.loss_mask


class MasterWeights(NamedTuple):
    """Optimizer state of a mixed-precision run: the f32 master parameters the optimizer
    updates and the inner optimizer's state (its moments are f32 like the master)."""

    master: Any
    inner: Any


def init_optimizer_state(optimizer: optax.GradientTransformation, params: Any, *, master_weights: bool) -> Any:
    """The optimizer state for ``params``; with ``master_weights`` an f32 master copy too.

    Call it eagerly on sharded params: every array keeps its parameter's sharding."""
    if not master_weights:
        return optimizer.init(params)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return MasterWeights(master=master, inner=optimizer.init(master))


def keep_if_finite(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``finite``, else ``old`` (params, master and optimizer moments alike:
    a non-finite update changes nothing) -- except the schedule's update count, taken
    from ``new`` either way. The schedule's position is the optimizer call
    (:func:`~grpo.engine.training.optim.optimizer_schedule`): a skipped update spends its
    learning rate rather than delaying every later step's, so epochs stay aligned with
    steps and warm-up ends where configured. Adam's own bias-correction count is not the
    schedule's and stays with the moments it corrects."""
    def pick(n, o):
        return n if is_schedule_state(n) else jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)

    return jax.tree.map(pick, new, old, is_leaf=is_schedule_state)


def completion_hidden(model: Any, prompt_tokens, prompt_mask, tokens, mask, dropout_keys=None, moe=None):
    """Hidden states [B, N, D] at the positions that predict each completion token
    (``dropout_keys`` [B, 2]: one LoRA-dropout key per row, so a row's mask does not
    depend on which micro-batch it is in). With ``moe`` (a
    :class:`~grpo.models.layers.moe.MoeCall`): ``(hidden, the layers' routing)``."""
    from grpo.models.decoder import positions_from_mask

    lp = prompt_tokens.shape[1]
    full = jnp.concatenate([prompt_tokens, tokens], axis=1)  # B L
    # Completion slots after the stop token are padding: mask them out of attention.
    kv_mask = jnp.concatenate([prompt_mask, mask], axis=1).astype(bool)
    positions = positions_from_mask(kv_mask)
    out = model(full, positions, kv_mask, dropout_keys=dropout_keys, **({} if moe is None else {"moe": moe}))
    # Slot lp-1 (the last prompt token) predicts completion token 0, and so on.
    hidden = out[0][:, lp - 1 : -1]  # B N D
    return hidden if moe is None else (hidden, out[2])


def head_for(model: Any, hidden: jax.Array) -> jax.Array:
    """The output head [D, V] in the dtype of ``hidden`` (the compute dtype): the one
    precision rule of the head matmul, shared with the sampler's ``model.logits``."""
    return model.head_weight().astype(hidden.dtype)


def _split_micro(x: jax.Array | None, m: int) -> jax.Array | None:
    if x is None:
        return None
    b = x.shape[0]
    # B ... -> (B/M) M ... -> M (B/M) ...: micro-batch i holds rows i, i+M, ...
    return jnp.swapaxes(x.reshape((b // m, m) + x.shape[1:]), 0, 1)


def _axes_size(mesh: Any, axes: tuple[str, ...]) -> int:
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def _combine(key: str, acc: jax.Array, value: jax.Array, n: jax.Array) -> jax.Array:
    """Fold one part's metric into the running one: token counts add, ``/min`` and
    ``/max`` metrics take the extreme, the rest add ``value * n`` (divided by the total
    count at the end, :func:`_finish`): the token-weighted mean over all the parts."""
    if key == "num_tokens":
        return acc + value
    if key.endswith("/min"):
        return jnp.minimum(acc, value)
    if key.endswith("/max"):
        return jnp.maximum(acc, value)
    return acc + value * n


def _identity(key: str) -> jax.Array:
    return jnp.float32(jnp.inf if key.endswith("/min") else -jnp.inf if key.endswith("/max") else 0.0)


def _finish(metrics: dict[str, jax.Array], *, weighted: bool) -> dict[str, jax.Array]:
    """Means from token-weighted sums (``weighted``), and 0 for the extremes of a batch
    without a valid token (they are +-inf, the identities, until then)."""
    total = metrics["num_tokens"]
    out = {}
    for k, v in metrics.items():
        if k.endswith(("/min", "/max")):
            v = jnp.where(total > 0, v, 0.0)
        elif weighted and k != "num_tokens":
            v = v / jnp.maximum(total, 1.0)
        out[k] = v
    return out


def _merge_micro(x: jax.Array) -> jax.Array:
    m, mb = x.shape[:2]
    return jnp.swapaxes(x, 0, 1).reshape((m * mb,) + x.shape[2:])


def _micro(batch: PackedBatch, i: jax.Array) -> PackedBatch:
    """Micro-batch ``i`` (traced) of a scheduled batch: [m_cap, W, L] -> [W, L] (the
    leading axis is not sharded, so every device takes its own bins)."""
    return batch._replace(micro_batches=None, normalizer=None, **{
        f: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
        for f, x in zip(batch._fields, batch) if x is not None and f not in ("micro_batches", "normalizer")})


def _head_of(mb: UpdateBatch | PackedBatch):
    """``x`` [W, L] -> the loss's layout: the head layout of a batch that has one (only the
    slots predicting a completion token, [R, K]), else ``x`` itself."""
    index = getattr(mb, "head_index", None)
    return (lambda x: x) if index is None else (lambda x: to_head(x, index))


def _bins_of(mb: UpdateBatch | PackedBatch, values: jax.Array) -> jax.Array:
    """The loss's per-token ``values`` back in the batch's layout ([R, K] -> [W, L], 0 at the
    slots the head skipped)."""
    index = getattr(mb, "head_index", None)
    if index is None:
        return values
    return from_head(values, index, bins=mb.tokens.shape[0], length=mb.tokens.shape[1])


def _scheduled_map(one, batch: PackedBatch, *, adapters: bool) -> jax.Array:
    """``one`` (a micro-batch's per-token log-probs [W, L]) over the first
    ``batch.micro_batches`` micro-batches of a scheduled batch, into [m_cap, W, L] (0 in
    the micro-batches not run), by :func:`_micro_loop`: one compile for every m."""
    if not adapters:
        batch = batch._replace(dropout_keys=None)
    cap = batch.tokens.shape[0]
    return _micro_loop(batch, lambda i: one(_micro(batch, i)),
                       lambda i, out, values: jax.lax.dynamic_update_index_in_dim(out, values, i, 0),
                       lambda shape: jnp.zeros((cap,) + shape.shape, shape.dtype))


def _micro_loop(batch: PackedBatch, run, fold, init_of):
    """``fold(i, carry, run(i))`` over the first ``batch.micro_batches`` micro-batches of a
    scheduled batch, from the carry ``init_of(shapes of run's outputs)``: a loop with a
    traced trip count (one compile for every m), or for a layout of one micro-batch
    (``m_cap`` 1: every step runs exactly one) ``run(0)`` once, with no loop and no
    second trace for the shapes: XLA compiles a loop's body apart, fusing nothing across
    it (measured on a tiny CPU run, 16 rows in one micro-batch: the update's compile takes
    6.6 s of CPU instead of 7.0, and its trace one pass of the model fewer; the results
    bit-identical)."""
    cap = batch.tokens.shape[0]
    if cap == 1:
        out = run(0)
        return fold(0, init_of(out), out)
    init = init_of(jax.eval_shape(run, jnp.int32(0)))
    return jax.lax.fori_loop(0, jnp.minimum(batch.micro_batches, cap), lambda i, carry: fold(i, carry, run(i)), init)


def _scheduled_grads(grad_fn, params, batch: PackedBatch, normalizer):
    """:meth:`UpdateStep.grads` over the first ``batch.micro_batches`` micro-batches of a
    scheduled batch: each micro-batch's loss divided by the step's ``normalizer`` (so the
    sums are the full batch's), f32 gradient accumulation, token-weighted metrics and the
    log-probs [m_cap, W, L] (0 in the micro-batches not run)."""
    cap = batch.tokens.shape[0]

    def init_of(shapes):
        lp = shapes[0][1]["logprobs"]
        metric_keys = [k for k in shapes[0][1] if k != "logprobs"]
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return jnp.float32(0.0), zeros, {k: _identity(k) for k in metric_keys}, jnp.zeros((cap,) + lp.shape, lp.dtype)

    def fold(i, carry, out):
        loss_sum, grad_sum, weighted, logprobs = carry
        (loss, metrics), grads = out
        metrics = dict(metrics)
        logprobs = jax.lax.dynamic_update_index_in_dim(logprobs, metrics.pop("logprobs"), i, 0)
        n = metrics["num_tokens"].astype(jnp.float32)
        weighted = {k: _combine(k, weighted[k], v, n) for k, v in metrics.items()}
        grad_sum = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), grad_sum, grads)
        return loss_sum + loss, grad_sum, weighted, logprobs

    loss, grads, weighted, logprobs = _micro_loop(
        batch, lambda i: grad_fn(params, _micro(batch, i), normalizer), fold, init_of)
    return loss, grads, _finish(weighted, weighted=True), logprobs


@dataclasses.dataclass(frozen=True)
class LossCall:
    """The loss plugin called the one way every program calls it: the update, the
    reference pass and ``grpo bench loss``.

    ``args`` are the plugin's keyword arguments (``hidden`` [B, N, D], ``head_weight``
    [D, V], ``targets``, ``mask``, ``advantages``, ``old_logprobs``, ``ref_logprobs``,
    maybe ``sampler_logprobs``, and ``segment_ids`` [bins, N] in the packed layout, where
    B is the bin count). ``segment_ids`` reaches the plugin only when it is not None, so
    a loss written before packing sees exactly the arguments it always did; a packed
    batch for a loss without ``supports_packing`` is a bug of the caller (the trainer
    falls back to the unpacked layout for it). A ``per_shard`` loss (a Pallas kernel XLA
    cannot split) runs per device under ``shard_map`` over the batch axes, every per-row
    array split alike (segment ids included: a sequence never spans bins, so each
    device's per-sequence sums are complete); any other loss is one global call that XLA
    partitions. Programs trace it inside :meth:`for_mesh`."""

    loss: LossPlugin
    options: BaseModel
    settings: LossSettings
    mesh: Any = None
    batch_axes: tuple[str, ...] = DATA_AXES

    def __call__(self, args: dict[str, Any], normalizer=None):
        """``(loss, metrics)``; ``metrics["logprobs"]`` [B, N] are the per-token log-probs.

        ``normalizer``: the aggregation's denominator; None: this call's global batch's
        (``settings.normalizer`` of ``args["mask"]``, segments counted when packed), computed
        here so that every path agrees: a per-shard loss sees only its device's rows and
        cannot compute it."""
        args = self._plugin_args(args)
        if normalizer is None:
            normalizer = self.settings.normalizer(args["mask"], args.get("segment_ids"))
        if self._per_shard(args["targets"].shape[0]):
            loss, metrics, logprobs = self._shard_mapped(
                self._local_loss, args, normalizer, out_specs=("rep", "rep", "rows"))
            return loss, dict(metrics, logprobs=logprobs)
        return self.loss.compute(**args, settings=self.settings, options=self.options, normalizer=normalizer)

    def token_logprobs(self, args: dict[str, Any]) -> jax.Array:
        """Per-token log-probs [B, N] through the plugin's own log-prob path."""
        args = self._plugin_args(args)
        if self._per_shard(args["targets"].shape[0]):
            return self._shard_mapped(self._local_logprobs, args, None, out_specs=("rows",))
        return self.loss.token_logprobs(**args, settings=self.settings, options=self.options)

    def _plugin_args(self, args: dict[str, Any]) -> dict[str, Any]:
        """``args`` without a None ``segment_ids`` (unpacked: old plugins never see the
        name); a packed batch for a plugin that does not declare support is refused."""
        if args.get("segment_ids", False) is None:
            return {k: v for k, v in args.items() if k != "segment_ids"}
        if "segment_ids" in args and not getattr(self.loss, "supports_packing", False):
            raise ValueError(f"loss {self.loss.name!r} does not support packed batches (supports_packing is "
                             "False); run it on the unpacked layout")
        return args

    def for_mesh(self, fn):
        """``fn`` traced with the mesh's platform as the compile target (forward and
        backward alike: jit traces the whole of ``fn`` inside it), so the loss plugin
        compiles for the mesh's devices, not for ``jax.default_backend()``."""

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            with compiling_for(self.platform):
                return fn(*args, **kwargs)

        return traced

    @property
    def platform(self) -> str | None:
        """What the plugin compiles for: the mesh's devices (``grpo plan`` traces for a
        TPU mesh on a CPU host), not ``jax.default_backend()``."""
        return self.mesh.devices.flat[0].platform if self.mesh is not None else None

    def _per_shard(self, rows: int) -> bool:
        """Run the loss per device? Only for ``per_shard`` losses, and only when the rows
        divide over the batch axes (config validation ensures that in runs; otherwise
        the global call stays correct, if slow)."""
        if not getattr(self.loss, "per_shard", False) or self.mesh is None:
            return False
        return rows % _axes_size(self.mesh, self._shard_axes) == 0

    @property
    def _shard_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.batch_axes if a in self.mesh.shape)

    def _local_loss(self, axes, normalizer, **args):
        """``compute`` on one device's rows. With the *global* normalizer every shard's loss
        is its share of the global loss, so the psum is exact; the head weight enters
        replicated, so its gradient is the psum of the shards' (shard_map's transpose)."""
        loss, metrics = self.loss.compute(**args, settings=self.settings, options=self.options, normalizer=normalizer)
        logprobs = metrics.pop("logprobs")
        n = metrics["num_tokens"].astype(jnp.float32)
        total = jax.lax.psum(n, axes)

        def across(k: str, v: jax.Array) -> jax.Array:
            if k == "num_tokens":
                return total
            if k.endswith("/min"):
                return jax.lax.pmin(v, axes)
            if k.endswith("/max"):
                return jax.lax.pmax(v, axes)
            return jax.lax.psum(v * n, axes) / jnp.maximum(total, 1.0)

        combined = {k: across(k, v) for k, v in metrics.items()}
        return jax.lax.psum(loss, axes), combined, logprobs

    def _local_logprobs(self, axes, normalizer, **args):  # noqa: ARG002
        return self.loss.token_logprobs(**args, settings=self.settings, options=self.options)

    def _shard_mapped(self, fn, args: dict[str, Any], normalizer, *, out_specs):
        """``fn(axes, normalizer, **args)`` per device under ``shard_map`` over the batch
        axes (XLA cannot split a Pallas call): rows sharded, the head weight replicated."""
        from jax.sharding import PartitionSpec as P

        axes = self._shard_axes
        names = [k for k, v in args.items() if v is not None]
        row_spec = P(axes)
        in_specs = tuple(P() if k == "head_weight" else row_spec for k in names) + (P(),)
        specs = {"rep": P(), "rows": row_spec}
        out = tuple(specs[o] for o in out_specs)

        def local(*xs):
            *vals, norm = xs
            return fn(axes, norm, **dict(zip(names, vals)), **{k: None for k in args if k not in names})

        # None only for the log-prob pass, which has no aggregation to normalise.
        norm = jnp.asarray(0.0 if normalizer is None else normalizer, jnp.float32)
        return jax.shard_map(
            # Pallas calls carry no varying-axes annotations, so the check is off.
            local, mesh=self.mesh, in_specs=in_specs, out_specs=out if len(out) > 1 else out[0], check_vma=False
        )(*(args[k] for k in names), norm)


@dataclasses.dataclass(frozen=True)
class UpdateStep:
    """A jitted update: ``(params, opt_state, batch) -> (params, opt_state, metrics, logprobs)``,
    and the reference pass ``(ref_params, batch) -> ref_logprobs`` for ``beta > 0``."""

    graphdef: Any
    loss: LossPlugin
    loss_options: BaseModel
    settings: LossSettings
    optimizer: optax.GradientTransformation
    micro_batches: int

    mesh: Any = None
    batch_axes: tuple[str, ...] = DATA_AXES
    master_weights: bool = False
    moe: Any = None  # model.moe (a MoeConfig): router replay and losses, for a model with experts

    # ------------------------------------------------------------------ loss plugin calls

    @property
    def loss_call(self) -> LossCall:
        return LossCall(self.loss, self.loss_options, self.settings, self.mesh, self.batch_axes)

    def _model(self, params, frozen=None, *, adapters: bool = True):
        """The model of ``params`` (with LoRA: the adapters) and ``frozen`` (the base, or
        None); ``adapters=False`` switches LoRA adapters off (the reference model)."""
        model = nnx.merge(self.graphdef, params) if frozen is None else nnx.merge(self.graphdef, params, frozen)
        if not adapters:
            model.use_adapters(False)
        return model

    def _loss_args(self, params, mb: UpdateBatch | PackedBatch, frozen=None, *, adapters: bool = True) -> dict[str, Any]:
        """The loss plugin's model-side arguments; for a model with experts also
        ``"_routing"`` (the layers' :class:`~grpo.models.layers.moe.LayerRouting`; the
        policy's forwards replay the rollout's experts, the reference routes itself)."""
        model = self._model(params, frozen, adapters=adapters)
        keys = mb.dropout_keys if adapters else None
        packed = isinstance(mb, PackedBatch)
        moe = moe_call(mb, packed=packed, options=self.moe, replay=adapters) if is_moe(model) else None
        extra = {} if moe is None else {"moe": moe}
        if packed:  # bins: attention within a segment, hidden[:, t] predicts targets[:, t]
            out = model(mb.tokens, mb.positions, dropout_keys=keys, segment_ids=mb.segment_ids, **extra)
            hidden, routing = out[0], (out[2] if moe is not None else None)
            if mb.head_index is not None:  # only the slots predicting a completion token reach the head
                hidden = to_head(hidden, mb.head_index)  # R K D
                args = dict(hidden=hidden, head_weight=head_for(model, hidden),
                            targets=to_head(mb.targets, mb.head_index), segment_ids=mb.head_segments)
            else:
                args = dict(hidden=hidden, head_weight=head_for(model, hidden), targets=mb.targets,
                            segment_ids=mb.segment_ids)
        else:
            out = completion_hidden(model, mb.prompt_tokens, mb.prompt_mask, mb.tokens, mb.mask, keys, moe)
            hidden, routing = (out, None) if moe is None else out
            args = dict(hidden=hidden, head_weight=head_for(model, hidden), targets=mb.tokens)
        if routing is not None:
            args["_routing"] = routing_metrics(routing, top_k=model.config.num_experts_per_tok,
                                               compared=moe.replay is not None)
        return args

    @staticmethod
    def loss_tokens(batch: UpdateBatch | PackedBatch) -> jax.Array:
        """The mask the loss sees [B, N]: the model's own tokens (``batch.trained``), with
        the rows of ``batch.truncated`` (``loss.mask_truncated``) zeroed. Attention still
        reads the completion mask: only the loss drops those tokens. (Packed: built in.)"""
        if isinstance(batch, PackedBatch):
            return batch.mask
        if batch.truncated is None:
            return batch.trained
        return jnp.where(batch.truncated[:, None], 0, batch.trained).astype(batch.mask.dtype)

    def loss_and_metrics(self, params, mb: UpdateBatch, normalizer, frozen=None):
        args = self._loss_args(params, mb, frozen)
        routing = args.pop("_routing", None)
        tok = _head_of(mb)
        args.update(
            mask=tok(self.loss_tokens(mb)),
            advantages=tok(mb.advantages),
            old_logprobs=tok(mb.old_logprobs),
            ref_logprobs=tok(mb.ref_logprobs) if self.settings.beta > 0 else None,
        )
        if self.settings.mismatch is not None:
            # Passed only when used, so losses written before the correction existed keep working.
            args["sampler_logprobs"] = tok(mb.sampler_logprobs)
        loss, metrics = self.loss_call(args, normalizer)
        if routing is not None:  # the router losses, weighted by this part's share of the tokens (token_mean)
            n = metrics["num_tokens"].astype(jnp.float32)
            share = n / jnp.maximum(n if normalizer is None else jnp.asarray(normalizer, jnp.float32), 1.0)
            loss = loss + router_losses(routing, self.moe) * share
            metrics = dict(metrics, **routing)
        return loss, dict(metrics, logprobs=_bins_of(mb, metrics["logprobs"]))

    # ------------------------------------------------------------------ forward-only passes

    def reference_logprobs(self, params, batch: UpdateBatch, frozen=None) -> jax.Array:
        """Per-token log-probs [B, N] of the completions under ``params`` (the reference
        model), micro-batch by micro-batch through the loss plugin's own log-prob path
        (the fused kernel for ``pallas``): never more than one micro-batch of activations,
        and no ``[B, N, V]`` logits at all with a fused loss.

        With LoRA (``frozen`` = the base) the reference is the base model: the adapters
        in ``params`` are switched off (the trainer passes zero adapters that are never
        donated; no copy of any base weight exists)."""
        return self._forward_logprobs(params, batch, frozen, adapters=False)

    def policy_logprobs(self, params, batch: UpdateBatch, frozen=None) -> jax.Array:
        """Per-token log-probs [B, N] of the completions under the policy ``params``
        (adapters on), micro-batched like :meth:`reference_logprobs`, under the LoRA-dropout
        masks of ``batch.dropout_keys`` (None: no dropout, the policy the sampler samples).
        The trainer runs it only with LoRA dropout: the dropout-free log-probs are what the
        sampler's are compared with (metrics, the mismatch correction)."""
        return self._forward_logprobs(params, batch, frozen, adapters=True)

    def _forward_logprobs(self, params, batch: UpdateBatch, frozen, *, adapters: bool) -> jax.Array:
        def one(mb: UpdateBatch) -> jax.Array:
            args = self._loss_args(params, mb, frozen, adapters=adapters)
            args.pop("_routing", None)
            logp = _bins_of(mb, self.loss_call.token_logprobs(args))
            return jnp.where(mb.trained > 0, logp.astype(jnp.float32), 0.0)

        if isinstance(batch, PackedBatch) and batch.micro_batches is not None:
            return _scheduled_map(one, batch, adapters=adapters)
        m = self.micro_batches
        if m == 1:
            return one(batch)
        packed = isinstance(batch, PackedBatch)
        if packed:
            fields = ("tokens", "positions", "segment_ids", "targets", "trained")
        else:
            fields = ("prompt_tokens", "prompt_mask", "tokens", "mask")
            if batch.loss_mask is not None:
                fields += ("loss_mask",)
        if adapters and batch.dropout_keys is not None:
            fields += ("dropout_keys",)
        if batch.routed_experts is not None:
            fields += ("routed_experts",)
        micro = {f: _split_micro(getattr(batch, f), m) for f in fields}
        empty = dict(advantages=None, old_logprobs=None, ref_logprobs=None)

        def body(xs):
            return one(PackedBatch(**xs, mask=None, **empty) if packed else UpdateBatch(**xs, **empty))

        return _merge_micro(jax.lax.map(body, micro))

    # ------------------------------------------------------------------ update

    def grads(self, params, batch: UpdateBatch, frozen=None):
        """Summed loss, accumulated f32 gradients, token-weighted metrics, per-token logprobs.

        Gradients are taken with respect to ``params`` only: with LoRA those are the
        adapters and the base (``frozen``) is a constant of the differentiation."""
        if isinstance(batch, PackedBatch):  # the padded batch's, computed where it was packed
            normalizer, batch = batch.normalizer, batch._replace(normalizer=None)
        else:
            normalizer = self.settings.normalizer(self.loss_tokens(batch))  # of the global batch
        grad_fn = jax.value_and_grad(functools.partial(self.loss_and_metrics, frozen=frozen), has_aux=True)
        f32 = lambda tree: jax.tree.map(lambda g: g.astype(jnp.float32), tree)  # noqa: E731
        if isinstance(batch, PackedBatch) and batch.micro_batches is not None:
            return _scheduled_grads(grad_fn, params, batch, normalizer)
        m = self.micro_batches
        if m == 1:
            (loss, metrics), grads = grad_fn(params, batch, normalizer)
            logprobs = metrics.pop("logprobs")
            return loss, f32(grads), _finish(metrics, weighted=False), logprobs
        if isinstance(batch, PackedBatch):  # the head layout's rows span micro-batches: full width
            batch = batch._replace(head_index=None, head_segments=None)
        micro = type(batch)(*(_split_micro(x, m) for x in batch))
        # f32 accumulation: bf16 sums of many micro-batch gradients lose their small terms.
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

        def body(carry, mb):
            loss_sum, grad_sum, weighted = carry
            (loss, metrics), grads = grad_fn(params, mb, normalizer)
            logprobs = metrics.pop("logprobs")
            n = metrics["num_tokens"].astype(jnp.float32)
            weighted = {k: _combine(k, weighted[k], v, n) for k, v in metrics.items()}
            grad_sum = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), grad_sum, grads)
            return (loss_sum + loss, grad_sum, weighted), logprobs

        shapes = jax.eval_shape(lambda: grad_fn(params, type(micro)(*(None if x is None else x[0] for x in micro)), normalizer))
        metric_keys = [k for k in shapes[0][1] if k != "logprobs"]
        init = (jnp.float32(0.0), zeros, {k: _identity(k) for k in metric_keys})
        (loss, grads, weighted), logprobs = jax.lax.scan(body, init, micro)
        return loss, grads, _finish(weighted, weighted=True), _merge_micro(logprobs)

    def apply(self, params, opt_state, grads):
        """One optimizer step on f32 ``grads``: ``(params, opt_state)`` -> new ones.

        With master weights the optimizer sees and updates only the f32 master; the new
        parameters are the new master rounded to each parameter's dtype."""
        if not self.master_weights:
            updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt_state
        updates, inner = self.optimizer.update(grads, opt_state.inner, opt_state.master)
        master = optax.apply_updates(opt_state.master, updates)
        new_params = jax.tree.map(lambda m_, p: m_.astype(p.dtype), master, params)
        return new_params, MasterWeights(master=master, inner=inner)

    def __call__(self, params, opt_state, batch: UpdateBatch, frozen=None):
        # With master weights the model runs on the f32 master itself: every weight is
        # cast to the compute dtype where it is used, exactly as in an f32-parameter run,
        # so gradients are f32 through the casts (an embedding's scatter-add included).
        source = opt_state.master if self.master_weights else params
        loss, grads, metrics, logprobs = self.grads(source, batch, frozen)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        new_params, new_opt_state = self.apply(params, opt_state, grads)
        params, opt_state = keep_if_finite(finite, (new_params, new_opt_state), (params, opt_state))
        metrics = dict(metrics, loss=loss, grad_norm=grad_norm, finite=finite)
        return params, opt_state, metrics, logprobs

    def jit(self, params: Any = None, opt_state: Any = None):
        """Jitted ``(params, opt_state, batch, frozen=None)``, with params and optimizer
        state donated (the frozen LoRA base is not). Given example ``params`` and
        ``opt_state``, their shardings are pinned on the outputs, so step 2 sees exactly
        the layouts step 1 saw and never recompiles."""
        out_shardings = None
        if params is not None and opt_state is not None:
            sharding_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
            out_shardings = (sharding_of(params), sharding_of(opt_state), None, None)
        return jax.jit(self.loss_call.for_mesh(self.__call__), donate_argnums=(0, 1), out_shardings=out_shardings)

    def jit_reference(self):
        """The jitted reference pass (no donation: the reference parameters are reused)."""
        return jax.jit(self.loss_call.for_mesh(self.reference_logprobs))

    def jit_policy_logprobs(self):
        """The jitted :meth:`policy_logprobs` (no donation: the update reads the same
        parameters next)."""
        return jax.jit(self.loss_call.for_mesh(self.policy_logprobs))


def loss_program(
    plugin: Any,
    options: Any,
    settings: Any,
    *,
    old_logprobs: bool,
    ref_logprobs: bool,
    mesh: Any = None,
) -> Any:
    """The loss plugin's value and gradient with respect to ``(hidden, head_weight)``,
    called exactly as the update calls it (:class:`~grpo.engine.training.update.LossCall`:
    the global normaliser of the batch's mask, shard_map for a ``per_shard`` loss on a
    mesh, traced for the mesh's platform). ``grpo bench loss`` measures this program.

    Jitted ``(hidden [B, N, D], head_weight [D, V], targets [B, N], mask [B, N],
    advantages [B], old [B, N], ref [B, N]) -> (loss, (d_hidden, d_head_weight))``;
    ``old``/``ref`` are read only when ``old_logprobs``/``ref_logprobs``."""
    call = LossCall(plugin, options, settings, mesh)

    def step(hidden, head_weight, targets, mask, advantages, old, ref):
        def loss_fn(h, w):
            args = dict(
                hidden=h, head_weight=w, targets=targets, mask=mask, advantages=advantages,
                old_logprobs=old if old_logprobs else None, ref_logprobs=ref if ref_logprobs else None,
            )
            loss, metrics = call(args, settings.normalizer(mask))
            return loss, metrics["ratio/mean"]

        (loss, _), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(hidden, head_weight)
        return loss, grads

    return jax.jit(call.for_mesh(step))
