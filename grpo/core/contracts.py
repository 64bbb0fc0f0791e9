"""The plugin contracts: what a mesh policy, rollout style, loss, task or model family must provide.

Every plugin is a small object with

- ``name``: unique within its kind, lower-case (``[a-z][a-z0-9_.-]*``);
- ``Options``: a pydantic model with ``extra="forbid"``. The core validates the config
  section of the chosen plugin against it, so a typo fails at load time with its path;
- ``description``: one line for ``grpo plugins list``;
- its behaviour (the abstract methods below).

This module is import-light: no JAX. Loss and task behaviour receives JAX arrays, but
implementations import JAX inside their methods or private modules.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # pragma: no cover
    import jax

MESH_AXES: tuple[str, str, str] = ("dp", "fsdp", "tp")

# --------------------------------------------------------------------------- compile target

_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("grpo_target_platform", default=None)


@contextlib.contextmanager
def compiling_for(platform: str | None):
    """While tracing a program for a mesh, the platform its devices belong to.

    The engine sets it around plugin code it traces (the loss), so a plugin that picks
    kernels by platform (Pallas: Mosaic on TPU, Triton on GPU) compiles for the mesh's
    devices: ``grpo plan`` traces for a TPU topology on a CPU host, where
    ``jax.default_backend()`` is ``cpu``.
    """
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def target_platform() -> str | None:
    """The platform set by :func:`compiling_for` (None outside it)."""
    return _TARGET_PLATFORM.get()


class PluginOptions(BaseModel):
    """Base class for plugin ``Options``: unknown keys are errors, values are checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoOptions(PluginOptions):
    """For plugins that take no options."""


class _PluginBase(abc.ABC):
    name: ClassVar[str]
    description: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = NoOptions

    def parse_options(self, raw: Mapping[str, Any] | None) -> BaseModel:
        return self.Options.model_validate(dict(raw or {}))


# --------------------------------------------------------------------------- mesh


@dataclasses.dataclass(frozen=True)
class Topology:
    """What a mesh policy sees: processes and devices, no device objects.

    ``devices_per_process`` lists the local device count of every process (all equal on
    a healthy pod); ``platform`` is ``cpu``/``gpu``/``tpu`` when known.
    """

    process_count: int
    local_device_count: int
    devices_per_process: tuple[int, ...] = ()
    platform: str = "unknown"

    def __post_init__(self) -> None:
        if not self.devices_per_process:
            object.__setattr__(
                self, "devices_per_process", (self.local_device_count,) * self.process_count
            )

    @property
    def device_count(self) -> int:
        return sum(self.devices_per_process)

    @property
    def uniform(self) -> bool:
        return len(set(self.devices_per_process)) <= 1


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A resolved mesh: sizes of the (dp, fsdp, tp) axes, and warnings for the user."""

    dp: int
    fsdp: int
    tp: int
    warnings: tuple[str, ...] = ()

    axis_names: ClassVar[tuple[str, str, str]] = MESH_AXES

    @property
    def shape(self) -> dict[str, int]:
        return {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp}

    @property
    def size(self) -> int:
        return self.dp * self.fsdp * self.tp

    def axis_size(self, axes: Sequence[str]) -> int:
        out = 1
        for a in axes:
            out *= self.shape[a]
        return out


class MeshPolicy(_PluginBase):
    """Topology in, (dp, fsdp, tp) layout out. Pure: no devices needed.

    Raise :class:`grpo.UserError` when the policy cannot lay out this topology, with a
    message that says what was received.
    """

    @abc.abstractmethod
    def resolve(self, topology: Topology, options: BaseModel) -> MeshLayout: ...


# --------------------------------------------------------------------------- rollout


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The sizes of the policy a rollout layout must divide (no JAX, no weights)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_hidden_layers: int

    @classmethod
    def of(cls, config: Any) -> "ModelDims":
        """From a model family's config (any object with these attributes)."""
        return cls(**{f.name: int(getattr(config, f.name)) for f in dataclasses.fields(cls)})


Rules = Mapping[str, "str | tuple[str, ...] | None"]


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """The layout the rollout programs (prefill, decode) run in, when it is not training's.

    - ``mesh``: sizes of the rollout mesh's (dp, fsdp, tp) axes. Its devices are the
      training mesh's, in the same order, reshaped: no device is added or dropped, and a
      run's arrays on either mesh can meet in one program.
    - ``param_rules``: logical parameter axis -> rollout mesh axes (like
      :data:`grpo.sharding.PARAM_RULES`). The engine reshards the policy into them once
      per step, before prefill, and frees the copy after decode.
    - ``activation_rules``: logical activation axis -> rollout mesh axes, ``batch``
      included (like :data:`grpo.sharding.ACTIVATION_RULES`).
    - ``cache_rules``: logical axes of the KV cache (``layers``, ``batch``,
      ``cache_length``, ``kv_heads``, ``head_dim``) -> rollout mesh axes; None: the
      activation rules.
    - ``batch_axes``: the rollout mesh axes the rollout batch is sharded over.
    - ``tensor_parallel``: how many ways heads, MLP and vocabulary are split (for reports).

    A dimension that does not divide over its mesh axes is replicated (e.g. 2 KV heads
    on tp=8), as everywhere in grpo.
    """

    mesh: MeshLayout
    param_rules: Rules
    activation_rules: Rules
    batch_axes: tuple[str, ...]
    cache_rules: "Rules | None" = None
    tensor_parallel: int = 1

    @property
    def shards(self) -> int:
        """How many ways the rollout batch is split."""
        return self.mesh.axis_size(self.batch_axes)

    def describe(self) -> dict[str, Any]:
        return {"mesh": self.mesh.shape, "tensor_parallel": self.tensor_parallel,
                "batch_axes": list(self.batch_axes)}


class RolloutStyle(_PluginBase):
    """How the rollout programs lie on the devices.

    ``batch_axes`` names the training-mesh axes the batch dimension of prompts/completions
    is sharded over when the rollout runs in the training layout; every other mesh axis
    replicates it.

    ``rollout_layouts`` may instead give the rollout its own layout
    (:class:`RolloutLayout`): the parameters are resharded into it once per step and
    decode reads them there. Empty (the default): the rollout runs on the training
    layout, the parameters as they are (with FSDP, XLA gathers each layer's weights for
    every generated token). Several: candidates; the engine runs the fastest that fits
    by its roofline for the chip (any valid one where it has no chip figures, e.g. CPU).
    Raise :class:`grpo.UserError` naming the option when none can be built for this
    model and topology.
    """

    @abc.abstractmethod
    def batch_axes(self, layout: MeshLayout, options: BaseModel) -> tuple[str, ...]: ...

    def check(self, *, layout: MeshLayout, topology: Topology, options: BaseModel) -> list[str]:
        """Problems with this layout, one sentence each (empty: fine)."""
        return []

    def rollout_shards(self, *, layout: MeshLayout, topology: Topology, options: BaseModel) -> int:
        """How many ways the rollout batch is split, known before the model is (config
        validation checks the batch divides). Default: the size of ``batch_axes``."""
        return layout.axis_size(self.batch_axes(layout, options))

    def rollout_layouts(
        self, *, layout: MeshLayout, topology: Topology, options: BaseModel, model: ModelDims
    ) -> tuple[RolloutLayout, ...]:
        """The rollout's own layout(s); empty: the training layout (see the class doc)."""
        return ()


# --------------------------------------------------------------------------- loss

Aggregation = Literal["token_mean", "sequence_mean", "constant"]


MismatchLevel = Literal["token", "sequence"]
MismatchMode = Literal["truncate", "mask"]


@dataclasses.dataclass(frozen=True)
class MismatchCorrection:
    """Importance weighting of the policy term by how far the trainer's pre-update
    log-probs (``old``) are from the sampler's behaviour log-probs: the two disagree
    through numerics (bf16 decode, a different kernel) even at identical weights, and
    through top-k/top-p, which make the policy that drew the tokens the truncated
    distribution renormalised over its kept tokens (its log-prob is the full one minus the
    log of the kept mass); the loss's ratio assumes the samples came from ``old``.

    The weight is ``w = exp(old - sampler)`` per token at ``level="token"``, and
    ``exp(sum over the row's valid tokens of (old - sampler))`` per row at
    ``level="sequence"`` (the sequence's likelihood ratio). ``mode="truncate"`` multiplies
    the policy term by ``min(w, cap)`` (truncated importance sampling); ``mode="mask"``
    by ``1 if w <= cap else 0`` (the token or the whole sequence is dropped). No gradient
    flows through the weight; the KL and entropy terms are not weighted.
    """

    level: MismatchLevel = "token"
    mode: MismatchMode = "truncate"
    cap: float = 2.0


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Loss settings shared by every implementation (hashable: a static jit argument).

    - ``epsilon_low``/``epsilon_high``: the ratio is clipped to [1-eps_low, 1+eps_high].
    - ``beta``: weight of the k3 KL estimate to the reference policy; 0 disables it and
      the reference log-probs are never needed.
    - ``temperature``: divides the logits before the log-softmax (the sampler's too).
    - ``entropy_coef``: weight of an entropy bonus: ``- entropy_coef * H`` is added to each
      valid token's loss (``H`` the entropy of the full next-token distribution at the
      temperature), aggregated like the policy term; 0 disables it.
    - ``aggregation``: ``token_mean`` (sum over valid tokens / valid-token count),
      ``sequence_mean`` (mean over sequences of each sequence's token mean), ``constant``
      (sum over valid tokens / (sequences * ``max_completion_length``), Dr.GRPO).
    - ``objective``: the name of the registered :class:`ObjectivePlugin` that turns log-probs
      and advantages into the per-token surrogate (``ppo_clip``, ``gspo``, ``cispo``,
      ``sapo``, ...); ``objective_options`` its options as sorted ``(name, value)`` pairs
      (a tuple, so the settings stay hashable).
    - ``mismatch``: the sampler/trainer mismatch correction (:class:`MismatchCorrection`),
      or None: off, and the sampler's behaviour log-probs are unused.
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    temperature: float = 1.0
    aggregation: Aggregation = "token_mean"
    entropy_coef: float = 0.0
    max_completion_length: int = 1
    objective: str = "ppo_clip"
    objective_options: tuple[tuple[str, Any], ...] = ()
    mismatch: MismatchCorrection | None = None

    def normalizer(self, mask: "jax.Array", segment_ids: "jax.Array | None" = None) -> "jax.Array":
        """The aggregation's denominator for the batch whose completion mask is ``mask``
        [B, T]: valid tokens (at least 1), sequences, or sequences * ``max_completion_length``.
        Computed once for the global batch, it makes micro-batch losses sum exactly.
        Sequences are the rows, or with ``segment_ids`` [B, T] (the packed layout, see
        :class:`LossPlugin`) the segments: ids are numbered 1, 2, ... in each bin, so a
        bin's largest id is its sequence count."""
        import jax.numpy as jnp

        if segment_ids is None:
            rows = mask.shape[0]
        else:
            rows = jnp.sum(jnp.max(segment_ids, axis=1)).astype(jnp.float32)
        if self.aggregation == "token_mean":
            return jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)
        if self.aggregation == "sequence_mean":
            return jnp.float32(rows)
        if self.aggregation == "constant":
            return jnp.float32(rows * self.max_completion_length)
        raise ValueError(f"unknown aggregation {self.aggregation!r}")


class LossPlugin(_PluginBase):
    """A GRPO policy-gradient loss that fuses (or not) the output-head matmul.

    ``compute`` is jittable and keyword-only. Shapes: ``hidden`` [B, T, D] (final hidden
    states, already normed), ``head_weight`` [D, V], ``targets`` [B, T] int (the token
    each position predicts), ``mask`` [B, T] (1 on completion tokens that count),
    ``advantages`` [B] (one per row), or [B, T] (one per token: turn-level credit,
    ``train.advantage.credit: turn``), ``old_logprobs`` [B, T] or None (on-policy: the ratio is
    exp(logp - stop_gradient(logp))), ``ref_logprobs`` [B, T] or None (needed iff
    ``settings.beta > 0``), ``sampler_logprobs`` [B, T] (the behaviour policy's log-probs
    from the sampler: under the distribution that drew each token, top-k/top-p truncated
    and renormalised at the temperature — the full-vocabulary ``log_softmax`` when no filter
    is on; passed only when ``settings.mismatch`` is set, so an implementation without the
    mismatch correction may leave the parameter out).

    ``normalizer`` makes gradient accumulation exact: the trainer passes the value for the
    *global* batch (valid-token count for ``token_mean``, sequence count for
    ``sequence_mean``, sequences * max length for ``constant``) so that summing the
    micro-batch losses gives the full-batch loss. None: computed from this batch.

    Returns ``(loss, metrics)``. ``metrics`` holds scalars averaged over this call's valid
    tokens — ``clip_frac/low``, ``clip_frac/high``, ``ratio/mean``, ``kl`` (0 when beta
    is 0), optionally ``approx_kl``, ``entropy``, ``mismatch/*`` and the objective's own
    (``gspo/*``, ``cispo/*``, ...); keys ending in ``/min`` or ``/max`` are the extreme
    over the valid tokens instead of the mean — plus ``num_tokens``
    (valid-token count, to weight micro-batches) and ``logprobs`` [B, T] (per-token
    log-probs, no gradient).

    ``token_logprobs`` gives the per-token log-probs alone (the reference pass when
    ``beta > 0``); the default runs ``compute`` with zero advantages and keeps its
    ``logprobs``, and an implementation overrides it with its forward-only path. Both
    take the head weight in the compute dtype (the dtype of ``hidden``): the engine casts
    it, so every path does the head matmul at one precision.

    **Packed layout** (``train.packing``; only for a plugin with ``supports_packing =
    True``). The step's sequences (prompt + completion, padding dropped) are packed into
    ``B`` bins of ``T`` tokens, several sequences per bin, each contiguous and never split.
    The keyword arguments are the same, every per-token array [bins, T] and already
    aligned (``hidden[:, t]`` predicts ``targets[:, t]``), plus ``segment_ids`` [bins, T]
    int32: the tokens of one sequence share an id unique within its bin (1, 2, ... in
    bin order), 0 marks bin padding. ``mask`` is 1 only on the tokens the loss trains
    (never on prompts, a multi-turn environment's tokens or bin padding), and
    ``advantages`` is always per token [bins, T] (0 on padding). ``segment_ids`` is None
    (or, for ``compute``, not passed at all) in the unpacked layout, where each row is one
    sequence. A row-wise quantity — a per-sequence mean (``sequence_mean``), a sequence
    ratio (GSPO), a sequence-level importance weight — must then reduce over the tokens
    of equal (bin, segment id) instead of over the row: :func:`sequence_sum` does exactly
    that in either layout. The engine always passes ``normalizer`` (of the global batch:
    its valid tokens, sequences, sequences * max length), so a packed loss equals the
    padded one; per-token terms (the ratio, KL, entropy) need nothing new. A plugin
    without ``supports_packing`` is never given ``segment_ids``: the engine runs it on
    the unpacked layout. The update and the log-prob passes call it on the *head layout*,
    a narrower packed layout of the same contract: each row holds, in order, only the
    slots that predict a completion token of a device's bins in a micro-batch (so no
    logits are computed for prompts), its sequences renumbered 1, 2, ..., 0 (and mask 0)
    past the row's count; a sequence's slots stay contiguous and never span two rows.
    """

    supports_packing: ClassVar[bool] = False
    """True when ``compute`` and ``token_logprobs`` take ``segment_ids`` and reduce each
    per-sequence quantity per (bin, segment id) (see the packed layout above). False (the
    default, a loss written before packing): the engine never packs its batches."""

    per_shard: ClassVar[bool] = False
    """True for implementations XLA cannot partition (e.g. a Pallas kernel): the engine
    then calls ``compute`` inside ``shard_map`` over the batch's data-parallel axes, on each
    device's rows with the head weight gathered, and combines the results (the loss is
    summed; metrics are weighted by ``num_tokens``). False: ``compute`` sees global arrays
    and XLA's SPMD partitioner shards it."""

    @abc.abstractmethod
    def compute(
        self,
        *,
        hidden: "jax.Array",
        head_weight: "jax.Array",
        targets: "jax.Array",
        mask: "jax.Array",
        advantages: "jax.Array",
        old_logprobs: "jax.Array | None",
        ref_logprobs: "jax.Array | None",
        settings: LossSettings,
        options: BaseModel,
        normalizer: "jax.Array | float | None" = None,
        sampler_logprobs: "jax.Array | None" = None,
        segment_ids: "jax.Array | None" = None,
    ) -> tuple["jax.Array", dict[str, "jax.Array"]]: ...

    def token_logprobs(
        self, *, hidden: "jax.Array", head_weight: "jax.Array", targets: "jax.Array",
        settings: LossSettings, options: BaseModel, segment_ids: "jax.Array | None" = None,
    ) -> "jax.Array":
        """Per-token log-probs [B, T] (f32, temperature applied) of ``targets``; a
        log-prob is per token, so ``segment_ids`` (packed layout) changes nothing here."""
        import jax.numpy as jnp

        b, t = targets.shape
        _, metrics = self.compute(
            hidden=hidden, head_weight=head_weight, targets=targets, mask=jnp.ones((b, t), jnp.int32),
            advantages=jnp.zeros((b,), jnp.float32), old_logprobs=None, ref_logprobs=None,
            settings=dataclasses.replace(settings, beta=0.0, mismatch=None), options=options,
        )
        return metrics["logprobs"]

    def check(self, *, layout: MeshLayout, options: BaseModel) -> list[str]:
        """Problems with running on this layout (e.g. tp > 1 unsupported)."""
        return []


class ObjectivePlugin(_PluginBase):
    """The policy-gradient objective: what each token contributes to the surrogate that
    the loss maximises, given its log-prob under the policy being trained and under the
    pre-update policy. Chosen by ``loss.objective`` (options in ``loss.objective_options``)
    and carried to every loss implementation as ``LossSettings.objective``, so the
    implementations (the plain-JAX one, the fused kernel) share it: a kernel computes the
    per-token log-probs and their VJP, the objective is elementwise and row-wise JAX on
    top of them.

    :meth:`per_token` is pure and jittable. Shapes: ``logprobs`` [B, T] f32 (carries the
    gradient), ``log_ratio`` [B, T] = ``logprobs - old`` on valid tokens and 0 elsewhere
    (``old`` is ``stop_gradient(logprobs)`` on-policy), ``valid`` [B, T] bool,
    ``advantages`` [B, 1] f32 (or [B, T] with turn-level credit: write the math so that
    it broadcasts). It returns ``(objective, metrics)``: the per-token objective
    [B, T] (maximised: the loss adds ``-objective``, weighted by the mismatch correction
    and aggregated like every other term; padding positions are ignored) and
    ``metrics``, name -> [B, T] per-token values that the loss reduces over the valid
    tokens: the mean, or the minimum / maximum for names ending in ``/min`` / ``/max``.
    Every objective reports ``clip_frac/low`` and ``clip_frac/high`` (0 where nothing is
    clipped) so runs of different objectives log the same columns.

    Packed layout (see :class:`LossPlugin`): ``per_token`` may take a keyword argument
    ``segment_ids`` [bins, T] int32 (None: unpacked, each row one sequence); the arrays are
    then [bins, T], ``advantages`` per token, and anything per sequence (GSPO's ratio)
    must reduce with :func:`sequence_sum`, not over the row. An objective whose
    ``per_token`` has no ``segment_ids`` parameter is called without it
    (:meth:`call_per_token`) and is correct only unpacked, unless it is purely per token:
    :attr:`supports_packing` says which, for the engine to decide.
    """

    @abc.abstractmethod
    def per_token(
        self,
        *,
        logprobs: "jax.Array",
        log_ratio: "jax.Array",
        valid: "jax.Array",
        advantages: "jax.Array",
        settings: LossSettings,
        options: BaseModel,
        segment_ids: "jax.Array | None" = None,
    ) -> tuple["jax.Array", dict[str, "jax.Array"]]: ...

    @property
    def supports_packing(self) -> bool:
        """Whether :meth:`per_token` takes ``segment_ids`` (by its signature; ``**kwargs``
        counts), i.e. computes its per-sequence quantities per segment."""
        params = inspect.signature(self.per_token).parameters
        return "segment_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def call_per_token(self, *, segment_ids: "jax.Array | None" = None, **kwargs: Any):
        """:meth:`per_token` with ``segment_ids`` passed only when packed and accepted, so
        objectives written before packing keep working on the unpacked layout."""
        if segment_ids is not None and self.supports_packing:
            return self.per_token(**kwargs, segment_ids=segment_ids)
        return self.per_token(**kwargs)


def sequence_sum(values: "jax.Array", *, segment_ids: "jax.Array | None" = None) -> "jax.Array":
    """Each token's sum of ``values`` over its sequence: the per-sequence reduction of the
    loss contract, in either layout.

    ``values`` [B, T]. Unpacked (``segment_ids`` None): the row sum, [B, 1]. Packed
    (``segment_ids`` [bins, T], 1, 2, ... per sequence in each bin, 0 for bin padding):
    [bins, T], each token holding the sum over the tokens of equal (bin, segment id) (bin
    padding sums with bin padding: mask it). Both broadcast against [B, T]. Memory is
    O(bins * T): a segment sum over ids offset per bin, never a [bins, T, segments]
    one-hot. A per-sequence mean is ``sequence_sum(x * m) / max(sequence_sum(m), 1)``."""
    import jax
    import jax.numpy as jnp

    if segment_ids is None:
        return jnp.sum(values, axis=1, keepdims=True)  # B 1
    b, t = values.shape
    # Ids are in [0, T] (at most T sequences in a bin): bin i's ids sit at i*(T+1) + id.
    flat = (segment_ids.astype(jnp.int32) + (t + 1) * jnp.arange(b, dtype=jnp.int32)[:, None]).reshape(-1)  # B*T
    sums = jax.ops.segment_sum(values.reshape(-1), flat, num_segments=b * (t + 1))  # B*(T+1)
    return sums[flat].reshape(b, t)  # B T


# --------------------------------------------------------------------------- tools & environments

Message = dict[str, Any]
"""A chat message: ``{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}``
(what ``tokenizer.apply_chat_template`` takes)."""

ToolFn = Callable[..., Any]
"""A tool: a Python callable with type hints on every parameter and a docstring (its first
paragraph is the tool's description; ``name: description`` lines under ``Args:`` describe
the parameters). Its JSON schema reaches the chat template's ``tools=`` argument."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One tool call read from a model turn: the tool's name and its keyword arguments."""

    name: str
    arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A model turn as a :class:`ToolCallFormat` reads it.

    - ``content``: the turn's text outside the tool calls (stripped);
    - ``calls``: the well-formed tool calls, in order;
    - ``errors``: one sentence per malformed call (bad JSON, no name, arguments not an
      object), which the environment answers with a tool message saying so.
    """

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()


class ToolCallFormat(abc.ABC):
    """How a model family writes tool calls in its turns, e.g. Qwen's
    ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``. A
    :class:`ModelPlugin` names its format (``ModelPlugin.tool_call_format``); the built-in
    tool environment parses the model's turns with it.

    - ``name``: the format's name (``qwen``, ``llama3``, ...);
    - ``call_end``: the text that ends one tool call (``</tool_call>``), where a rollout may
      stop decoding the turn; empty: turns end only at a stop token;
    - :meth:`parse`: a turn's text -> :class:`ParsedTurn` (never raises);
    - :meth:`render_call`: a call as the model would write it (scripted transcripts, tests).
    """

    name: ClassVar[str]
    call_end: ClassVar[str] = ""

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedTurn: ...

    @abc.abstractmethod
    def render_call(self, call: ToolCall) -> str: ...


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """What :meth:`Environment.step` returns.

    - ``messages``: the messages to append after the model's turn (tool results, a user
      reply); None or empty when the conversation is over;
    - ``done``: the episode is over (the rollout stops this row);
    - ``info``: counters and notes for metrics (``tool_calls``, ``tool_errors``,
      ``tool_timeouts``, ``tool_truncated``: ints; anything else is ignored by the engine).
    """

    messages: "Sequence[Message] | None"
    done: bool
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
    """One conversation of a multi-turn rollout (one per completion row; each process
    makes the environments of its own rows).

    - :meth:`reset` gives the opening messages (the prompt) for an example;
    - :meth:`step` takes the text of the model's finished turn and answers with an
      :class:`EnvStep`. It must not raise for anything the model wrote: a bad tool call is
      a message back to the model, counted in ``info``;
    - :meth:`close` releases what the environment holds (default: nothing).

    ``tools`` (name -> :data:`ToolFn`) are rendered into the prompt by the chat template's
    ``tools=`` argument; an environment without tools leaves it empty.
    """

    tools: Mapping[str, ToolFn] = {}

    @abc.abstractmethod
    def reset(self, example: Mapping[str, Any]) -> list[Message]: ...

    @abc.abstractmethod
    def step(self, model_turn_text: str) -> EnvStep: ...

    def close(self) -> None:
        return None


# --------------------------------------------------------------------------- task

RewardFn = Callable[..., float]
"""``fn(completion: str, example: Mapping) -> float``: one completion's reward.

In a multi-turn rollout (a task with tools or an environment) ``completion`` is the text
of the model's last turn and ``example["messages"]`` holds the whole trajectory: the
opening messages, every model turn (``assistant``) and every environment reply (``tool``,
``user``), in order."""


class TaskPlugin(_PluginBase):
    """Data, prompts and rewards for one task.

    An example is a plain dict of the task's fields (e.g. ``question``, ``answer``) plus
    whatever ground truth the rewards need. ``prompt_messages`` returns chat messages
    (``[{"role": ..., "content": ...}]``); the engine applies the tokenizer's chat
    template, or joins the contents when the tokenizer has none.
    """

    splits: ClassVar[tuple[str, ...]] = ("train", "test")

    @abc.abstractmethod
    def load(self, *, split: str, options: BaseModel, seed: int = 0) -> list[dict[str, Any]]:
        """All examples of ``split``, in a deterministic order."""

    @abc.abstractmethod
    def prompt_messages(self, example: Mapping[str, Any], *, options: BaseModel) -> list[dict[str, str]]:
        ...

    @abc.abstractmethod
    def reward_functions(self, *, options: BaseModel) -> dict[str, RewardFn]:
        """Named reward functions; names appear in metrics as ``reward/<name>/mean``."""

    def prepare_example(self, record: Mapping[str, Any], *, options: BaseModel, where: str = "row") -> dict[str, Any]:
        """Turn a raw record (a dataset row, a line of ``grpo task score`` input) into an
        example: check its fields and parse its ground truth, raising
        :class:`grpo.UserError` that names ``where`` when it can't. Default: unchanged."""
        return dict(record)

    def uses_chat_template(self, *, options: BaseModel) -> bool:
        """Whether prompts go through the tokenizer's chat template (when it has one);
        false renders the message contents alone. Default: true."""
        return True

    def chat_template_kwargs(self, *, options: BaseModel) -> dict[str, Any]:
        """Extra variables for the tokenizer's chat template (``apply_chat_template``
        keyword arguments). Default: ``{"enable_thinking": options.enable_thinking}``
        when the options have that field (Qwen3's thinking switch; templates without it
        ignore it), else nothing."""
        thinking = getattr(options, "enable_thinking", None)
        return {} if thinking is None else {"enable_thinking": bool(thinking)}

    def reward_weights(self, *, options: BaseModel) -> dict[str, float]:
        """Weight of each reward function in the total; default 1.0 each."""
        return {name: 1.0 for name in self.reward_functions(options=options)}

    def reward_turns(self, *, options: BaseModel) -> dict[str, str]:
        """Which model turns each reward scores, for turn-level credit
        (``train.advantage.credit: turn``): ``"first"`` (e.g. a reward for the tool call),
        ``"last"`` (the final answer's form) or ``"all"`` (an outcome every turn led to).
        Rewards left out credit every turn; default: all of them. Under the default
        sequence-level credit this is not used."""
        return {}

    def is_correct(self, reward_values: Mapping[str, float], *, options: BaseModel) -> bool:
        """Whether a scored completion counts as solved (for pass@k); default: every
        reward function reached its maximum of 1."""
        return all(v >= 1.0 for v in reward_values.values())

    def tools(self, *, options: BaseModel) -> dict[str, ToolFn]:
        """The tools the model may call (name -> typed, documented callable); default none.
        A task with tools and no :meth:`environment` of its own gets the built-in tool
        environment (:mod:`grpo.engine.rollout.tools`): the model's calls are parsed in its
        family's :class:`ToolCallFormat`, run, and answered with tool messages."""
        return {}

    def environment(self, example: Mapping[str, Any], *, options: BaseModel,
                    tool_format: ToolCallFormat, timeout_s: float = 10.0) -> "Environment | None":
        """The environment of one rollout row for ``example``, for a task that brings its
        own; None (the default): the engine gives a task with :meth:`tools` the built-in
        tool environment (:class:`grpo.engine.rollout.tools.ToolEnvironment`: the model's calls
        parsed in ``tool_format``, each run within ``timeout_s``, i.e.
        ``rollout.tool_timeout_s``), and a task without tools is single-turn."""
        return None


# --------------------------------------------------------------------------- model


class ModelPlugin(_PluginBase):
    """A model family: Hugging Face checkpoints of some ``model_type`` in, a Flax NNX
    causal LM out, and back to a checkpoint transformers loads.

    Which checkpoints: ``model_types`` lists the ``config.json`` ``model_type`` values the
    plugin handles; ``architectures``, when not empty, the ``architectures`` entries it
    accepts (a checkpoint listing others, e.g. ``Qwen2ForSequenceClassification``, is
    refused). ``refused_model_types`` maps model types the family knows it does *not*
    implement (``qwen3_moe``) to a sentence saying so, for the error a user sees. With
    ``model.architecture: auto`` the engine picks the plugin whose ``model_types`` hold
    the checkpoint's; a name picks that plugin and checks it handles the checkpoint.

    The family's *config* is any hashable object (a static jit argument; built-ins use
    :class:`grpo.models.decoder.DecoderConfig`) with at least ``vocab_size``,
    ``hidden_size``, ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``,
    ``tie_word_embeddings``, ``eos_token_id`` and ``family`` (this plugin's name, so a
    model can be exported without being told its family), and methods ``num_params()``,
    ``kv_bytes_per_token(dtype)``.

    Behaviour (JAX lives inside these methods, never at import):

    - :meth:`config_from_hf` — the config from transformers' config object of the
      checkpoint (``AutoConfig.from_pretrained``; a plain ``config.json`` mapping when
      transformers does not know the ``model_type``, and for presets). Raise
      :class:`grpo.UserError` for everything the implementation would get wrong
      (sliding-window layers, an unimplemented rope scaling, quantization, ...), one
      problem per line.
    - :meth:`hf_config` — the ``config.json`` dict of an export (``model_type`` and
      ``architectures`` included) that transformers loads back.
    - :meth:`param_specs` — ``dotted path -> (shape, logical axis names)`` of every
      parameter, with names from the sharding tables (``embed``, ``vocab``, ``heads``,
      ``kv_heads``, ``head_dim``, ``mlp``, ``layers``, ``norm``). The loaders place each
      parameter by these names (:data:`grpo.sharding.PARAM_RULES`), so FSDP, tp
      and memory planning need nothing else from the family.
    - :meth:`tensor_maps` — one :class:`grpo.models.hf.TensorMap` per parameter:
      its HF tensor name (``{i}`` = layer for stacked layer parameters), HF shape, and
      how HF dims split and transpose into ours. The same description loads a slice of
      a tensor straight into its shard and exports it back.
    - :meth:`build` — the unsharded module, created under ``nnx.eval_shape`` (loading)
      or ``jax.jit`` with ``out_shardings`` (random init) by the engine, with parameters
      initialised from ``rngs``. The module's parameters must be ``nnx.Param`` at the
      dotted paths of :meth:`param_specs`.

    The module is what the sampler, the update and the losses use today:

    - ``hidden, cache = model(tokens, positions, kv_mask=None, *, cache=None,
      write_index=None)`` — ``tokens``/``positions`` [B, T] int32, ``kv_mask`` [B, S]
      bool (causal by slot index); returns the final-normed hidden states [B, T, D] and
      the updated cache (see :mod:`grpo.models.decoder` for the slot semantics);
    - ``model.init_cache(batch, max_length, dtype=None)`` — a
      :class:`grpo.models.decoder.KVCache` (``k``/``v`` [layers, batch, slots,
      kv_heads, head_dim]; the sampler repeats and pads it along batch and slots);
    - ``model.head_weight()`` [D, V] (the transposed embedding when tied) and
      ``model.logits(hidden)`` float32 [B, T, V]: losses get hidden states and the head
      weight, never logits;
    - ``model.config``, ``model.dtype`` (compute dtype), ``model.param_dtype``,
      ``model.mesh`` (settable) and ``model.set_activation_rules(rules)``;
    - ``model.use_adapters(enabled) -> model`` — LoRA's adapters on or off (the
      reference pass and ``model.lora.sampler: merged`` run the base alone; a module
      without adapters ignores it).

    :class:`grpo.plugins.models.DecoderFamily` implements all of this for any family
    that is the shared decoder with a :class:`~grpo.models.decoder.DecoderConfig`
    subclass; a new family of that shape overrides ``config_class`` and the names.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    architectures: ClassVar[tuple[str, ...]] = ()
    refused_model_types: ClassVar[Mapping[str, str]] = {}
    tool_call_format: ClassVar[str] = "qwen"
    """The name of the :class:`ToolCallFormat` this family's chat models write tool calls in
    (``qwen``: ``<tool_call>{json}</tool_call>``; ``llama3``: a bare JSON object)."""

    def handles(self, model_type: str | None, architectures: Sequence[str] = ()) -> bool:
        """Whether a checkpoint with this ``model_type`` (and ``architectures``) is ours."""
        if model_type not in self.model_types:
            return False
        return not (self.architectures and architectures and not set(architectures) & set(self.architectures))

    @abc.abstractmethod
    def config_from_hf(self, hf_config: Any) -> Any: ...

    @abc.abstractmethod
    def hf_config(self, config: Any) -> dict[str, Any]: ...

    @abc.abstractmethod
    def param_specs(self, config: Any) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]: ...

    @abc.abstractmethod
    def tensor_maps(self, config: Any) -> Sequence[Any]: ...

    @abc.abstractmethod
    def build(
        self,
        config: Any,
        *,
        rngs: Any,
        param_dtype: Any = "float32",
        compute_dtype: Any = "float32",
        remat: str = "none",
        attention_impl: Any = "xla",
        mesh: Any = None,
        activation_rules: Mapping[str, Any] | None = None,
    ) -> Any: ...


# --------------------------------------------------------------------------- attention

ATTENTION_PLATFORMS: tuple[str, ...] = ("cpu", "gpu", "tpu")
AUTO_ATTENTION: dict[str, str] = {"tpu": "splash", "gpu": "pallas_gpu"}
"""platform -> the attention plugin ``model.attention: auto`` runs; other platforms: ``xla``."""


def auto_attention(platform: str) -> str:
    """The attention plugin ``auto`` means on ``platform``."""
    return AUTO_ATTENTION.get(platform, "xla")


class AttentionPlugin(_PluginBase):
    """Causal self-attention over whole sequences: the update's forward and backward, the
    reference pass and prefill (decode, one query per row against the cache, keeps the
    model's own XLA attention). Chosen by ``model.attention`` (``auto``: the engine's pick
    for the platform), options in ``model.attention_options``.

    ``platforms`` lists where the kernel compiles; a Pallas kernel may also list
    ``interpret_platforms``, where it runs in Pallas interpret mode (CPU tests: exact, slow).

    :meth:`build` returns a function with the contract of
    :data:`grpo.kernels.attention.AttentionFn` — ``out = fn(q, k, v, segment_ids, *,
    scale)``, q [B, T, H, E], k/v [B, T, K, E], segment ids [B, T] int32 (query slot i
    sees key slot j iff j <= i and their ids are equal), out [B, T, H, E] — which the
    model runs per device under ``shard_map``; or ``None``: the model's own masked XLA
    attention. It must be hashable (a frozen dataclass): it is part of the model's
    static structure. JAX is imported inside ``build``, never at module import.
    """

    platforms: ClassVar[tuple[str, ...]] = ATTENTION_PLATFORMS
    interpret_platforms: ClassVar[tuple[str, ...]] = ()

    def check(self, *, platform: str, options: BaseModel) -> list[str]:
        """Problems running on ``platform`` (``cpu``/``gpu``/``tpu``/``unknown``) with these
        options, one sentence each; the default checks ``platforms``."""
        if platform in self.platforms or platform in self.interpret_platforms or platform == "unknown":
            return []
        runs = ", ".join(self.platforms + tuple(f"{p} (interpreted)" for p in self.interpret_platforms))
        return [f"attention {self.name!r} cannot run on {platform}: it runs on {runs}"]

    @abc.abstractmethod
    def build(self, options: BaseModel, *, platform: str) -> Any: ...


# --------------------------------------------------------------------------- rollout engines


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
    - ``multi_turn``: whether the task rolls out conversations (tools or an environment).
    """

    graphdef: Any
    sampling: Any
    rollout: Any
    sampler_kwargs: Mapping[str, Any]
    detokenize: Any = None
    conversations: Any = None
    multi_turn: bool = False


class RolloutEnginePlugin(_PluginBase):
    """A rollout engine (``rollout.engine``; options in ``rollout.engine_options``): what
    turns a step's prompts and the current weights into rows.

    :meth:`build` returns the run's sampler: an object with the one rollout interface the
    trainer and the evaluator call::

        sampled = sampler.sample(params, prompt_tokens, prompt_mask, rng, examples)

    - **New weights**: ``params`` is the policy's sampler state of this step
      (``RunPrograms.sampler_state``: the rollout layout's parameters, LoRA merged or
      not); an engine with its own copy (an external server) pushes them when they
      change, i.e. once per step, before its first row.
    - **Rows with per-row keys**: ``prompt_tokens``/``prompt_mask`` [P, Lp] int32 (padded
      either side), K = ``sampling.num_generations`` rows per prompt, row ``b*K + j``.
      Row ``r`` must draw step ``t`` from ``fold_in(fold_in(rng, r), t)``
      (:func:`grpo.engine.rollout._sampling.row_keys` / ``step_keys``) or, for an external
      engine, from a seed derived from ``fold_in(rng, r)``: samples then depend on the
      row alone, never on batching or slots, and a resumed run redraws them.
    - **Tokens and both log-probs**: a :class:`grpo.engine.rollout.sampler.Sampled`
      whose ``output`` is a ``RolloutOutput`` of global arrays, rows sharded over the
      rollout's batch axes: ``tokens``/``mask`` [B, N] (the stop token included, mask 1;
      ``pad_id`` and mask 0 after it), ``lengths`` [B], ``truncated`` [B] (no stop token
      by the cap), ``logprobs`` [B, N] float32 ``log_softmax(logits / temperature)`` over
      the full vocabulary (what the trainer's loss computes, so the mismatch metrics
      measure numerics) and ``behaviour_logprobs`` [B, N] under the distribution that drew
      the token (top-k/top-p truncated and renormalised; None without a filter); ``texts``
      of this process's rows and its ``examples``.

    ``grpo plan`` also asks the sampler for its programs: ``jitted()`` (name -> jitted
    functions a run executes), ``lowerings(params, *, prompts, prompt_length, key)``
    (name -> a zero-argument lowering), ``cache_slots(prompt_length)``,
    ``cache_bytes(params, *, rows, prompt_length)`` and ``abstract_output(*, prompts,
    prompt_length)``; :class:`grpo.engine.rollout.sampler.BaseSampler` implements them
    for a JAX engine, and an engine outside JAX returns empty programs and 0 bytes.
    ``build`` imports the engine's code itself (plugins stay importable without JAX).
    """

    multi_turn: ClassVar[bool] = False  # samples multi-turn tasks (tools, environments)

    def check(self, *, multi_turn: bool, options: BaseModel) -> list[str]:
        """Problems running this engine on a task (one sentence each); the default
        refuses a multi-turn task unless :attr:`multi_turn`."""
        if multi_turn and not self.multi_turn:
            return [f"rollout.engine={self.name!r} samples single-turn tasks only; this run's task has tools or an "
                    "environment: use rollout.engine: static"]
        return []

    @abc.abstractmethod
    def build(self, context: EngineContext, options: BaseModel) -> Any: ...


PLUGIN_KINDS: dict[str, tuple[str, type[_PluginBase]]] = {
    "mesh": ("register_mesh_policies", MeshPolicy),
    "rollout": ("register_rollout_styles", RolloutStyle),
    "loss": ("register_losses", LossPlugin),
    "objective": ("register_objectives", ObjectivePlugin),
    "task": ("register_tasks", TaskPlugin),
    "model": ("register_models", ModelPlugin),
    "attention": ("register_attention", AttentionPlugin),
    "engine": ("register_rollout_engines", RolloutEnginePlugin),
}
"""kind -> (hook name, base class). The order is the order of ``grpo plugins list``."""
