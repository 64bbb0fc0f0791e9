"""The plugin contracts: what a mesh policy, rollout style, loss or task must provide.

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
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # pragma: no cover
    import jax

MESH_AXES: tuple[str, str, str] = ("dp", "fsdp", "tp")


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


class RolloutStyle(_PluginBase):
    """How the rollout batch is laid over the mesh.

    ``batch_axes`` names the mesh axes the batch dimension of prompts/completions is
    sharded over; every other mesh axis replicates it.
    """

    @abc.abstractmethod
    def batch_axes(self, layout: MeshLayout, options: BaseModel) -> tuple[str, ...]: ...

    def check(self, *, layout: MeshLayout, topology: Topology, options: BaseModel) -> list[str]:
        """Problems with this layout, one sentence each (empty: fine)."""
        return []


# --------------------------------------------------------------------------- loss

Aggregation = Literal["token_mean", "sequence_mean", "constant"]


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
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    temperature: float = 1.0
    aggregation: Aggregation = "token_mean"
    entropy_coef: float = 0.0
    max_completion_length: int = 1

    def normalizer(self, mask: "jax.Array") -> "jax.Array":
        """The aggregation's denominator for the batch whose completion mask is ``mask``
        [B, T]: valid tokens (at least 1), rows, or rows * ``max_completion_length``.
        Computed once for the global batch, it makes micro-batch losses sum exactly."""
        import jax.numpy as jnp

        rows = mask.shape[0]
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
    ``advantages`` [B], ``old_logprobs`` [B, T] or None (on-policy: the ratio is
    exp(logp - stop_gradient(logp))), ``ref_logprobs`` [B, T] or None (needed iff
    ``settings.beta > 0``).

    ``normalizer`` makes gradient accumulation exact: the trainer passes the value for the
    *global* batch (valid-token count for ``token_mean``, sequence count for
    ``sequence_mean``, sequences * max length for ``constant``) so that summing the
    micro-batch losses gives the full-batch loss. None: computed from this batch.

    Returns ``(loss, metrics)``. ``metrics`` holds scalars averaged over this call's valid
    tokens — ``clip_frac/low``, ``clip_frac/high``, ``ratio/mean``, ``kl`` (0 when beta
    is 0), optionally ``entropy`` — plus ``num_tokens`` (valid-token count, to weight
    micro-batches) and ``logprobs`` [B, T] (per-token log-probs, no gradient).
    """

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
    ) -> tuple["jax.Array", dict[str, "jax.Array"]]: ...

    def check(self, *, layout: MeshLayout, options: BaseModel) -> list[str]:
        """Problems with running on this layout (e.g. tp > 1 unsupported)."""
        return []


# --------------------------------------------------------------------------- task

RewardFn = Callable[..., float]
"""``fn(completion: str, example: Mapping) -> float``: one completion's reward."""


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

    def reward_weights(self, *, options: BaseModel) -> dict[str, float]:
        """Weight of each reward function in the total; default 1.0 each."""
        return {name: 1.0 for name in self.reward_functions(options=options)}

    def is_correct(self, reward_values: Mapping[str, float], *, options: BaseModel) -> bool:
        """Whether a scored completion counts as solved (for pass@k); default: every
        reward function reached its maximum of 1."""
        return all(v >= 1.0 for v in reward_values.values())


PLUGIN_KINDS: dict[str, tuple[str, type[_PluginBase]]] = {
    "mesh": ("register_mesh_policies", MeshPolicy),
    "rollout": ("register_rollout_styles", RolloutStyle),
    "loss": ("register_losses", LossPlugin),
    "task": ("register_tasks", TaskPlugin),
}
"""kind -> (hook name, base class). The order is the order of ``grpo plugins list``."""
