"""The rollout-engine contract: how weights and rows enter an engine and how finished
rows leave it (after the engine cores of serving engines: vLLM v1's
``add_request``/``step``, Tunix's ``BaseRollout``).

An engine is what a :class:`~grpo.core.contracts.RolloutEnginePlugin` builds. Every
caller in grpo talks to it through these methods and nothing else:

- :meth:`RolloutEngine.update_weights` ``(params, version)``: the one place weights enter
  (the trained weights, once per sync; the engine prepares them for its programs:
  :attr:`RolloutEngine.prepare` reshards them into the rollout's layout or merges LoRA,
  later quantizes them; an external server is pushed them). ``version`` is the policy
  version (optimizer steps applied) that every token drawn from then on is stamped with.
  :attr:`RolloutEngine.weights` is what the programs read; :meth:`RolloutEngine.release`
  drops a prepared copy once a draw is done with it.
- :meth:`RolloutEngine.submit` ``(rows)``: :class:`Rows` to roll out, each with its id and
  its own PRNG key (so a row's samples never depend on batching or slots).
- :meth:`RolloutEngine.step`: advance one unit of work (a chunk of decode steps) and say
  which rows finished (:class:`Progress`); :meth:`RolloutEngine.read` hands their
  tokens, masks, both log-probs, per-token policy versions and finish reason
  (:class:`FinishedRows`).
- :meth:`RolloutEngine.abort` ``(ids)``: drop rows (queued or decoding);
  :meth:`RolloutEngine.pause`: hold everything at the current boundary (a weight change
  mid-flight: the rows in flight go on under the next weights).

Feeders built on these alone: one batch (:meth:`RolloutEngine.sample`, what the trainer
and the evaluator call), streaming dynamic sampling, partial rollouts, multi-turn turns
and the plan's simulation. An engine without a streaming core leaves ``streams`` False:
the built-in static engine takes rows through :meth:`RolloutEngine.submit` too, but a
:meth:`RolloutEngine.step` rolls out everything queued as one batch, so nothing joins
while rows run; an external engine may implement :meth:`RolloutEngine.sample` alone.
Dynamic sampling then rolls out whole rounds, and ``grpo config validate`` refuses what
needs streaming (partial rollouts) before start-up.

Planning methods (:meth:`RolloutEngine.lowerings`, :meth:`RolloutEngine.cache_bytes`,
:meth:`RolloutEngine.simulate`, ...) are optional: their defaults raise
:class:`NotPlanned`, and ``grpo plan`` then reports the engine as "not planned" instead
of failing.

This module imports neither JAX nor NumPy (``grpo.core`` stays light): arrays are
annotated by name.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Sequence

from pydantic import BaseModel

from grpo.core.contracts.base import _PluginBase


class NotPlanned(NotImplementedError):
    """An engine does not implement a planning method: ``grpo plan`` says "not planned"."""


class RolloutOutput(NamedTuple):
    """A rollout; every array is global, batch B = P*K, row ``b*K + j`` is sample j of
    prompt b."""

    prompt_tokens: Any  # [B, Lp] int32, prompts repeated K times, left-aligned
    prompt_mask: Any  # [B, Lp] int32
    tokens: Any  # [B, N] int32 completion tokens (pad_id after the stop)
    mask: Any  # [B, N] int32: 1 on generated tokens up to and including the stop token
    lengths: Any  # [B] int32 = mask.sum(1)
    truncated: Any  # [B] bool: hit max_new_tokens without a stop token
    # [B, N] float32 log_softmax(logits / T)[token] over the full vocabulary (what the
    # trainer computes: the sampler/trainer gap metrics); 0 where mask is 0.
    logprobs: Any
    # [B, N] int32, multi-turn only: 1 on the model's own tokens (``mask`` also covers the
    # inserted environment tokens, which are attended to but never trained on); None: = mask.
    loss_mask: Any = None
    # [B, N] float32, with top-k/top-p only: the behaviour log-probs, under the truncated
    # distribution renormalised over its kept tokens (0 where mask or loss_mask is 0);
    # None: no filter, the behaviour log-probs are ``logprobs`` (see :attr:`behaviour`).
    behaviour_logprobs: Any = None
    # [B, N] int32, partial rollouts only (``train.async.partial_rollouts``): the policy
    # version (optimizer steps applied) that drew each token, -1 where mask is 0; a row
    # that went on across a weight change holds several. None: one version per rollout.
    versions: Any = None
    # [B, N, layers, k] int16, mixture-of-experts models with ``model.moe.router_replay``
    # on: the experts each completion token was routed to in every layer when the sampler
    # fed it; -1 where it has none (off the mask, and the row's last token, never fed).
    routed_experts: Any = None

    @property
    def behaviour(self) -> Any:
        """The behaviour policy's log-probs [B, N] of the sampled tokens: under the
        distribution that drew them (top-k/top-p truncated and renormalised), what
        importance weights against the sampler use (``loss.mismatch``). Without a filter
        it is ``logprobs`` itself, the same array."""
        return self.logprobs if self.behaviour_logprobs is None else self.behaviour_logprobs


@dataclasses.dataclass
class Sampled:
    """What one rollout gives, whatever the engine: the rows as global device arrays and
    what the host knows of this process's rows (lists in global row order).

    ``texts`` are what reward functions score (a multi-turn row's last model turn;
    single-turn rows may be detokenized when read); ``examples`` are the rows' examples
    (a multi-turn row's carries its trajectory in ``messages``); ``episodes`` is the
    multi-turn host record (turns, tool counters, host seconds), None for single-turn."""

    output: RolloutOutput
    texts: Sequence[str]
    examples: list[dict[str, Any]]
    episodes: Any = None


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows to roll out (:meth:`RolloutEngine.submit`).

    - ``ids`` [n] int: the rows' ids, unique among the rows an engine holds;
    - ``prompt_tokens``, ``prompt_mask`` [n, Lp] int32 (padded either side; every row
      has at least one real token);
    - ``keys`` [n]: each row's PRNG key (typed, ``jax.random.key``), or None: the
      session's rollout key gives row ``r`` the key ``fold_in(key, r)``; the row draws
      its step ``t`` from ``fold_in(its key, t)``;
    - ``widths`` [n] int or None: the prompt width each row's prefill pads to (rows
      prefilled together pad to the widest), None: ``Lp``.
    """

    ids: Any
    prompt_tokens: Any
    prompt_mask: Any
    keys: Any
    widths: Any = None


@dataclasses.dataclass(frozen=True)
class Progress:
    """What one :meth:`RolloutEngine.step` did: ``finished`` the ids of the rows that
    finished in it (in the engine's order: the continuous engine's is slot order), ``idle`` True when nothing was queued or running (the
    step did nothing)."""

    finished: tuple[int, ...] = ()
    idle: bool = False


@dataclasses.dataclass(frozen=True)
class FinishedRows:
    """Finished rows on the host (:meth:`RolloutEngine.read`), in the order asked:
    ``tokens``, ``mask``, ``logprobs`` [n, N]; ``behaviour_logprobs`` [n, N] or None (no
    top-k/top-p filter); ``lengths`` [n]; ``truncated`` [n] (finish reason: True = the
    cap, False = a stop token); ``versions`` [n, N] the policy version of each token
    (-1 off the mask); ``routed_experts`` [n, N, layers, k] int16 or None: each token's
    experts when the engine fed it (``RolloutOutput.routed_experts``, router replay)."""

    ids: Any
    tokens: Any
    mask: Any
    logprobs: Any
    behaviour_logprobs: Any
    lengths: Any
    truncated: Any
    versions: Any
    routed_experts: Any = None


class RolloutEngine(abc.ABC):
    """A rollout engine: weights in once per sync, rows in with their keys, finished
    rows out (see the module docstring). ``sampling`` is the engine's
    ``SamplingParams`` (cap, K, temperature, filters, stop and pad ids).

    **Weights.** :meth:`update_weights` ``(params, version)`` is the one place weights
    enter an engine; grpo calls it with the *trained* weights as the trainer holds them
    (the whole model's state, or with LoRA the adapters alone: the frozen base is bound
    into :attr:`prepare`), already on the rollout's devices, once per sync (after every
    update, and before evaluation on the evaluation's engine). What the engine's programs
    read is :attr:`weights`: ``prepare(params)``, the run's preparation, which the program
    builder gives every engine it builds (:attr:`EngineContext.prepare`; an engine that
    set its own :attr:`prepare` keeps it). It is the state as is on the training layout
    (no copy), the LoRA adapters merged into the projections (``model.lora.sampler:
    merged``), or a copy in a rollout style's own layout (``reshard``, merging on the
    way), then :meth:`quantize_weights` (a low-precision rollout's codes and scales).

    The preparation is lazy: :meth:`update_weights` only records the params (dropping the
    last prepared copy), and the first read of :attr:`weights` at that version prepares
    them; :meth:`release` (and :meth:`end`) drops the prepared copy, keeping the params,
    and the next read prepares them again. A draw reads :attr:`weights` and releases them
    when its decode is done, so a copy (a reshard, a merge) lives from the draw until its
    decode ends and never through the next training update, as it would if
    :meth:`update_weights` prepared eagerly. On the training layout without merging no
    copy is made at all: the programs read the update's own arrays, which the next
    update donates (so the loop syncs after every update, before the next draw).

    A subclass that keeps the base's :meth:`update_weights` (calling ``super()``) reads
    :attr:`weights`; handing the engine its own :attr:`weights` back
    (``update_weights(engine.weights, v)``, as a wrapper's ``sample`` may) changes
    nothing but the version, so nothing is prepared twice. A subclass that overrides
    :meth:`update_weights` without calling ``super()`` (an adapter pushing the weights to
    an external server) receives the trained params as they are and prepares them its
    own way (``context.prepare`` is there to compose with)."""

    sampling: Any
    #: The rollout's rows carry a loss mask (a multi-turn rollout's inserted tokens).
    loss_mask: bool = False
    #: The engine streams (:meth:`submit`/:meth:`step` run row by row, so streaming
    #: dynamic sampling and partial rollouts can feed it while it runs).
    streams: bool = False
    #: The engine models its own schedule (:meth:`simulate`: a paged engine whose decode
    #: ``grpo plan --lengths`` costs chunk by chunk, and whose cache is a page pool).
    simulates: bool = False
    #: ``prepare(params)`` -> what the engine's programs read, for trained ``params`` (see
    #: the class docstring). None: the params as they come. The program builder sets it
    #: to :attr:`EngineContext.prepare` on an engine that has none.
    prepare: Callable[[Any], Any] | None = None

    # ------------------------------------------------------------------ weights

    def update_weights(self, params: Any, version: int = 0) -> None:
        """The trained weights ``params`` every row drawn from now on reads (prepared on
        the first read of :attr:`weights`), as policy ``version``. Handing back the
        engine's own :attr:`weights` keeps them (only the version changes)."""
        if params is None or params is not self.__dict__.get("_prepared"):
            self._params, self._prepared = params, None
        self._version = int(version)

    @property
    def weights(self) -> Any:
        """What the engine's programs read at the current version: ``prepare(params)`` of
        the last :meth:`update_weights`, prepared on the first read and held until
        :meth:`release` or the next :meth:`update_weights`."""
        prepared = self.__dict__.get("_prepared")
        if prepared is None:
            params = self.__dict__.get("_params")
            if params is None:
                raise RuntimeError(f"{type(self).__name__}: update_weights() was never called")
            prepared = params if self.prepare is None else self.prepare(params)
            prepared = self.quantize_weights(prepared)
            self._prepared = prepared
        return prepared

    def quantize_weights(self, prepared: Any) -> Any:
        """The prepared weights as the engine's programs read them in its own precision
        (``rollout.quantization.weights``: the built-in engines' int8/fp8 codes and
        per-channel scales, once per sync, on the rollout's side only). The default keeps
        them as they are."""
        return prepared

    @property
    def version(self) -> int:
        return self.__dict__.get("_version", 0)

    def release(self) -> None:
        """Drop the prepared copy of the weights (a draw is done with them): the params of
        the last :meth:`update_weights` stay, and the next read of :attr:`weights`
        prepares them again."""
        self._prepared = None

    # ------------------------------------------------------------------ one batch

    @abc.abstractmethod
    def sample(self, params: Any, prompt_tokens: Any, prompt_mask: Any, rng: Any,
               examples: Sequence[Mapping[str, Any]]) -> Sampled:
        """Roll out ``num_generations`` samples of each of the P prompts [P, Lp] with the
        weights ``params``: what the programs read, the engine's own :attr:`weights` (the
        caller reads them after :meth:`update_weights` and releases them when its draw is
        done); row ``b*K + j`` draws from ``fold_in(rng, b*K + j)``. ``examples``: this
        process's rows' examples."""

    # ------------------------------------------------------------------ rows (streaming)

    def begin(self, *, rows: int, prompt_length: int, key: Any = None, versions: bool = False,
              slots: int | None = None, on_weight_change: str = "continue") -> None:
        """A session of row ids [0, ``rows``) with prompts of at most ``prompt_length``
        tokens (what the last session held is dropped). ``key``: the rollout key (row
        ``r`` draws from ``fold_in(key, r)``), each row's key [rows], or None (each
        :class:`Rows` brings its own). ``versions``: stamp each token with the policy
        version of the weights that drew it (:class:`FinishedRows`). ``slots``: run at most
        that many rows at once (None: the engine's choice). ``on_weight_change``: what rows
        in flight do when :meth:`update_weights` brings a new version: ``continue`` over
        the KV cache the old weights wrote, or ``reprefill`` (their cache rebuilt under the
        new weights before their next token)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream rows (streams=False)")

    def submit(self, rows: Rows) -> None:
        """Queue ``rows`` after those already queued."""
        raise NotImplementedError(f"{type(self).__name__} does not stream rows (streams=False)")

    def step(self) -> Progress:
        """Advance one unit of work; the rows that finished."""
        raise NotImplementedError(f"{type(self).__name__} does not stream rows (streams=False)")

    def read(self, ids: Sequence[int]) -> FinishedRows:
        """The finished rows ``ids`` on the host."""
        raise NotImplementedError(f"{type(self).__name__} does not stream rows (streams=False)")

    def abort(self, ids: Sequence[int]) -> None:
        """Drop rows ``ids``, queued or running (their slots and cache are freed)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream rows (streams=False)")

    def outputs(self) -> RolloutOutput:
        """Every row of the session as the rollout's global device arrays (row ``r`` at
        index ``r``)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream rows (streams=False)")

    def in_flight(self) -> int:
        """Rows of the session queued or running."""
        raise NotImplementedError(f"{type(self).__name__} does not stream rows (streams=False)")

    def stats(self) -> dict[str, Any]:
        """The session's figures so far (for the logs and benchmarks)."""
        return {}

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The session between two steps as JSON and host (numpy) arrays, for a
        checkpoint (partial rollouts keep their rows in flight across a preemption): what
        :meth:`restore` needs to go on with every row, queued or running, from the tokens
        it has drawn. An engine that cannot leaves this default: its rows in flight are
        drawn again after a resume (``async/regenerated_tokens``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot checkpoint its rows in flight")

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> int:
        """Put a session just begun (:meth:`begin`, with the same arguments) back where
        :meth:`snapshot` left one, under the weights of the latest :meth:`update_weights`
        (a cache is rebuilt from the tokens, not stored). Returns the running rows put
        back."""
        raise NotImplementedError(f"{type(self).__name__} cannot checkpoint its rows in flight")

    def regenerated_tokens(self) -> int:
        """Tokens the session has drawn a second time (e.g. rows evicted and restarted)."""
        return 0

    def pause(self) -> None:
        """Hold every row at the current boundary: nothing runs until the next
        :meth:`step`, which reads the weights of the latest :meth:`update_weights`. A
        chunked engine is always at a boundary between steps, so the default does
        nothing."""

    def end(self) -> None:
        """The rows are done with: release what the engine holds for them (its cache, the
        prepared copy of the weights: :meth:`release`)."""
        self.release()

    # ------------------------------------------------------------------ planning (optional)
    #
    # What ``grpo plan`` asks an engine (grpo.engine.planning): its programs to lower and
    # their abstract inputs and outputs, its KV cache, and its decode's cost model (the
    # static one: :meth:`plan`; a multi-turn rollout's: :meth:`width`, :meth:`allocated`,
    # :attr:`max_turns`). Each default raises :class:`NotPlanned`: the plan then leaves the
    # rollout out and says why (its update side is still planned). A paged engine
    # (``simulates``) adds its page-pool model (``slots_for``, ``shards``, ``pool_size``,
    # ``page_size``: see :class:`grpo.engine.rollout.continuous.ContinuousSampler`).

    #: Model turns per row (a multi-turn engine sets it): the plan costs ``max_turns - 1``
    #: appends of the replies between turns.
    max_turns: int = 1

    def jitted(self) -> dict[str, list[Any]]:
        """The engine's jitted programs by name (what a run executes; ``grpo plan`` lists them)."""
        return {}

    def lowerings(self, params: Any, *, prompts: int, prompt_length: int, key: Any) -> dict[str, Any]:
        """Each program of a rollout of ``prompts`` prompts, by name, as a zero-argument
        lowering (``grpo plan`` compiles them)."""
        raise NotPlanned(f"{type(self).__name__} lists no programs")

    def quantize_lowerings(self, prepared: Any) -> dict[str, Any]:
        """The programs :meth:`quantize_weights` runs once per sync on the abstract
        ``prepared`` weights, by name, as zero-argument lowerings (``grpo plan`` lists and
        compiles them beside :meth:`lowerings`); none by default."""
        return {}

    def cache_slots(self, prompt_length: int) -> int:
        """Slots of a row's KV cache at the cap."""
        raise NotPlanned(f"{type(self).__name__} has no cache model")

    def cache_bytes(self, params: Any, *, rows: int, prompt_length: int) -> int:
        """Per-device bytes of the rollout's KV cache."""
        raise NotPlanned(f"{type(self).__name__} has no cache model")

    def abstract_output(self, *, prompts: int, prompt_length: int) -> RolloutOutput:
        """The :class:`RolloutOutput` of ``prompts`` prompts as abstract arrays."""
        raise NotPlanned(f"{type(self).__name__} has no abstract output")

    def simulate(self, *, prompt_lengths: Any, completions: Any, prompt_length: int,
                 trace: list | None = None, groups: Any = None) -> dict[str, int]:
        """The engine's schedule for rows of known lengths, without a model (``grpo plan --lengths``);
        ``groups`` [rows]: each row's prompt (a group's samples share one; the plan passes
        it only to an implementation that takes it)."""
        raise NotPlanned(f"{type(self).__name__} has no schedule model")

    def plan(self) -> tuple[tuple[int, int], ...]:
        """The decode loop as segments ``(a, b)``: steps ``a`` to ``b`` each read the
        weights and a cache of the prompt + ``b`` slots (the plan's decode cost of a
        single-turn rollout; the built-in samplers' ``segment_plan``)."""
        raise NotPlanned(f"{type(self).__name__} has no decode cost model")

    def width(self) -> int:
        """A multi-turn rollout: sampling steps of one turn (the plan's decode cost: every
        step reads the whole :meth:`allocated` cache)."""
        raise NotPlanned(f"{type(self).__name__} has no multi-turn decode cost model")

    def allocated(self, prompt_length: int) -> int:
        """A multi-turn rollout: the cache slots a row holds after a prompt of
        ``prompt_length`` tokens (every turn's decode reads them all)."""
        raise NotPlanned(f"{type(self).__name__} has no multi-turn decode cost model")



@dataclasses.dataclass(frozen=True)
class EngineContext:
    """What the program builder hands a rollout engine's :meth:`RolloutEnginePlugin.build`.

    - ``graphdef``: the policy's ``nnx.split`` graph (JAX engines merge it with the
      weights each :meth:`sample` call receives);
    - ``sampling``: a :class:`grpo.engine.rollout.sampler.SamplingParams` (cap, K,
      temperature, top-k/top-p, greedy, stop and pad ids);
    - ``rollout``: the run's ``rollout`` config section (the built-in engines' options
      live there, e.g. ``rollout.continuous``);
    - ``sampler_kwargs``: the keywords of :class:`grpo.engine.rollout.sampler.BaseSampler`
      for the run's rollout layout (mesh, batch axes, sharding rules, kv_segment, LoRA);
    - ``detokenize``: ``(tokens [b, N], mask [b, N]) -> texts`` of the run's tokenizer;
    - ``conversations``: a multi-turn task's conversations (None when single-turn);
    - ``multi_turn``: whether the task rolls out conversations (tools or an environment);
    - ``prepare``: trained params -> what the engine's programs read (the run's weight
      preparation, built by the program builder from the rollout's placement: the state
      as is, LoRA merged, or resharded into a rollout style's own layout, with the frozen
      LoRA base bound). The builder sets it as :attr:`RolloutEngine.prepare` on the
      engine :meth:`RolloutEnginePlugin.build` returns unless the engine set its own; an
      engine that builds another inside it (a wrapper) gives it to the inner one if it
      hands the inner engine trained weights. None: the params as they come;
    - ``compile_ahead``: ``train.compile.ahead`` is ``all``: compile every program shape
      the engine can run before it first runs one (the built-in continuous engine: its
      decode buckets, :mod:`grpo.engine.rollout.paged.buckets`).
    """

    graphdef: Any
    sampling: Any
    rollout: Any
    sampler_kwargs: Mapping[str, Any]
    detokenize: Any = None
    conversations: Any = None
    multi_turn: bool = False
    prepare: Callable[[Any], Any] | None = None
    compile_ahead: bool = False


class RolloutEnginePlugin(_PluginBase):
    """A rollout engine (``rollout.engine``; options in ``rollout.engine_options``): what
    turns a step's prompts and the current weights into rows.

    :meth:`build` returns a :class:`RolloutEngine` (the contract above: trained weights
    in through ``update_weights``, prepared by ``context.prepare``; one batch through
    ``sample``; rows streamed through ``begin``/``submit``/``step``/``read`` where
    ``streams``). Its one-batch rollout:

    - **Rows with per-row keys**: ``prompt_tokens``/``prompt_mask`` [P, Lp] int32 (padded
      either side), K = ``sampling.num_generations`` rows per prompt, row ``b*K + j``.
      Row ``r`` must draw step ``t`` from ``fold_in(fold_in(rng, r), t)`` or, for an
      external engine, from a seed derived from ``fold_in(rng, r)``: samples then depend
      on the row alone, never on batching or slots, and a resumed run redraws them.
    - **Tokens and both log-probs**: a :class:`Sampled` whose ``output`` is a
      :class:`RolloutOutput` of global arrays, rows sharded over the rollout's batch
      axes: ``tokens``/``mask`` [B, N] (the stop token included, mask 1; ``pad_id`` and
      mask 0 after it), ``lengths`` [B], ``truncated`` [B] (no stop token by the cap),
      ``logprobs`` [B, N] float32 ``log_softmax(logits / temperature)`` over the full
      vocabulary (what the trainer's loss computes, so the mismatch metrics measure
      numerics) and ``behaviour_logprobs`` [B, N] under the distribution that drew the
      token (top-k/top-p truncated and renormalised; None without a filter); ``texts``
      of this process's rows and its ``examples``.

    ``grpo plan`` asks the engine for its programs (:meth:`RolloutEngine.jitted`,
    :meth:`RolloutEngine.lowerings`, ...); an engine without them is reported "not
    planned". An object that is not a :class:`RolloutEngine` (an engine written before
    the contract, with ``sample`` alone) is wrapped by :func:`as_engine` with a
    ``DeprecationWarning``. ``build`` imports the engine's code itself (plugins stay
    importable without JAX).
    """

    multi_turn: ClassVar[bool] = False  # samples multi-turn tasks (tools, environments)
    #: The engine it builds streams rows (:attr:`RolloutEngine.streams`): partial rollouts
    #: and streaming dynamic sampling need it (``grpo config validate`` checks).
    streams: ClassVar[bool] = False
    #: The engine it builds records each single-turn completion token's routed experts
    #: (:attr:`RolloutOutput.routed_experts`, and :attr:`FinishedRows.routed_experts` where
    #: it streams) when asked (``record_routing``): mixture-of-experts router replay
    #: (``model.moe.router_replay``) needs it (``grpo config validate`` checks).
    records_routing: ClassVar[bool] = False
    #: ... and those of a multi-turn row's turns and inserted tokens too.
    records_multi_turn_routing: ClassVar[bool] = False
    #: The engine it builds quantizes its weights at sync (``rollout.quantization.weights``:
    #: :meth:`RolloutEngine.quantize_weights`) / keeps a quantized KV cache
    #: (``rollout.quantization.kv_cache``); ``grpo config validate`` refuses the fields otherwise.
    quantized_weights: ClassVar[bool] = False
    quantized_kv: ClassVar[bool] = False

    def check(self, *, multi_turn: bool, options: BaseModel) -> list[str]:
        """Problems running this engine on a task (one sentence each); the default
        refuses a multi-turn task unless :attr:`multi_turn`."""
        if multi_turn and not self.multi_turn:
            return [f"rollout.engine={self.name!r} samples single-turn tasks only; this run's task has tools or an "
                    "environment: use rollout.engine: static"]
        return []

    @abc.abstractmethod
    def build(self, context: EngineContext, options: BaseModel) -> Any: ...


class _Wrapped(RolloutEngine):
    """An engine object written before the contract (``sample`` and maybe planning
    methods): each call forwards to it."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.sampling = getattr(inner, "sampling", None)
        self.loss_mask = bool(getattr(inner, "loss_mask", False))
        self.max_turns = int(getattr(inner, "max_turns", 1))

    def sample(self, params, prompt_tokens, prompt_mask, rng, examples):
        return self.inner.sample(params, prompt_tokens, prompt_mask, rng, examples)

    def __getattr__(self, name: str) -> Any:  # anything else it has
        return getattr(self.__dict__["inner"], name)


def _forwarding(name: str) -> Any:
    """:class:`_Wrapped`'s planning method ``name``: the wrapped object's where it has one,
    else the contract's default (which raises :class:`NotPlanned`)."""
    default = getattr(RolloutEngine, name)

    def method(self: _Wrapped, *args: Any, **kwargs: Any) -> Any:
        own = getattr(self.inner, name, None)
        return own(*args, **kwargs) if callable(own) else default(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _name in ("jitted", "lowerings", "cache_slots", "cache_bytes", "abstract_output", "simulate", "plan", "width",
              "allocated"):
    setattr(_Wrapped, _name, _forwarding(_name))


def as_engine(built: Any, *, name: str = "") -> RolloutEngine:
    """``built`` (what :meth:`RolloutEnginePlugin.build` returned) as a
    :class:`RolloutEngine`: itself, or an engine written before the contract wrapped so
    that every caller can rely on the contract's methods."""
    if isinstance(built, RolloutEngine):
        return built
    if not callable(getattr(built, "sample", None)):
        raise TypeError(f"rollout engine {name!r}: build() returned {type(built).__name__}, which is neither a "
                        "grpo.RolloutEngine nor has a sample() method")
    import warnings

    warnings.warn(f"rollout engine {name!r}: build() returned a {type(built).__name__}, not a grpo.RolloutEngine; "
                  "it is wrapped for now. Subclass grpo.RolloutEngine (update_weights, sample; submit/step/read "
                  "to stream): the wrapper goes in grpo 0.3.", DeprecationWarning, stacklevel=2)
    return _Wrapped(built)
