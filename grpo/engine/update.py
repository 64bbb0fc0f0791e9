"""The policy update: loss plugin on the model's hidden states, exact gradient
accumulation over micro-batches, optimizer step that skips non-finite gradients.

Micro-batch ``m`` takes rows ``m, m + M, m + 2M, ...`` of the batch (a reshape
``[B] -> [B/M, M]`` and a transpose), so every micro-batch keeps the batch's even spread
over the data-parallel devices. Each micro-batch loss is divided by the *global*
normaliser (valid tokens, sequences, or sequences x max length of the whole batch), so
summing the micro-batch losses and gradients gives the full-batch ones exactly (up to
float summation order).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from pydantic import BaseModel

from grpo.core.contracts import LossPlugin, LossSettings, compiling_for


class UpdateBatch(NamedTuple):
    """One rollout batch laid out for the update (every array [B, ...], global)."""

    prompt_tokens: jax.Array  # B Lp
    prompt_mask: jax.Array  # B Lp
    tokens: jax.Array  # B N completion tokens
    mask: jax.Array  # B N completion mask (incl. stop token)
    advantages: jax.Array  # B
    old_logprobs: jax.Array | None  # B N
    ref_logprobs: jax.Array | None  # B N


def completion_hidden(model: Any, prompt_tokens, prompt_mask, tokens, mask):
    """Hidden states [B, N, D] at the positions that predict each completion token."""
    from grpo.models.qwen2 import positions_from_mask

    lp = prompt_tokens.shape[1]
    full = jnp.concatenate([prompt_tokens, tokens], axis=1)  # B L
    # Completion slots after the stop token are padding: mask them out of attention.
    kv_mask = jnp.concatenate([prompt_mask, mask], axis=1).astype(bool)
    positions = positions_from_mask(kv_mask)
    hidden, _ = model(full, positions, kv_mask)
    # Slot lp-1 (the last prompt token) predicts completion token 0, and so on.
    return hidden[:, lp - 1 : -1]  # B N D


def token_logprobs(model: Any, batch: UpdateBatch, temperature: float) -> jax.Array:
    """Per-token log-probs [B, N] of the completion under ``model`` (reference model)."""
    hidden = completion_hidden(model, batch.prompt_tokens, batch.prompt_mask, batch.tokens, batch.mask)
    logits = jnp.einsum(
        "bnd,dv->bnv", hidden, model.head_weight().astype(hidden.dtype), preferred_element_type=jnp.float32
    ) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    out = jnp.take_along_axis(logp, batch.tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.where(batch.mask > 0, out, 0.0)


def _split_micro(x: jax.Array | None, m: int) -> jax.Array | None:
    if x is None:
        return None
    b = x.shape[0]
    # B ... -> (B/M) M ... -> M (B/M) ...: micro-batch i holds rows i, i+M, ...
    return jnp.swapaxes(x.reshape((b // m, m) + x.shape[1:]), 0, 1)


def _merge_micro(x: jax.Array) -> jax.Array:
    m, mb = x.shape[:2]
    return jnp.swapaxes(x, 0, 1).reshape((m * mb,) + x.shape[2:])


@dataclasses.dataclass(frozen=True)
class UpdateStep:
    """A jitted update: ``(params, opt_state, batch) -> (params, opt_state, metrics)``."""

    graphdef: Any
    loss: LossPlugin
    loss_options: BaseModel
    settings: LossSettings
    optimizer: optax.GradientTransformation
    micro_batches: int

    mesh: Any = None
    batch_axes: tuple[str, ...] = ("dp", "fsdp")

    def loss_and_metrics(self, params, mb: UpdateBatch, normalizer):
        # The loss plugin compiles for the mesh's devices, not for the host's backend.
        platform = self.mesh.devices.flat[0].platform if self.mesh is not None else None
        with compiling_for(platform):
            return self._loss_and_metrics(params, mb, normalizer)

    def _loss_and_metrics(self, params, mb: UpdateBatch, normalizer):
        model = nnx.merge(self.graphdef, params)
        hidden = completion_hidden(model, mb.prompt_tokens, mb.prompt_mask, mb.tokens, mb.mask)
        args = dict(
            hidden=hidden,
            head_weight=model.head_weight(),
            targets=mb.tokens,
            mask=mb.mask,
            advantages=mb.advantages,
            old_logprobs=mb.old_logprobs,
            ref_logprobs=mb.ref_logprobs if self.settings.beta > 0 else None,
        )
        if getattr(self.loss, "per_shard", False) and self.mesh is not None:
            return self._per_shard_loss(args, normalizer)
        return self.loss.compute(**args, settings=self.settings, options=self.loss_options, normalizer=normalizer)

    def _per_shard_loss(self, args: dict[str, Any], normalizer):
        """``compute`` on each device's rows (shard_map over the batch axes).

        With the *global* normalizer every shard's loss is its share of the global loss,
        so the psum is exact; the head weight enters replicated, so its gradient is the
        psum of the shards' (shard_map's transpose does that).
        """
        from jax.sharding import PartitionSpec as P

        axes = tuple(a for a in self.batch_axes if a in self.mesh.shape)
        shards = 1
        for a in axes:
            shards *= self.mesh.shape[a]
        if args["hidden"].shape[0] % shards:
            # Config validation prevents this in runs; stay correct (if slow) regardless.
            return self.loss.compute(**args, settings=self.settings, options=self.loss_options, normalizer=normalizer)
        names = [k for k, v in args.items() if v is not None]
        row_spec = P(axes)
        in_specs = tuple(P() if k == "head_weight" else row_spec for k in names) + (P(),)

        def local(*xs):
            *vals, norm = xs
            loss, metrics = self.loss.compute(
                **dict(zip(names, vals)), **{k: None for k in args if k not in names},
                settings=self.settings, options=self.loss_options, normalizer=norm,
            )
            logprobs = metrics.pop("logprobs")
            n = metrics["num_tokens"].astype(jnp.float32)
            total = jax.lax.psum(n, axes)
            combined = {
                k: (total if k == "num_tokens" else jax.lax.psum(v * n, axes) / jnp.maximum(total, 1.0))
                for k, v in metrics.items()
            }
            return jax.lax.psum(loss, axes), combined, logprobs

        norm = jnp.asarray(normalizer, jnp.float32)
        out_specs = (P(), P(), row_spec)
        loss, metrics, logprobs = jax.shard_map(
            # Pallas calls carry no varying-axes annotations, so the check is off.
            local, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )(*(args[k] for k in names), norm)
        return loss, dict(metrics, logprobs=logprobs)

    def grads(self, params, batch: UpdateBatch):
        """Summed loss, accumulated gradients, token-weighted metrics, per-token logprobs."""
        normalizer = self.settings.normalizer(batch.mask)  # of the global batch
        grad_fn = jax.value_and_grad(self.loss_and_metrics, has_aux=True)
        m = self.micro_batches
        if m == 1:
            (loss, metrics), grads = grad_fn(params, batch, normalizer)
            logprobs = metrics.pop("logprobs")
            return loss, grads, metrics, logprobs
        micro = UpdateBatch(*(_split_micro(x, m) for x in batch))
        zeros = jax.tree.map(jnp.zeros_like, params)

        def body(carry, mb):
            loss_sum, grad_sum, weighted = carry
            (loss, metrics), grads = grad_fn(params, mb, normalizer)
            logprobs = metrics.pop("logprobs")
            n = metrics["num_tokens"].astype(jnp.float32)
            weighted = {k: weighted[k] + (v if k == "num_tokens" else v * n) for k, v in metrics.items()}
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (loss_sum + loss, grad_sum, weighted), logprobs

        shapes = jax.eval_shape(lambda: grad_fn(params, UpdateBatch(*(None if x is None else x[0] for x in micro)), normalizer))
        metric_keys = [k for k in shapes[0][1] if k != "logprobs"]
        init = (jnp.float32(0.0), zeros, {k: jnp.float32(0.0) for k in metric_keys})
        (loss, grads, weighted), logprobs = jax.lax.scan(body, init, micro)
        n = jnp.maximum(weighted["num_tokens"], 1.0)
        metrics = {k: (v if k == "num_tokens" else v / n) for k, v in weighted.items()}
        return loss, grads, metrics, _merge_micro(logprobs)

    def __call__(self, params, opt_state, batch: UpdateBatch):
        loss, grads, metrics, logprobs = self.grads(params, batch)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # A non-finite step changes nothing (params and optimizer moments alike).
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        metrics = dict(metrics, loss=loss, grad_norm=grad_norm, finite=finite)
        return params, opt_state, metrics, logprobs

    def jit(self, params: Any = None, opt_state: Any = None):
        """Jitted, with params and optimizer state donated. Given example ``params`` and
        ``opt_state``, their shardings are pinned on the outputs, so step 2 sees exactly
        the layouts step 1 saw and never recompiles."""
        out_shardings = None
        if params is not None and opt_state is not None:
            sharding_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
            out_shardings = (sharding_of(params), sharding_of(opt_state), None, None)
        return jax.jit(self.__call__, donate_argnums=(0, 1), out_shardings=out_shardings)
