"""The ``train`` sub-sections: advantages, dynamic sampling, down-sampling, packing,
compilation and asynchronous GRPO (:class:`~grpo.core.config.schema.TrainConfig` holds
them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo.core.config.compile import CompileConfig  # noqa: F401 (the train.compile section)
from grpo.core.config.section import Section


class AdvantageConfig(Section):
    baseline: Literal["group_mean", "rloo"] = Field(
        "group_mean", description="`group_mean` (GRPO) or `rloo` (leave-one-out mean of the others)."
    )
    scale: Literal["group_std", "batch_std", "none"] = Field(
        "group_std",
        description="Divide by the group's reward std (GRPO), by the whole batch's (TRL scale_rewards=batch), "
        "or not at all (Dr.GRPO).",
    )
    epsilon: float = Field(1e-4, gt=0.0, le=1.0, description="Added to the std before dividing.")
    credit: Literal["sequence", "turn"] = Field(
        "sequence",
        description="`sequence`: one advantage for every token of a completion (GRPO). `turn` (multi-turn tasks; "
        "MT-GRPO): each reward's own group advantage credits only the model turns it scores (the task's "
        "reward_turns, overridden by train.advantage.reward_turns): a tool call's reward moves the call's tokens, "
        "a final answer's the answer's.",
    )
    reward_turns: dict[str, Literal["all", "first", "last"]] = Field(
        default_factory=dict,
        description="With credit: turn, which model turns a reward credits (all, first, last), by reward name; "
        "unnamed rewards keep the task's choice (all by default).",
    )


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling: an uninformative group — one whose advantages, as the update
    would train it (``train.advantage``'s credit, baseline and scale, over all its
    samples), are all zero on the tokens it trains — teaches nothing, so it is dropped, and
    the next prompts of the data order are rolled out until the step holds
    ``train.prompts_per_step`` informative groups, or ``max_rounds`` rollouts were made.
    Under sequence credit that is a group with equal total rewards; under turn credit a
    group with equal totals is informative when a scope's own advantage is not zero on the
    turns it credits. Informative groups beyond ``prompts_per_step`` are dropped too; a
    step that ends short fills its batch with uninformative groups, trained with exactly
    zero advantage whatever the credit, and logs ``dynamic_sampling/short`` = 1. The data
    position is checkpointed, so a resumed run draws the same prompts."""

    enabled: bool = Field(False, description="Drop uninformative groups (all-zero advantage under train.advantage) "
                          "and roll out more prompts in their place.")
    max_rounds: int = Field(
        4, ge=1, le=1024, description="Most rollouts of prompts_per_step prompts per step (1 = filter without refilling)."
    )


class DownSamplingConfig(Section):
    """PODS (Xu et al. 2025, "Not All Rollouts are Useful"): roll out
    ``rollout.num_generations`` samples of each prompt but train on ``keep`` of them.
    Sampling is the cheap phase and the update the costly one, so a large group finds the
    rare right answer (or the rare wrong one) that a small group misses, and the update
    pays for ``keep`` rows. ``max_variance`` keeps the subset whose rewards have the
    largest variance (the ``i`` highest and ``keep - i`` lowest rewards, for the best
    ``i``); ``random`` one sample above the group mean and one below it, the rest uniform
    (a group with a spread keeps it; without one, a uniform subset). Under turn credit a
    group with equal totals is ranked by its first scope component with a spread. The
    advantages are the group advantages of the kept rows."""

    keep: int | None = Field(
        None, ge=2, le=1024,
        description="Samples of each group the update trains on (at most rollout.num_generations); none = all.",
    )
    rule: Literal["max_variance", "random"] = Field(
        "max_variance", description="Which samples: the largest reward variance (PODS), or random: one above and "
        "one below the group mean, the rest uniform (a group keeps its spread).",
    )


class PackingConfig(Section):
    enabled: bool = Field(
        True,
        description="Pack each step's finished sequences (prompt + completion, padding dropped) into bins of "
        "bin_length tokens for every pass over the batch (update, old-log-prob, reference, behaviour). Needs a loss "
        "declaring supports_packing (both built-ins do); another runs unpacked with a warning.",
    )
    bin_length: int | None = Field(
        None, ge=1, le=10_000_000,
        description="Tokens per bin; none = the longest possible sequence (rollout.max_prompt_length + "
        "rollout.max_new_tokens). Must be at least that: a sequence is never split.",
    )
    bins_per_device: Literal["auto", "exact", "pow2", "widest"] = Field(
        "auto",
        description="The bins a device may hold per micro-batch, each one compiled shape of every packed pass: exact "
        "(every width up to what the configured micro-batch holds: no padding bin, a compile per width), pow2 "
        "(powers of two and the most), widest (the most only: one compiled layout, a step computes up to that many "
        "bins a device minus one beyond its need). auto = widest on CPU, pow2 elsewhere.",
    )
    head_buckets: int | None = Field(
        None, ge=1, le=64,
        description="Head widths per bins-per-device width: a step's loss head runs on its predicting slots rounded "
        "up to a multiple of 1/head_buckets of a device's bin slots (one compiled shape each). None = 1 on CPU, "
        "4 elsewhere.",
    )


class AsyncConfig(Section):
    """Asynchronous GRPO (``train.async``): the rollout and the update run at once on their own devices."""

    enabled: bool = Field(
        False,
        description="Split the devices into a rollout mesh and an update mesh and run them at once: the rollout "
        "draws the groups of the next steps while the update trains on this one.",
    )
    max_staleness: int = Field(
        1, ge=0, le=64,
        description="How many optimizer steps a sample's policy may lag the policy that trains on it; 0 = on-policy "
        "(equal to the synchronous run). Staler samples are refused and counted. Above 0 the loss corrects with the "
        "sampler's own log-probs (decoupled PPO): loss.mismatch, defaulted to {level: token, mode: truncate, cap: 2} "
        "when unset (an unset level is sequence under loss.objective: gspo, which weighs whole sequences).",
    )
    rollout_devices: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Devices of the rollout mesh (the first ones; whole hosts when several hosts); the rest form the "
        "update mesh. None = half of the devices (half of the processes when several).",
    )
    partial_rollouts: bool = Field(
        False,
        description="Partial rollouts (rollout.engine: continuous, single-turn): one continuous stream lives across "
        "optimizer steps, rows in flight at a weight change go on under the new weights, and each token records the "
        "policy version that drew it. A step trains the first prompts_per_step groups to finish; a row is as stale "
        "as its oldest token. Rows cross a weight change from max_staleness 2 (at 1 the stream drains each batch; "
        "at 0 it equals the synchronous continuous run).",
    )
    on_weight_change: Literal["continue", "reprefill"] = Field(
        "continue",
        description="With partial_rollouts, what a row in flight does at a weight change: continue over the KV cache "
        "the old weights wrote (its later tokens come from neither policy exactly), or reprefill: its prompt and "
        "tokens so far run through the new weights again before its next token (costs a prefill per row).",
    )


__all__ = [
    "AdvantageConfig", "AsyncConfig", "CompileConfig", "DownSamplingConfig", "DynamicSamplingConfig", "PackingConfig",
]
