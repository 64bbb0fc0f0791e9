"""The run config's schema: one pydantic model per section, and :class:`RunConfig`.

Each section forbids unknown fields; its own validators check what lies within it.
Checks across sections and against plugins: :mod:`grpo.core.config.validate`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, field_validator, model_validator

from grpo.core.config.engine import ContinuousEngineConfig, RolloutQuantizationConfig, auto_engine
from grpo.core.config.rewards import ModelReward, unique_names
from grpo.core.config.section import Section
from grpo.core.config.training import (  # noqa: F401 (re-exported: the train sub-sections)
    AdvantageConfig,
    AsyncConfig,
    CompileConfig,
    DownSamplingConfig,
    DynamicSamplingConfig,
    PackingConfig,
)
from grpo.core.contracts.loss import LossSettings, MismatchCorrection


PRESETS = (
    "tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b",
    "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b",
    "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen3-30b-a3b", "tiny-moe",
)


class RandomModelConfig(Section):
    """A randomly initialised model of a known architecture (quickstart, benchmarks)."""

    preset: Literal[PRESETS] = Field(  # type: ignore[valid-type]
        "tiny", description="Architecture preset; `tiny` is a few-layer model for CPU."
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="HF config fields to override on the preset (e.g. num_hidden_layers: 2).",
    )
    tool_tokens: bool = Field(
        False,
        description="Give the tiny tokenizer Qwen2.5's tool tags and the lookup call as single tokens (the tools "
        "quickstart); off, those ids decode to nothing, so single-turn runs sample and score as before they existed.",
    )


LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder projections LoRA can adapt (their parameter paths are ``layers.<name>``)."""


class LoraConfig(Section):
    """Low-rank adapters (LoRA) on the decoder's projections; the base model is frozen.

    Each targeted projection ``W`` becomes ``W + (alpha / rank) * A @ B`` with ``A`` [in, rank]
    (uniform +-1/sqrt(in), PEFT's init) and ``B`` [rank, out] = 0, so step 0 is the base
    model exactly. Only ``A`` and ``B`` are trained and have optimizer state.
    """

    rank: int = Field(16, ge=1, le=65536, description="Adapter rank r (at most each targeted matrix's in and out size).")
    alpha: float = Field(32.0, gt=0.0, le=1e6, description="Scale numerator: the update is (alpha / rank) * A @ B (PEFT's lora_alpha).")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="Dropout on each adapter's input in the update (PEFT's lora_dropout): one mask per row per step, "
        "shared by every PPO epoch and the old log-probs (ratio 1 at unchanged weights); the sampler and the "
        "reference never drop, and loss.mismatch weighs by the dropout-free log-probs (one more forward a step).",
    )
    targets: list[str] = Field(
        default_factory=lambda: list(LORA_PROJECTIONS),
        min_length=1,
        description="Projections to adapt: names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), "
        "`all-linear`, or regular expressions searched in the parameter paths `layers.<name>`.",
    )
    base_quantization: Literal["none", "nf4", "int8"] = Field(
        "none",
        description="QLoRA: store the frozen base projections quantized (`nf4`: 4-bit NormalFloat, `int8`: "
        "absmax int8), in blocks of `quantization_block` along each matrix's input dimension, dequantized in "
        "the matmul. Embeddings, norms and the head stay in model.param_dtype.",
    )
    quantization_block: int = Field(64, ge=2, le=65536, description="Block size of the base quantization (QLoRA: 64).")
    sampler: Literal["adapters", "merged"] = Field(
        "adapters",
        description="How the rollout reads the policy: `adapters` runs base + adapters unmerged (no extra "
        "memory; the only choice for a quantized base); `merged` merges W + (alpha / r) A @ B once per step into "
        "a copy of the projections and decodes without adapter matmuls (`grpo bench rollout --lora-rank` "
        "measures both).",
    )

    @model_validator(mode="after")
    def _targets_match(self):
        problems = []
        if self.sampler == "merged" and self.base_quantization != "none":
            problems.append(
                f"model.lora.sampler=merged needs an unquantized base (model.lora.base_quantization="
                f"{self.base_quantization}): merging would hold the base again in full precision; use `adapters`"
            )
        for pattern in self.targets:
            if pattern in LORA_PROJECTIONS or pattern == "all-linear":
                continue
            try:
                rx = re.compile(pattern)
            except re.error as err:
                problems.append(f"model.lora.targets: {pattern!r} is not a projection name or a valid regular expression ({err})")
                continue
            if not any(rx.search(f"layers.{name}") for name in LORA_PROJECTIONS):
                problems.append(
                    f"model.lora.targets: {pattern!r} matches no projection; the parameter paths are "
                    + ", ".join(f"layers.{n}" for n in LORA_PROJECTIONS)
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def projections(self, available: tuple[str, ...] = LORA_PROJECTIONS) -> tuple[str, ...]:
        """The targeted projection names among ``available``, in decoder order."""
        chosen = set()
        for pattern in self.targets:
            if pattern == "all-linear":
                chosen.update(available)
            elif pattern in LORA_PROJECTIONS:
                chosen.add(pattern)
            else:
                rx = re.compile(pattern)
                chosen.update(n for n in available if rx.search(f"layers.{n}"))
        return tuple(n for n in available if n in chosen)


class MoeConfig(Section):
    """Mixture-of-experts models (Qwen3-MoE): the rollout's routing in the update, and the
    router's auxiliary losses (both off by default, as in RL post-training)."""

    router_replay: Literal["off", "compare", "rollout"] = Field(
        "off",
        description="`rollout`: the sampler records each completion token's routed experts per layer and the "
        "update's forward uses them instead of its own top-k (the gates still come from the router, so it learns: "
        "R3); `compare`: they are recorded and compared only (moe/routing_agreement); `off`: nothing recorded. "
        "Needs a mixture-of-experts model.",
    )
    load_balancing_loss: float = Field(
        0.0, ge=0.0, le=10.0,
        description="Coefficient of the Switch-Transformer load-balancing loss (mean over layers, over the "
        "completion tokens), added to the policy loss; 0 = off.",
    )
    router_z_loss: float = Field(
        0.0, ge=0.0, le=10.0,
        description="Coefficient of the ST-MoE router z-loss (mean over layers and completion tokens of "
        "logsumexp(router logits)^2), added to the policy loss; 0 = off.",
    )

    @property
    def records(self) -> bool:
        """The sampler records the routed experts (replay or comparison)."""
        return self.router_replay != "off"

    @property
    def active(self) -> bool:
        """Any of these options is on (they then need a mixture-of-experts model)."""
        return self.records or self.load_balancing_loss > 0 or self.router_z_loss > 0


class ModelConfig(Section):
    source: Literal["hf", "random"] = Field(
        "hf", description="`hf`: load a Hugging Face checkpoint from `path`; `random`: random weights."
    )
    path: str | None = Field(
        None, description="Local HF directory or hub id (e.g. Qwen/Qwen2.5-3B-Instruct); needed for source=hf."
    )
    architecture: str = Field(
        "auto",
        description="Model plugin (`grpo plugins list`, kind model: qwen2, qwen3, llama, ...); `auto` = the "
        "plugin for the checkpoint's config.json model_type (or the preset's).",
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer directory or hub id; defaults to `path` (source=random: a tiny local one)."
    )
    random: RandomModelConfig = Field(
        default_factory=RandomModelConfig, description="Used when source=random."
    )
    param_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Dtype parameters are stored in.")
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of matmuls; softmax and norms always run in float32."
    )
    remat: Literal["none", "full", "dots"] = Field(
        "none", description="Rematerialisation policy of each decoder layer in the update."
    )
    attention: str = Field(
        "auto",
        description="Attention kernel plugin for whole sequences (update, reference pass, prefill; `grpo plugins "
        "list`, kind attention): `xla`, `splash` (TPU), `pallas_gpu` (GPU), ...; `auto` = splash on TPU, "
        "pallas_gpu on GPU, xla on CPU. Decode always uses the model's XLA attention.",
    )
    attention_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of the chosen attention kernel (block sizes)."
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train low-rank adapters on a frozen base instead of every weight (LoRA; QLoRA with "
        "lora.base_quantization). Absent: full fine-tuning.",
    )
    moe: MoeConfig = Field(
        default_factory=MoeConfig,
        description="Mixture-of-experts options (router replay, router losses); need a mixture-of-experts model "
        "(e.g. preset tiny-moe, Qwen3-30B-A3B).",
    )

    @model_validator(mode="after")
    def _need_path(self):
        if self.source == "hf" and not self.path:
            raise ValueError("model.path is required when model.source is 'hf' (got none)")
        return self


class MeshConfig(Section):
    policy: str = Field("auto", description="Mesh policy plugin name (`grpo plugins list`).")
    options: dict[str, Any] = Field(default_factory=dict, description="Options of the chosen mesh policy.")
    expert_parallel: int = Field(
        1, ge=1, le=4096,
        description="Expert parallelism of a mixture-of-experts model: the experts split over an expert mesh "
        "axis `ep` of this size, carved out of the policy's fsdp axis (which it must divide), tokens sent to "
        "and from their experts by all-to-all; every other parameter and the batch treat `ep` as more FSDP. "
        "It must divide the model's experts. 1: no expert axis.",
    )


class DistributedConfig(Section):
    mode: Literal["none", "auto", "explicit"] = Field(
        "none",
        description="`none`: one process; `auto`: jax.distributed.initialize() detects TPU pods/SLURM; "
        "`explicit`: coordinator_address, num_processes and process_id below (or CLI flags).",
    )
    coordinator_address: str | None = Field(None, description="host:port of process 0 (mode=explicit).")
    num_processes: int | None = Field(None, ge=1, le=65536, description="Process count (mode=explicit).")
    process_id: int | None = Field(None, ge=0, le=65535, description="This process's id (mode=explicit).")
    require_process_count: int | None = Field(
        None, ge=1, le=65536, description="Fail fast on every process unless exactly this many processes run."
    )
    initialization_timeout_s: int = Field(
        300, ge=1, le=86400, description="How long to wait for all processes to join."
    )
    heartbeat_timeout_s: int = Field(
        100, ge=1, le=86400, description="A process silent this long is declared dead and the others exit."
    )
    cpu_collectives: Literal["gloo", "mpi", "none"] = Field(
        "gloo", description="Cross-process collectives on CPU backends (tests, development)."
    )

    @model_validator(mode="after")
    def _explicit(self):
        if self.mode == "explicit":
            missing = [f for f in ("coordinator_address", "num_processes", "process_id") if getattr(self, f) is None]
            if missing:
                raise ValueError(
                    "distributed.mode is 'explicit' but " + ", ".join(f"distributed.{m}" for m in missing)
                    + " is not set (set it in the file or with --set / CLI flags)"
                )
            if self.process_id >= self.num_processes:  # type: ignore[operator]
                raise ValueError(
                    f"distributed.process_id={self.process_id} must be < distributed.num_processes={self.num_processes}"
                )
        return self


class RolloutConfig(Section):
    style: str = Field("legacy", description="Rollout sharding style plugin name.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options of the chosen rollout style.")
    num_generations: int = Field(8, ge=2, le=1024, description="Completions sampled per prompt (the GRPO group).")
    max_prompt_length: int = Field(256, ge=1, le=131072, description="Longest prompt in tokens; longer prompts are skipped at load time and counted.")
    max_new_tokens: int = Field(256, ge=1, le=131072, description="Completion length cap.")
    temperature: float = Field(1.0, gt=0.0, le=100.0, description="Divides the logits (sampler and loss alike).")
    top_k: int = Field(0, ge=0, le=1_000_000, description="Keep the k most likely tokens; 0 = off.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1.0 = off.")
    prompt_buckets: list[int] = Field(
        default_factory=list,
        description="Padded prompt lengths (ascending) to bound recompilation; empty = powers of two up to max_prompt_length.",
    )
    early_stop_chunk: int = Field(
        32, ge=0, le=131072, description="Check every N tokens whether all sequences finished; 0 = never stop early."
    )
    max_turns: int = Field(
        4, ge=1, le=1024,
        description="Model turns per conversation of a multi-turn task (one with tools or an environment): "
        "the rollout stops a row after this many; single-turn tasks ignore it.",
    )
    max_turn_tokens: int | None = Field(
        None, ge=1, le=131072,
        description="Most tokens of one model turn of a multi-turn task; a turn that reaches it without a stop token "
        "ends its conversation as truncated (as the whole budget, max_new_tokens, does). None = only max_new_tokens.",
    )
    tool_timeout_s: float = Field(
        10.0, gt=0.0, le=3600.0,
        description="Wall-clock limit of one tool call; a call past it becomes a tool message saying so (counted).",
    )
    engine: str = Field(
        "static",
        description="Rollout engine plugin name (`grpo plugins list`): static (one batch, a dense KV cache per row) "
        "or continuous (rows queue for a fixed number of decode slots over a paged KV cache; multi-turn tasks "
        "too), or an installed engine's; auto = continuous with train.async.partial_rollouts or from "
        "max_new_tokens 128 on, else static (grpo.core.config.engine.auto_engine; `grpo config show` prints "
        "the engine it resolved to).",
    )
    engine_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of the chosen rollout engine plugin (the built-in ones take none: "
        "the continuous engine's are rollout.continuous)."
    )
    continuous: ContinuousEngineConfig = Field(
        default_factory=ContinuousEngineConfig, description="Options of rollout.engine: continuous."
    )
    quantization: RolloutQuantizationConfig = Field(
        default_factory=RolloutQuantizationConfig,
        description="A low-precision rollout: the sampler's weights and KV pages in int8/fp8 (see the "
        "low-precision guide).",
    )
    kv_segment: int = Field(
        256, ge=0, le=131072,
        description="Decode tokens per KV-cache growth segment: the cache holds only the slots the current segment "
        "can reach, so attention reads the live cache, not the final one; 0 = the whole cache from the start.",
    )

    @model_validator(mode="after")
    def _buckets(self):
        b = self.prompt_buckets
        if b and (any(x <= 0 for x in b) or sorted(set(b)) != b):
            raise ValueError(f"rollout.prompt_buckets must be strictly ascending positive lengths, got {b}")
        if b and b[-1] < self.max_prompt_length:
            raise ValueError(
                f"rollout.prompt_buckets' largest bucket {b[-1]} is below rollout.max_prompt_length={self.max_prompt_length}"
            )
        return self

    @model_validator(mode="after")
    def _pool(self):
        c = self.continuous
        prompt = self.prompt_buckets[-1] if self.prompt_buckets else self.max_prompt_length
        need = -(-(prompt + self.max_new_tokens) // c.page_size)
        if self.engine in ("continuous", "auto") and 0 < c.pool_pages < need:  # the built-in engine's own section
            raise ValueError(
                f"rollout.continuous.pool_pages={c.pool_pages} cannot hold one row: the longest prompt bucket ({prompt}) "
                f"+ rollout.max_new_tokens ({self.max_new_tokens}) take {need} pages of {c.page_size} tokens; "
                f"give at least {need}, or 0 (enough for every slot)"
            )
        return self


SEQUENCE_OBJECTIVES = ("gspo",)
"""Objectives with one ratio per sequence: ``loss.mismatch`` must weigh whole sequences
(``level: sequence``) under them; async fills it in so."""


class MismatchConfig(Section):
    """The sampler/trainer mismatch correction (see grpo.MismatchCorrection)."""

    level: Literal["token", "sequence"] = Field(
        "token", description="Weight per token, or per sequence from its summed log-ratio; unset, `sequence` "
        "under a sequence-level loss.objective (gspo), else `token`."
    )
    mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: weight min(w, cap); mask: drop the token/sequence when w > cap."
    )
    cap: float = Field(2.0, gt=0.0, le=1e6, description="The cap on the importance weight w (2.0 is a common choice).")


class LossConfig(Section):
    impl: str = Field("jax", description="Loss implementation plugin name (`jax`, `pallas`, ...).")
    options: dict[str, Any] = Field(default_factory=dict, description="Options of the chosen loss implementation.")
    epsilon_low: float = Field(0.2, ge=0.0, le=1.0, description="Lower clip: ratio >= 1 - epsilon_low.")
    epsilon_high: float = Field(0.2, ge=0.0, le=10.0, description="Upper clip: ratio <= 1 + epsilon_high (DAPO: 0.28).")
    beta: float = Field(0.0, ge=0.0, le=100.0, description="Weight of the k3 KL to the reference model; 0 = no reference.")
    aggregation: Literal["token_mean", "sequence_mean", "constant"] = Field(
        "token_mean", description="How per-token losses become one number (see grpo.LossSettings)."
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, le=10.0,
        description="Entropy bonus: -entropy_coef x the token entropy joins the loss (keeps exploring); 0 = off.",
    )
    objective: str = Field(
        "ppo_clip",
        description="Policy-gradient objective plugin name (`ppo_clip`, `gspo`, `cispo`, `sapo`, ...; "
        "`grpo plugins list` shows what is installed).",
    )
    objective_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of the chosen objective (sapo: tau_pos, tau_neg)."
    )
    mismatch: MismatchConfig | None = Field(
        None,
        description="Correct for the sampler and the trainer disagreeing on log-probs (importance weight "
        "exp(trainer - sampler), per token or per sequence, truncated or masked at a cap); none = off.",
    )
    mask_truncated: bool = Field(
        False,
        description="Completions that hit rollout.max_new_tokens without a stop token get no loss (they still "
        "count in their group's advantages; TRL's mask_truncated_completions).",
    )
    truncated_policy: bool = Field(
        False,
        description="With rollout.top_k/top_p: the trainer's log-probs (old, current, reference) are under the same "
        "truncation, kept set chosen from its own logits and renormalised, so the policy trained is the one that "
        "samples (importance weight ~1, not the kept mass); false = the full-vocabulary policy. No effect when the "
        "rollout does not truncate. Needs a loss that supports it (loss.impl=jax, not pallas).",
    )

    @model_validator(mode="before")
    @classmethod
    def _tis_cap_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tis_cap" in data:
            cap = data["tis_cap"]
            raise ValueError(
                f"loss.tis_cap={cap!r} was replaced by loss.mismatch: write `loss.mismatch: {{level: token, mode: "
                f"truncate, cap: {cap}}}` for the same truncated importance sampling (or delete the line if it was 0)"
            )
        return data


class OverlongConfig(Section):
    """DAPO's overlong reward shaping, for any task: a completion of L tokens longer than
    ``rollout.max_new_tokens - buffer`` earns ``min(-(L - (max_new_tokens - buffer)) / buffer
    * factor, 0)``, falling linearly to ``-factor`` at the length cap. It joins the total as
    its own reward, ``overlong`` (``reward/overlong/mean``). Training only: evaluation
    scores the task's own rewards, and pass@k correctness never sees it."""

    buffer: int = Field(
        0, ge=0, le=131072,
        description="Tokens before rollout.max_new_tokens where the penalty starts (must be < max_new_tokens); 0 = off.",
    )
    factor: float = Field(1.0, ge=0.0, le=1e6, description="The penalty at the length cap (DAPO: 1.0).")


OVERLAP_REWARD_THREADS = 2
"""``task.reward_threads: auto`` under ``reward_scoring: overlap``: calls of one reward
function at once (see the field's description)."""


class TaskConfig(Section):
    name: str = Field("gsm8k", description="Task plugin name.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options of the chosen task.")
    train_split: str = Field("train", description="Split the prompts are drawn from.")
    eval_split: str = Field("test", description="Split evaluation runs on.")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="Overlong reward shaping (DAPO).")
    model_rewards: list[ModelReward] = Field(
        default_factory=list, max_length=16,
        description="Rewards computed by models on the rollout devices, beside the task's own: reward models "
        "(kind: reward_model) and generative judges (kind: judge). Training only, like overlong.",
    )

    @field_validator("model_rewards")
    @classmethod
    def _model_rewards(cls, value: list) -> list:
        return unique_names(value)
    reward_timeout_s: float | None = Field(
        None, gt=0.0, le=86_400.0,
        description="Wall-clock limit of one reward call (a completion's, or a batched function's batch); a call past "
        "it scores 0 for its rows, counted in reward/<name>/timeouts. None: no limit. A limit (like reward_threads > 1 "
        "or reward_scoring: overlap) runs the calls on worker threads, where signal-based timeouts (math-verify's "
        "own) do not work: turn those off.",
    )
    reward_scoring: Literal["after", "overlap"] = Field(
        "after",
        description="after: a step's rows are scored once its rollout is done; overlap: each group is scored on the "
        "reward workers as soon as its rows finish, while the rest of the step decodes (an engine that streams rows, "
        "e.g. rollout.engine: continuous; single-turn). The rewards are the same either way.",
    )
    reward_threads: int | Literal["auto"] = Field(
        "auto",
        description="Calls of one reward function running at once on threads (different functions always run side "
        "by side); 1 keeps each function's calls in series, as TRL calls them. auto: 1 when rows are scored after "
        f"the rollout (on the calling thread, where signal-based code such as math-verify's default timeouts works), "
        f"{OVERLAP_REWARD_THREADS} under reward_scoring: overlap (its calls run on worker threads anyway; the number "
        "measured with grpo bench reward: docs/getting-started/your-reward-and-data.md).",
    )

    @field_validator("reward_threads", mode="before")
    @classmethod
    def _reward_threads(cls, value: Any) -> Any:
        """One message for both forms (a count or ``auto``), not one per member of the union."""
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 256):
            return value
        raise ValueError("must be auto or an integer from 1 to 256")

    @property
    def reward_workers(self) -> int:
        """``reward_threads`` resolved (``auto``: see its description)."""
        if self.reward_threads != "auto":
            return self.reward_threads
        return OVERLAP_REWARD_THREADS if self.reward_scoring == "overlap" else 1
    reward_processes: int = Field(
        0, ge=0, le=256,
        description="Calls of one reward function running at once in child processes, for the functions named in "
        "process_rewards (CPU-heavy Python, beside the decode and the interpreter lock).",
    )
    process_rewards: list[str] = Field(
        default_factory=list,
        description="Reward names (as in metrics) whose calls run in child processes (reward_processes of them); "
        "each child rebuilds the task's reward functions from its name and options.",
    )


class OptimizerConfig(Section):
    name: Literal["adamw", "lion"] = Field("adamw", description="Optimizer.")
    learning_rate: float = Field(1e-6, gt=0.0, le=1.0, description="Peak learning rate.")
    b1: float = Field(0.9, ge=0.0, lt=1.0, description="First-moment decay.")
    b2: float = Field(0.99, ge=0.0, lt=1.0, description="Second-moment decay.")
    eps: float = Field(1e-8, gt=0.0, le=1.0, description="Adam epsilon.")
    weight_decay: float = Field(0.0, ge=0.0, le=10.0, description="Decoupled weight decay.")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="Decay after warm-up.")
    warmup_steps: int = Field(0, ge=0, le=10_000_000, description="Linear warm-up steps.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Final LR as a fraction of the peak (cosine/linear).")
    max_grad_norm: float = Field(1.0, ge=0.0, le=1e6, description="Global-norm clipping; 0 = off.")
    master_weights: bool = Field(
        True,
        description="With model.param_dtype below float32: keep an f32 master copy of the parameters in the "
        "optimizer state (moments and gradient accumulation are f32 too); the parameters the model and the "
        "sampler read are the master rounded. Off, a bf16 AdamW update at lr 1e-6 mostly rounds away. "
        "No effect with float32 parameters.",
    )


class TrainConfig(Section):
    # `async` is a Python keyword: the field is `async_` in Python and `async` in YAML/JSON.
    model_config = ConfigDict(extra="forbid", validate_default=True, validate_by_name=True, serialize_by_alias=True)

    steps: int = Field(100, ge=1, le=100_000_000, description="Optimizer steps (one rollout batch each).")
    prompts_per_step: int = Field(16, ge=1, le=1_000_000, description="Prompts per step; sequences = prompts x num_generations.")
    micro_batch_size: int | None = Field(
        None, ge=1, le=1_000_000, description="Sequences per gradient-accumulation micro-batch; none = whole batch."
    )
    ppo_epochs: int = Field(1, ge=1, le=64, description="Updates per rollout batch (>1 uses old log-probs).")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds data order, sampling and initialisation.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer and schedule.")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Group advantage estimator.")
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig, description="Drop uninformative groups and refill (DAPO)."
    )
    down_sampling: DownSamplingConfig = Field(
        default_factory=DownSamplingConfig, description="Train on a subset of each group's samples (PODS)."
    )
    packing: PackingConfig = Field(
        default_factory=PackingConfig, description="Sequence packing of the passes over a finished batch."
    )
    compile: CompileConfig = Field(
        default_factory=CompileConfig, description="When the run's programs compile: ahead of step 1, or as they come."
    )
    async_: AsyncConfig = Field(
        default_factory=AsyncConfig, alias="async",
        description="Asynchronous GRPO: rollout and update on their own devices at once, with bounded staleness.",
    )
    compile: CompileConfig = Field(default_factory=CompileConfig, description="How the run compiles its programs.")


class EvalConfig(Section):
    every_n_steps: int = Field(0, ge=0, le=100_000_000, description="Evaluate every N steps; 0 = never.")
    num_examples: int | None = Field(None, ge=1, le=10_000_000, description="First N examples of the split; none = all.")
    k: int = Field(1, ge=1, le=1024, description="Samples per prompt for pass@k / mean@k.")
    greedy: bool = Field(True, description="pass@1 by greedy decoding (k must be 1) or by sampling.")
    batch_size: int = Field(64, ge=1, le=1_000_000, description="Prompts per evaluation batch.")
    at_start: bool = Field(
        True, description="With every_n_steps > 0, also evaluate before the first step (the step-0 baseline of the curve)."
    )

    @model_validator(mode="after")
    def _greedy(self):
        if self.greedy and self.k != 1:
            raise ValueError(f"eval.greedy=true needs eval.k=1 (got k={self.k}); set eval.greedy=false for pass@k")
        return self


class CheckpointConfig(Section):
    every_n_steps: int = Field(0, ge=0, le=100_000_000, description="Save every N steps; 0 = only at the end and on signals.")
    keep: int = Field(2, ge=1, le=10_000, description="How many recent checkpoints to keep.")
    on_signal: bool = Field(True, description="Save on SIGTERM/SIGINT (preemption) before exiting.")
    at_end: bool = Field(True, description="Save after the last step.")


class WandbConfig(Section):
    mode: Literal["disabled", "offline", "online"] = Field("disabled", description="W&B mode.")
    project: str = Field("grpo", min_length=1, description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user).")
    name: str | None = Field(None, description="Run name; defaults to the run directory's name.")
    tags: list[str] = Field(default_factory=list, description="Run tags.")


class LoggingConfig(Section):
    every_n_steps: int = Field(1, ge=1, le=1_000_000, description="Write metrics every N steps.")
    progress_bar: bool = Field(True, description="Show a progress bar on process 0.")
    plot: bool = Field(True, description="Write RUN_DIR/metrics.png at the end.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases.")


class RunConfig(Section):
    """A whole experiment."""

    name: str | None = Field(None, description="Run name (used for the run directory and W&B).")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(source="random"), description="Policy model.")
    mesh: MeshConfig = Field(default_factory=MeshConfig, description="Device mesh policy.")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="Multi-process start-up.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling and rollout sharding.")
    loss: LossConfig = Field(default_factory=LossConfig, description="GRPO loss.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="Task: data, prompts, rewards.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Periodic evaluation.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Orbax checkpoints.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics, progress bar, W&B.")

    @model_validator(mode="after")
    def _auto_engine(self):
        # rollout.engine: auto resolves here, so every later check, the run and `grpo config
        # show` see the engine that runs.
        if self.rollout.engine == "auto":
            self.rollout.engine = auto_engine(max_new_tokens=self.rollout.max_new_tokens,
                                              partial_rollouts=self.train.async_.enabled
                                              and self.train.async_.partial_rollouts)
        return self

    @model_validator(mode="after")
    def _async_correction(self):
        # Asynchronous GRPO trains on samples drawn by older weights: the loss must weigh
        # them by the sampler's own log-probs (decoupled PPO through loss.mismatch).
        if self.train.async_.enabled and self.train.async_.max_staleness > 0 and self.loss.mismatch is None:
            self.loss.mismatch = MismatchConfig()
        # A default fits the objective: under a sequence-level one (GSPO) an unset
        # loss.mismatch.level is `sequence`, which the check of the level would otherwise
        # refuse over a setting the user never wrote (issue 49, item 3).
        mismatch = self.loss.mismatch
        if mismatch is not None and "level" not in mismatch.model_fields_set and self.loss.objective in SEQUENCE_OBJECTIVES:
            self.loss.mismatch = mismatch.model_copy(update={"level": "sequence"})
        return self

    @property
    def group_size(self) -> int:
        """Samples of each group the update trains on: ``train.down_sampling.keep`` or
        all ``rollout.num_generations``."""
        return self.train.down_sampling.keep or self.rollout.num_generations

    @property
    def sequences_per_step(self) -> int:
        """Rows of the update: prompts x :attr:`group_size`."""
        return self.train.prompts_per_step * self.group_size

    @property
    def rollout_sequences_per_step(self) -> int:
        """Rows of one rollout: prompts x ``rollout.num_generations``."""
        return self.train.prompts_per_step * self.rollout.num_generations

    @property
    def longest_sequence(self) -> int:
        """The most real tokens one sequence can hold: ``rollout.max_prompt_length`` (prompts
        are cut to it) plus ``rollout.max_new_tokens``."""
        return self.rollout.max_prompt_length + self.rollout.max_new_tokens

    @property
    def bin_length(self) -> int:
        """``train.packing.bin_length``, or the longest possible sequence when unset."""
        return self.train.packing.bin_length or self.longest_sequence

    @property
    def micro_batch_size(self) -> int:
        return self.train.micro_batch_size or self.sequences_per_step

    @property
    def loss_settings(self) -> LossSettings:
        return LossSettings(
            epsilon_low=self.loss.epsilon_low,
            epsilon_high=self.loss.epsilon_high,
            beta=self.loss.beta,
            temperature=self.rollout.temperature,
            aggregation=self.loss.aggregation,
            max_completion_length=self.rollout.max_new_tokens,
            entropy_coef=self.loss.entropy_coef,
            objective=self.loss.objective,
            objective_options=tuple(sorted(self.loss.objective_options.items())),
            mismatch=None if self.loss.mismatch is None else MismatchCorrection(**self.loss.mismatch.model_dump()),
            **({"top_k": self.rollout.top_k, "top_p": self.rollout.top_p} if self.loss.truncated_policy else {}),
        )

    @property
    def master_weights(self) -> bool:
        """Whether the update keeps an f32 master copy (parameters stored below f32)."""
        # LoRA adapters are float32 parameters themselves and the base is frozen: no master.
        return self.train.optimizer.master_weights and self.model.param_dtype != "float32" and self.model.lora is None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def json_schema() -> dict[str, Any]:
    return RunConfig.model_json_schema()
