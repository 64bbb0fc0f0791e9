"""The rollout sampler: jitted prefill + KV-cache decode, K samples per prompt.

Usage (the trainer)::

    graphdef, params = nnx.split(model)
    sampler = Sampler(graphdef, mesh=mesh, batch_axes=style.batch_axes(layout, opts),
                      sampling=SamplingParams(max_new_tokens=256, num_generations=8,
                                              temperature=1.0, eos_ids=(151643, 151645)))
    out = sampler.generate(params, prompt_tokens, prompt_mask, rng)   # RolloutOutput (device arrays)

Every sampler (this single-turn one and
:class:`~grpo.engine.rollout.multiturn.MultiTurnSampler`) also implements the one rollout
interface the trainer, the evaluator and the benchmarks call, whatever the kind::

    sampled = sampler.sample(params, prompt_tokens, prompt_mask, rng, examples)   # Sampled

and lowers its own programs for ``grpo plan`` (:meth:`BaseSampler.lowerings`).

How a rollout runs
------------------

1. **Prefill** (one jit): the P prompts run once through the model into a cache of
   exactly ``Lp`` slots; the last position's logits and the cache are then repeated K
   times in place (row ``b*K + j`` is sample j of prompt b) and the cache is padded to
   the first decode segment's length (below). Prompts may be left- or right-padded (or
   both): each row is first left-aligned by a stable sort on its mask, so every row's
   last prompt token sits in slot ``Lp - 1`` and RoPE positions count real tokens from 0.
2. **Decode** (one jit, the cache donated): the first token is drawn from the prefill
   logits, then each step feeds the previous token (slot ``Lp + s - 1``, position
   ``prompt_len + s - 1``) and draws the next one. There is no per-token Python loop and
   no per-token host sync: the steps run in ``lax.fori_loop`` chunks of
   ``early_stop_chunk`` tokens (a static trip count) inside a ``lax.while_loop`` that
   exits when every row has produced a stop token. On GPU a while loop's predicate is
   copied to the host every iteration, so it is evaluated once per chunk, never per
   token; ``early_stop_chunk=0`` compiles one fixed-length loop (no predicate at all).
   The step count is rounded up to whole chunks so that every chunk is the same
   compiled body; steps past ``max_new_tokens`` change nothing and are dropped (one
   extra step for the usual power-of-two lengths).
3. **KV segments**: reading the cache dominates decode at long lengths, and attention
   reads every slot of the cache it is given. With ``kv_segment=n`` the decode runs in
   segments of n tokens and the cache only has the slots the current segment can reach
   (``Lp + last step of the segment``); between segments it is padded to the next length
   (one copy per segment). Average bytes read per step then track the *live* cache
   rather than the final one, at the price of one compiled loop body per segment.
   ``kv_segment=0`` allocates all the slots up front; then prefill's cache is donated to
   decode and updated in place throughout (within a segment it always is: the cache is
   loop state).

Sampling semantics (see :mod:`grpo.engine.rollout._sampling`): the temperature divides the
logits; top-k then top-p restrict which tokens can be drawn; ``greedy`` takes the argmax.
Each sampled token carries two log-probs. ``RolloutOutput.logprobs`` is
``log_softmax(logits / temperature)`` over the *full* (unfiltered) vocabulary, i.e.
exactly what the trainer's loss computes — so the sampler/trainer gap metrics measure
numerics, not filtering. ``RolloutOutput.behaviour`` is the log-prob under the policy that
actually drew the token — the top-k/top-p-truncated distribution renormalised over its
kept tokens — which the importance weights of ``loss.mismatch`` need; with no filter it is
the full-vocabulary array itself (``behaviour_logprobs`` is None). Each row draws from its own
key ``fold_in(fold_in(rng, global_row), step)``, so samples depend only on the run key
and the row, never on the sharding: the ``legacy`` and ``maxtext`` rollout styles give
identical samples.

A row stops at its first token in ``eos_ids`` (which is part of the completion, mask 1);
later slots hold ``pad_id`` with mask 0 and log-prob 0. ``truncated`` marks rows that
reached ``max_new_tokens`` without a stop token.

Sharding: the batch dimension of every rollout array (and of the cache) is sharded over
``batch_axes`` on ``mesh``; a dimension that does not divide is sharded over the longest
leading part of them it divides (:func:`grpo.sharding.fit_spec`): 12 prompts on 8 shards
prefill replicated, and their 96 samples decode split 8 ways. Parameters stay in whatever
sharding they are handed (the training layout's FSDP, or a rollout style's serving
layout: :mod:`grpo.engine.rollout.layout`); the model's activation constraints follow
``activation_rules`` with the batch over ``batch_axes`` while sampling. Prompt-length
bucketing is the caller's job (one compilation per distinct ``(P, Lp)``).
"""

from __future__ import annotations

import collections.abc
import functools
import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo.core.contracts.engine import RolloutEngine, RolloutOutput, Sampled
from grpo.engine.parallel.rows import row_range
from grpo.engine.rollout._sampling import SamplingParams
from grpo.engine.rollout.batch_rows import BatchRows
from grpo.engine.rollout.decoding import (
    Outputs, draw, effective_chunk, left_align, prefill_forward, row_key_data, run_chunks, segment_plan,
)
from grpo.models.decoder import CACHE_AXES, KVCache
from grpo.models.rollout_quant import QuantizedWeights, abstract_quantized, merge_rollout, quantize_state
from grpo.models.layers.moe import EXPERT_ID_DTYPE, MoeCall
from grpo.sharding import ACTIVATION_RULES, fit_sharding, with_batch_axes

# --------------------------------------------------------------------------- public types


class Prefilled(NamedTuple):
    """What prefill hands to decode (batch already B = P*K)."""

    cache: KVCache  # [layers, B, Lp + first segment, kv_heads, head_dim]
    logits: jax.Array  # [B, V] float32, the next-token logits after the prompt
    prompt_tokens: jax.Array  # [B, Lp] int32, left-aligned
    prompt_mask: jax.Array  # [B, Lp] int32


class Texts(collections.abc.Sequence):
    """The texts of this process's rows of a single-turn rollout, detokenized when read:
    rows nobody reads (an evaluation batch's padding) are never detokenized.
    ``detokenize(tokens [n, N], mask [n, N]) -> n texts``."""

    def __init__(self, detokenize: Callable[[np.ndarray, np.ndarray], list[str]], tokens: np.ndarray,
                 mask: np.ndarray):
        self._detokenize, self._tokens, self._mask = detokenize, tokens, mask

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return list(self._detokenize(self._tokens[index], self._mask[index]))
        return self[index: index + 1 if index != -1 else None][0]

    def __iter__(self):
        return iter(self[:])


class _State(NamedTuple):
    cache: KVCache
    prev: jax.Array  # [B] int32, the token fed at the next step
    done: jax.Array  # [B] bool, stop token produced
    lengths: jax.Array  # [B] int32
    out: Outputs  # [B, W] (W >= N: the last chunk may run past the cap)
    steps: jax.Array  # [] int32, sampling steps run so far (step 0 included)
    # [B, W, layers, k] int16: the experts each fed completion token was routed to (MoE
    # models recording routing), -1 not yet fed; None otherwise
    routed: Any = None


def _fed_experts(routed: jax.Array, experts: jax.Array, t: jax.Array) -> jax.Array:
    """``routed`` [B, W, L, k] with the experts [L, B, 1, k] of the step that fed
    completion token ``t - 1`` written at its column."""
    return jax.lax.dynamic_update_slice_in_dim(routed, jnp.transpose(experts, (1, 2, 0, 3)), t - 1, axis=1)


def _fed_only(routed: jax.Array, lengths: jax.Array) -> jax.Array:
    """[B, N, L, k] routed experts, -1 from each row's last token on (never fed)."""
    fed = jnp.arange(routed.shape[1])[None, :] < lengths[:, None] - 1  # B N
    return jnp.where(fed[:, :, None, None], routed, -1).astype(EXPERT_ID_DTYPE)


# --------------------------------------------------------------------------- samplers


class BaseSampler(RolloutEngine):
    """What every sampler shares: prefill, placement and sharding of rows, keys and the KV
    cache. Subclasses implement :meth:`sample` (the one rollout interface) and
    :meth:`lowerings` (their programs, for ``grpo plan``).

    Args:
      graphdef: from ``nnx.split(model)`` (a :class:`grpo.models.decoder.Decoder`).
      mesh: the device mesh the parameters live on.
      batch_axes: mesh axes the rollout batch is sharded over (a rollout style's
        ``batch_axes``); other mesh axes replicate it.
      sampling: :class:`SamplingParams`.
      cache_dtype: KV-cache dtype (default: the model's compute dtype).
      kv_segment: decode tokens per cache-growth segment (see the module docstring);
        0 = the full cache from the start.
      activation_rules: base logical-axis rules for activations (default
        :data:`grpo.sharding.ACTIVATION_RULES`); their ``batch`` entry is
        replaced by ``batch_axes``.
      lora_adapters: False runs a LoRA model without its adapter matmuls (the
        ``model.lora.sampler: merged`` rollout, whose projections already hold them).
      cache_rules: logical-axis rules of the KV cache (default: the activation rules).
      weight_format: ``none``, ``int8`` or ``fp8``: the rollout's projections quantized once
        per sync (:meth:`quantize_weights`, :mod:`grpo.models.rollout_quant`).
      kv_format: ``none``, ``int8`` or ``fp8``: the KV cache's format (the continuous
        engine's page pool; the static cache takes ``none`` only).
      head_format: ``none`` or ``int8``: the output head quantized with the projections
        (needs ``weight_format``; :func:`grpo.models.rollout_quant.quantize_head`).

    One compilation per distinct (prompts, prompt length); bucket prompt lengths.
    """

    # The rollout's rows carry a loss mask (a multi-turn rollout's inserted tokens).
    loss_mask: bool = False
    #: This engine can record each completion token's routed experts (MoE models).
    records_routing: bool = False
    #: Record them (set by the run with ``model.moe.router_replay`` on).
    record_routing: bool = False

    def __init__(
        self,
        graphdef: Any,
        *,
        mesh: Mesh,
        batch_axes: Sequence[str],
        sampling: SamplingParams,
        cache_dtype: Any = None,
        kv_segment: int = 256,
        activation_rules: Mapping[str, Any] | None = None,
        lora_adapters: bool = True,
        cache_rules: Mapping[str, Any] | None = None,
        weight_format: str = "none",
        kv_format: str = "none",
        head_format: str = "none",
    ):
        from grpo.models.rollout_quant import FORMATS

        if weight_format not in ("none",) + FORMATS or kv_format not in ("none",) + FORMATS:
            raise ValueError(f"weight_format and kv_format take none, int8 or fp8; got {weight_format!r}, {kv_format!r}")
        if kv_format != "none" and not getattr(self, "quantized_kv", False):
            raise ValueError(f"{type(self).__name__} keeps its KV cache in the compute dtype (kv_format={kv_format!r}): "
                             "a quantized KV cache is the continuous engine's page pool")
        if head_format not in ("none", "int8") or (head_format != "none" and weight_format == "none"):
            raise ValueError(f"head_format takes none or int8, with a weight_format; got {head_format!r} with "
                             f"weight_format={weight_format!r}")
        self.weight_format, self.kv_format, self.head_format = weight_format, kv_format, head_format
        if kv_segment < 0:
            raise ValueError(f"kv_segment must be >= 0, got {kv_segment}")
        unknown = [a for a in batch_axes if a not in mesh.shape]
        if unknown:
            raise ValueError(f"batch_axes {tuple(batch_axes)} name axes {unknown} the mesh {dict(mesh.shape)} lacks")
        self.graphdef = graphdef
        #: The once-per-sync quantize program (``weight_format``), a listed program of the
        #: run (:meth:`jitted`, :meth:`quantize_lowerings`); the run watches it
        #: (:class:`grpo.engine.schedule.ShapeWatch`). None when unquantized.
        self.quantize_jit = None if weight_format == "none" else jax.jit(
            functools.partial(quantize_state, graphdef, fmt=weight_format, head=head_format))
        self.mesh = mesh
        self.batch_axes = tuple(batch_axes)
        self.sampling = sampling
        self.cache_dtype = cache_dtype
        self.kv_segment = int(kv_segment)
        self.lora_adapters = bool(lora_adapters)
        self.rules = with_batch_axes(ACTIVATION_RULES if activation_rules is None else activation_rules, self.batch_axes)
        self.cache_rules = self.rules if cache_rules is None else with_batch_axes(cache_rules, self.batch_axes)
        self.prefill_jit = jax.jit(self._prefill_impl)
        self._prefill_once = jax.jit(functools.partial(self._prefill_impl, repeat=1))  # rows already expanded

    # ------------------------------------------------------------------ the interface

    def sample(self, params: Any, prompt_tokens: Any, prompt_mask: Any, rng: jax.Array,
               examples: Sequence[Mapping[str, Any]]) -> Sampled:
        """Roll out ``num_generations`` samples of each of the P prompts.

        Args:
          params: what the sampler reads (its :attr:`~grpo.RolloutEngine.weights`; not copied, not
            donated).
          prompt_tokens, prompt_mask: [P, Lp] int (numpy or global ``jax.Array``),
            left-padded (right padding is accepted too); every prompt needs >= 1 token.
          rng: a PRNG key (typed or raw) for this rollout.
          examples: this process's rows' examples, in row order (row ``b*K + j``: sample j
            of prompt b).

        A single-turn sampler's rollout is :meth:`generate`'s arrays and this process's
        rows' texts (detokenized lazily); the multi-turn sampler overrides it.
        """
        if self.detokenize is None:
            raise ValueError(f"this {type(self).__name__} was built without detokenize: sample() needs it for the "
                             "rows' texts")
        out = self.generate(params, prompt_tokens, prompt_mask, rng)
        b = len(examples)
        from grpo.engine.parallel.mesh import mesh_processes

        rank, _ = mesh_processes(self.mesh)  # among the processes of the mesh it samples on
        mine = slice(rank * b, (rank + 1) * b)  # this process's rows
        texts = Texts(self.detokenize, row_range(out.tokens, mine), row_range(out.mask, mine))
        return Sampled(output=out, texts=texts, examples=[dict(ex) for ex in examples])

    def generate(self, params: Any, prompt_tokens: Any, prompt_mask: Any, rng: jax.Array,
                 stop_at: Any = None) -> RolloutOutput:
        """The rollout's global arrays alone (a single-turn sampler's device side)."""
        raise NotImplementedError

    def lowerings(self, params: Any, *, prompts: int, prompt_length: int, key: jax.Array) -> dict[str, Any]:
        """Each program of a rollout of ``prompts`` prompts of ``prompt_length`` tokens,
        by name in the order they run, as a function lowering it for abstract (or
        concrete) ``params`` and this PRNG ``key`` (its shape and impl): what
        ``grpo plan`` compiles."""
        raise NotImplementedError

    def cache_slots(self, prompt_length: int) -> int:
        """Slots of the rollout's final KV cache after a prompt of ``prompt_length``."""
        raise NotImplementedError

    def jitted(self) -> dict[str, list[Any]]:
        """This sampler's jitted programs by the names :meth:`lowerings` (and
        :meth:`quantize_lowerings`) give them."""
        quantize = {} if self.quantize_jit is None else {"quantize": [self.quantize_jit]}
        return {**quantize, "prefill": [self.prefill_jit, self._prefill_once]}

    def abstract_output(self, *, prompts: int, prompt_length: int) -> RolloutOutput:
        """The :class:`RolloutOutput` of ``prompts`` prompts as abstract arrays in this
        sampler's layout (what a round hands on, for ``grpo plan``)."""
        rows, n = prompts * self.sampling.num_generations, self.sampling.max_new_tokens
        completion = self._rows(rows, n)
        return RolloutOutput(
            prompt_tokens=self._rows(rows, prompt_length), prompt_mask=self._rows(rows, prompt_length),
            tokens=completion, mask=completion, lengths=self._rows(rows), truncated=self._rows(rows, dtype=bool),
            logprobs=self._rows(rows, n, dtype=jnp.float32), loss_mask=completion if self.loss_mask else None,
            behaviour_logprobs=self._rows(rows, n, dtype=jnp.float32) if self.sampling.truncates else None,
        )

    def cache_bytes(self, params: Any, *, rows: int, prompt_length: int) -> int:
        """Per-device bytes of the final KV cache (keys and values) of ``rows`` rows."""
        cache, _ = self._abstract_decode_state(params, rows, self.cache_slots(prompt_length))
        return 2 * math.prod(cache.k.sharding.shard_shape(cache.k.shape)) * jnp.dtype(cache.k.dtype).itemsize

    # ------------------------------------------------------------------ placement

    def prefill(self, params: Any, prompt_tokens: Any, prompt_mask: Any, *, repeat: int | None = None) -> Prefilled:
        """The prompts [P, Lp] prefilled, each repeated ``repeat`` times (None:
        ``num_generations``; 1: rows that are already one sample each, as the contract's
        :class:`~grpo.core.contracts.engine.Rows` are)."""
        tokens, mask = self.place_prompts(prompt_tokens, prompt_mask)
        if repeat is None or repeat == self.sampling.num_generations:
            return self.prefill_jit(params, tokens, mask)
        if repeat != 1:
            raise ValueError(f"repeat must be 1 or num_generations ({self.sampling.num_generations}); got {repeat}")
        return self._prefill_once(params, tokens, mask)

    def chunk(self) -> int:
        """Decode steps between "all stopped?" checks (0: none — also when there are no
        stop tokens, as nothing could ever stop)."""
        s = self.sampling
        return effective_chunk(s.max_new_tokens, s.early_stop_chunk) if s.eos_ids else 0

    def place_prompts(self, prompt_tokens: Any, prompt_mask: Any) -> tuple[jax.Array, jax.Array]:
        """[P, Lp] prompts as int32 global arrays with the batch sharding."""
        if tuple(np.shape(prompt_tokens)) != tuple(np.shape(prompt_mask)) or len(np.shape(prompt_tokens)) != 2:
            raise ValueError(
                f"prompt_tokens {np.shape(prompt_tokens)} and prompt_mask {np.shape(prompt_mask)} must both be [P, Lp]"
            )
        if not isinstance(prompt_mask, jax.Array) and np.shape(prompt_mask)[0]:
            empty = np.flatnonzero(np.asarray(prompt_mask).sum(axis=1) == 0)
            if empty.size:
                raise ValueError(f"prompts {empty[:10].tolist()} have no tokens (prompt_mask is all 0)")
        return self._place(prompt_tokens, ("batch", "length")), self._place(prompt_mask, ("batch", "length"))

    def place_key(self, rng: jax.Array) -> tuple[jax.Array, str | None]:
        """``rng`` as replicated raw key data on the mesh, and its impl name (None: raw)."""
        impl = None
        if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(rng)
            rng = jax.random.key_data(rng)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        if isinstance(rng, jax.Array):  # no host round trip: stays asynchronous
            return jax.device_put(rng, replicated), impl
        data = np.asarray(rng, dtype=np.uint32)
        return jax.make_array_from_callback(data.shape, replicated, lambda idx: data[idx]), impl

    def sharding(self, shape: Sequence[int], names: Sequence[str | None]) -> NamedSharding:
        """The sharding of a rollout array of ``shape`` with logical axis ``names``."""
        return fit_sharding(shape, names, self.mesh, self.rules)

    def cache_sharding(self, shape: Sequence[int]) -> NamedSharding:
        """The sharding of a KV-cache array (``k`` or ``v``) of ``shape``."""
        return fit_sharding(shape, CACHE_AXES, self.mesh, self.cache_rules)

    def _rows(self, rows: int, *rest: int, dtype: Any = jnp.int32, names: Sequence[str] = ("length",)):
        """An abstract [rows, *rest] rollout array (batch over the rollout axes)."""
        shape = (rows, *rest)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding(shape, ("batch", *names[: len(rest)])))

    def _abstract_decode_state(self, params: Any, rows: int, slots: int) -> tuple[KVCache, Any]:
        """An abstract KV cache of ``rows`` x ``slots`` and next-token logits [rows, V], as
        prefill hands them on (the model's shapes and cache dtype read off ``params``)."""
        model = merge_rollout(self.graphdef, params)
        arch = model.config
        shape = (arch.num_hidden_layers, rows, slots, arch.num_key_value_heads, arch.head_dim)
        kv = jax.ShapeDtypeStruct(shape, self._cache_dtype(model), sharding=self.cache_sharding(shape))
        logits = self._rows(rows, arch.vocab_size, dtype=jnp.float32, names=("vocab",))
        return KVCache(k=kv, v=kv), logits

    def _abstract_key(self, key: jax.Array) -> tuple[Any, str]:
        data = jax.random.key_data(key)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=replicated), jax.random.key_impl(key)

    def _lower_prefill(self, params: Any, prompts: int, prompt_length: int) -> Any:
        tok = self._rows(prompts, prompt_length)
        return self.prefill_jit.lower(params, tok, tok)

    # ------------------------------------------------------------------ internals

    def _constrain(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.sharding(x.shape, names))

    def _place(self, x: Any, names: Sequence[str]) -> jax.Array:
        sharding = self.sharding(np.shape(x), names)
        if isinstance(x, jax.Array):
            return jax.device_put(x.astype(jnp.int32), sharding)
        data = np.asarray(x, dtype=np.int32)
        return jax.make_array_from_callback(data.shape, sharding, lambda idx: data[idx])

    def quantize_weights(self, prepared: Any) -> Any:
        """``rollout.quantization.weights``: the prepared state's projections as codes and
        per-channel scales (:class:`~grpo.models.rollout_quant.QuantizedWeights`), one
        jitted program a sync, in the prepared state's layout; ``none``: as they are.
        Abstract weights (``grpo plan``) give their abstract quantized form."""
        if self.weight_format == "none" or isinstance(prepared, QuantizedWeights):
            return prepared
        leaves = jax.tree.leaves(prepared)
        if leaves and isinstance(leaves[0], jax.ShapeDtypeStruct):
            return abstract_quantized(jax.eval_shape(self.quantize_jit, prepared), prepared)
        return self.quantize_jit(prepared)

    def quantize_lowerings(self, prepared: Any) -> dict[str, Any]:
        """``{"quantize": lowering}`` of the once-per-sync quantize program on the abstract
        ``prepared`` weights (``grpo plan`` lists and compiles it); {} when unquantized."""
        if self.quantize_jit is None:
            return {}
        return {"quantize": lambda: self.quantize_jit.lower(prepared)}

    def _model(self, params: Any):
        model = merge_rollout(self.graphdef, params)
        model.mesh = self.mesh
        model.set_activation_rules(self.rules)
        if not self.lora_adapters:
            model.use_adapters(False)
        return model

    def _cache_dtype(self, model) -> Any:
        return model.dtype if self.cache_dtype is None else jnp.dtype(self.cache_dtype)

    def _constrain_cache(self, cache: KVCache) -> KVCache:
        return KVCache(*(jax.lax.with_sharding_constraint(x, self.cache_sharding(x.shape)) for x in cache))

    def _grow(self, cache: KVCache, length: int) -> KVCache:
        extra = length - cache.max_length
        if extra == 0:
            return cache
        pad = ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0))
        return self._constrain_cache(KVCache(k=jnp.pad(cache.k, pad), v=jnp.pad(cache.v, pad)))

    def plan(self) -> tuple[tuple[int, int], ...]:
        """The decode segments (see :func:`segment_plan`)."""
        return segment_plan(self.sampling.max_new_tokens, early_stop_chunk=self.chunk(), kv_segment=self.kv_segment)

    def _first_slots(self) -> int:
        """Decode slots the prefilled cache is grown by (the whole first segment)."""
        plan = self.plan()
        return plan[0][1] if plan else 0

    def _prefill_impl(self, params: Any, tokens: jax.Array, mask: jax.Array, repeat: int | None = None) -> Prefilled:
        model = self._model(params)
        K = self.sampling.num_generations if repeat is None else repeat
        # Left-align every row (identity for left-padded input).
        tokens, mask = left_align(tokens, mask)
        logits, cache = prefill_forward(model, tokens, mask, cache_dtype=self._cache_dtype(model))  # P V
        Lp = tokens.shape[1]
        cache = self._grow(self._constrain_cache(cache.repeat(K)), Lp + self._first_slots())
        return Prefilled(
            cache=cache,
            logits=self._constrain(jnp.repeat(logits, K, axis=0), ("batch", "vocab")),
            prompt_tokens=self._constrain(jnp.repeat(tokens, K, axis=0), ("batch", "length")),
            prompt_mask=self._constrain(jnp.repeat(mask, K, axis=0), ("batch", "length")),
        )


class Sampler(BatchRows, BaseSampler):
    """Generates K single-turn completions per prompt with a jitted prefill + decode.

    Rows enter through the engine contract too (:class:`~grpo.engine.rollout.batch_rows.BatchRows`:
    ``begin``/``submit``/``step``/``read``/``outputs``): a step rolls out every queued row
    as one batch. With :attr:`record_routing` (a mixture-of-experts model) the rollout
    carries each completion token's routed experts (``RolloutOutput.routed_experts``).

    Args (beside :class:`BaseSampler`'s): ``detokenize(tokens [b, N], mask [b, N]) ->
    texts``, what :meth:`sample` scores rows by (e.g. ``Policy.decode``); only
    :meth:`sample` needs it."""

    records_routing = True

    def __init__(self, graphdef: Any, *, detokenize: Callable[[np.ndarray, np.ndarray], list[str]] | None = None,
                 **kwargs: Any):
        super().__init__(graphdef, **kwargs)
        self.detokenize = detokenize
        # Donation only helps when decode can hand the same buffer back (one segment);
        # with several segments the first growth copies the cache anyway.
        self._decode_donating = jax.jit(self._decode_impl, static_argnames=("key_impl",), donate_argnums=(1,))
        self._decode_plain = jax.jit(self._decode_impl, static_argnames=("key_impl",))

    # ------------------------------------------------------------------ public API

    def generate(self, params: Any, prompt_tokens: Any, prompt_mask: Any, rng: jax.Array,
                 stop_at: Any = None) -> RolloutOutput:
        """The device side of :meth:`sample`: the rollout's global arrays alone.
        ``stop_at`` [P*K] (benchmarks only): each row stops once it has that many tokens."""
        out, _ = self.decode(params, self.prefill(params, prompt_tokens, prompt_mask), rng, stop_at=stop_at)
        return out

    def decode(self, params: Any, prefilled: Prefilled, rng: jax.Array,
               stop_at: Any = None) -> tuple[RolloutOutput, jax.Array]:
        """Decode from a :class:`Prefilled` (whose cache is donated: do not reuse it).

        Returns the rollout and the number of sampling steps that ran (a device scalar,
        at most ``max_new_tokens``; fewer when every row stopped early)."""
        fn = self.decode_jit()
        raw, impl = self.place_key(rng)
        if stop_at is not None:
            stop_at = self._place(np.asarray(stop_at, np.int32), ("batch",))
        out, steps, _cache = fn(params, prefilled.cache, prefilled.logits, prefilled.prompt_tokens,
                                prefilled.prompt_mask, raw, stop_at, key_impl=impl)
        return out, steps

    def lowerings(self, params: Any, *, prompts: int, prompt_length: int, key: jax.Array) -> dict[str, Any]:
        rows = prompts * self.sampling.num_generations

        def decode():
            cache, logits = self._abstract_decode_state(params, rows, prompt_length + self._first_slots())
            raw, impl = self._abstract_key(key)
            toks = self._rows(rows, prompt_length)
            # stop_at passed as the rollout passes it (None): the same call signature, so a
            # decode compiled ahead on these is the executable a step's call runs.
            return self.decode_jit().lower(params, cache, logits, toks, toks, raw, None, key_impl=impl)

        return {"prefill": lambda: self._lower_prefill(params, prompts, prompt_length), "decode": decode}

    def jitted(self) -> dict[str, list[Any]]:
        return {**super().jitted(), "decode": [self._decode_donating, self._decode_plain]}

    def cache_slots(self, prompt_length: int) -> int:
        seg = self.plan()
        return prompt_length + (seg[-1][1] if seg else 0)

    # ------------------------------------------------------------------ lower-level pieces (benchmarks)

    def decode_jit(self):
        """The jitted decode:
        ``fn(params, cache, logits, prompt_tokens, prompt_mask, raw_key, *, key_impl)
        -> (RolloutOutput, steps, final cache)``, the cache donated when it can be."""
        return self._decode_donating if len(self.plan()) <= 1 else self._decode_plain

    # ------------------------------------------------------------------ internals

    def _decode_impl(
        self,
        params: Any,
        cache: KVCache,
        logits: jax.Array,
        prompt_tokens: jax.Array,
        prompt_mask: jax.Array,
        raw_key: jax.Array,
        stop_at: jax.Array | None = None,
        *,
        key_impl: str | None,
    ) -> tuple[RolloutOutput, jax.Array, KVCache]:
        s = self.sampling
        model = self._model(params)
        B, Lp = prompt_tokens.shape
        N = s.max_new_tokens
        keys = row_key_data(raw_key, key_impl, jnp.arange(B, dtype=jnp.int32))
        prompt_len = prompt_mask.sum(axis=1).astype(jnp.int32)  # B
        eos = jnp.asarray(s.eos_ids, jnp.int32) if s.eos_ids else None
        plan = self.plan()
        W = (plan[-1][1] if plan else 0) + 1  # buffer width: steps 0 .. n (n >= N - 1)

        def record(state: _State, step: jax.Array, logits: jax.Array, cache: KVCache) -> _State:
            # Steps past the cap (the rounding of the last chunk) change nothing.
            active = ~state.done & (step < N)
            drawn = draw(logits, keys, step, active, sampling=s, stops=eos, stop_at=stop_at)
            return _State(
                cache=cache,
                prev=drawn.tokens,
                done=state.done | drawn.stopped,
                lengths=state.lengths + active.astype(jnp.int32),
                out=state.out.column(step, drawn),
                steps=state.steps + 1,
                routed=state.routed,
            )

        def batch(x, *names):
            return self._constrain(x, ("batch",) + names)

        routing = self.record_routing
        c = model.config
        state = _State(
            cache=cache,
            prev=batch(jnp.full((B,), s.pad_id, jnp.int32)),
            done=batch(jnp.zeros((B,), bool)),
            lengths=batch(jnp.zeros((B,), jnp.int32)),
            out=Outputs.blank(B, W, s, lambda x: batch(x, "length")),
            steps=jnp.int32(0),
            routed=batch(jnp.full((B, W, c.num_hidden_layers, c.num_experts_per_tok), -1, EXPERT_ID_DTYPE),
                         "length", None, None) if routing else None,
        )
        state = record(state, jnp.int32(0), logits, cache)

        def make_step(kv_mask: jax.Array):
            def step(t, state: _State) -> _State:
                t = jnp.asarray(t, jnp.int32)
                out = model(
                    state.prev[:, None],
                    (prompt_len + t - 1)[:, None],
                    kv_mask,
                    cache=state.cache,
                    write_index=Lp + t - 1,
                    **({"moe": MoeCall()} if routing else {}),
                )
                new = record(state, t, model.logits(out[0])[:, 0, :], out[1])
                return new._replace(routed=_fed_experts(state.routed, out[2].experts, t)) if routing else new

            return step

        C = self.chunk()
        for a, b in plan:
            state = state._replace(cache=self._grow(state.cache, Lp + b))
            # Prompt padding hidden; every generated slot visible (slots not yet written
            # are hidden by causality).
            kv_mask = batch(jnp.concatenate([prompt_mask != 0, jnp.ones((B, b), bool)], axis=1), "length")
            step = make_step(kv_mask)
            if C == 0:
                state = jax.lax.fori_loop(a + 1, b + 1, step, state)
                continue
            # Segments are whole chunks (segment_plan).
            state = run_chunks(step, state, first=a + 1, n_chunks=(b - a) // C, chunk=C,
                               going=lambda st: ~jnp.all(st.done))

        positions = jnp.arange(N, dtype=jnp.int32)[None, :]
        out = RolloutOutput(
            prompt_tokens=prompt_tokens,
            prompt_mask=prompt_mask,
            tokens=batch(state.out.tokens[:, :N], "length"),
            mask=batch((positions < state.lengths[:, None]).astype(jnp.int32), "length"),
            lengths=state.lengths,
            truncated=~state.done,
            logprobs=batch(state.out.logprobs[:, :N], "length"),
            behaviour_logprobs=None if state.out.behaviour is None else batch(state.out.behaviour[:, :N], "length"),
            routed_experts=None if state.routed is None else batch(
                _fed_only(state.routed[:, :N], state.lengths), "length", None, None),
        )
        return out, jnp.minimum(state.steps, N), state.cache


__all__ = [
    "BaseSampler", "Prefilled", "RolloutOutput", "Sampled", "Sampler", "SamplingParams", "Texts", "draw",
    "effective_chunk", "run_chunks", "segment_plan",
]
