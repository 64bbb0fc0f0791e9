"""``task.model_rewards``: rewards computed by models on the rollout devices.

Two kinds, told apart by ``kind``:

- ``reward_model``: a Hugging Face sequence-classification checkpoint (the decoder of a
  built-in family and a score head), loaded into grpo's own model code;
- ``judge``: a generative model (the policy's initial weights or another checkpoint)
  prompted with a template through a rollout engine, its answer parsed to a number by a
  named parser (:mod:`grpo.core.judges`).

Each joins the task's own rewards under its ``name`` (``reward/<name>/mean``) with its
``weight`` in the total. The sections are checked here; the scorers are built by
:mod:`grpo.engine.rollout.model_rewards`.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from grpo.core.config.section import Section

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
RESERVED = ("total", "overlong")
"""Reward names the engine logs itself."""


def _fields(template: str) -> set[str]:
    """The ``{field}`` names of a format string; ValueError for one Python cannot format."""
    try:
        return {f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(template) if f}
    except ValueError as err:
        raise ValueError(f"is not a valid template ({err}); write literal braces as {{{{ and }}}}") from None


def checkpoint_problem(path: str) -> str | None:
    """Why ``path`` cannot be a checkpoint (None: a directory, or a hub id to fetch)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return None
    if p.exists():
        return f"{path!r} is a file; expected a Hugging Face model directory or hub id"
    if _HUB_ID.match(path) and not path.startswith((".", "/", "~")):
        return None
    return f"no directory {path!r} (and it does not look like a hub id such as org/name)"


def architectures(path: str) -> list[str] | None:
    """The ``architectures`` of a local checkpoint's ``config.json`` (None: not a local
    directory with a readable one; the loader says why later)."""
    import json

    file = Path(path).expanduser() / "config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return [str(a) for a in raw.get("architectures") or []] if isinstance(raw, dict) else None


class _ModelReward(Section):
    name: str = Field(..., min_length=1, max_length=64,
                      description="The reward's name in metrics (reward/<name>/mean); unique among the run's rewards.")
    weight: float = Field(1.0, ge=-1e6, le=1e6, description="Its weight in the total reward.")
    micro_batch: int = Field(8, ge=1, le=65536, description="Rows scored per forward pass (per process).")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"{value!r} is not a metrics name: use letters, digits, '_', '.', '-'")
        if value in RESERVED:
            raise ValueError(f"{value!r} is reserved for the engine's own reward ({', '.join(RESERVED)})")
        return value


class RewardModelConfig(_ModelReward):
    """A sequence-classification checkpoint scoring ``template(prompt, completion)``: the
    score of label ``label`` at the last non-pad token, standardised with ``mean`` and
    ``std`` and optionally squashed (``normalize``)."""

    kind: Literal["reward_model"] = Field(..., description="reward_model: a sequence-classification checkpoint.")
    checkpoint: str = Field(..., min_length=1,
                            description="A *ForSequenceClassification checkpoint: a local directory or hub id.")
    tokenizer: str | None = Field(None, description="Its tokenizer (directory or hub id); none = the checkpoint's.")
    dtype: Literal["float32", "bfloat16"] = Field("bfloat16", description="Parameter and compute dtype.")
    max_length: int = Field(1024, ge=2, le=1_048_576,
                            description="Tokens per scored row; longer rows keep their last max_length tokens.")
    template: str = Field(
        "chat",
        description="chat: the prompt's messages and the completion as the assistant's reply, through the reward "
        "model tokenizer's chat template (the prompt text then the completion without one); or a format string "
        "with {prompt} and {completion} (and any dataset column by name).",
    )
    label: int = Field(0, ge=0, le=65535, description="Which output of the score head is the reward.")
    mean: float = Field(0.0, ge=-1e9, le=1e9, description="Subtracted from the score (a fixed standardisation).")
    std: float = Field(1.0, gt=0.0, le=1e9, description="The score is divided by it after subtracting mean.")
    normalize: Literal["none", "sigmoid", "tanh"] = Field(
        "none", description="Squash the standardised score: none, sigmoid (0..1) or tanh (-1..1)."
    )

    @field_validator("checkpoint", "tokenizer")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        problem = None if value is None else checkpoint_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("checkpoint")
    @classmethod
    def _classifier(cls, value: str) -> str:
        archs = architectures(value)
        if archs and not all(a.endswith("ForSequenceClassification") for a in archs):
            raise ValueError(f"{value!r} is a {', '.join(archs)} checkpoint; a reward model is a sequence-"
                             "classification checkpoint (e.g. Qwen2ForSequenceClassification)")
        return value

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        if value != "chat" and "completion" not in _fields(value):
            raise ValueError("a template must place {completion} (or be 'chat')")
        return value


class JudgeConfig(_ModelReward):
    """A generative judge: ``template`` (with ``{prompt}``, ``{completion}`` and the
    dataset's columns) sent as a user message to ``model``, its reply parsed by ``parser``."""

    kind: Literal["judge"] = Field(..., description="judge: a generative model prompted with a template.")
    model: str = Field(
        "policy", min_length=1,
        description="policy: a frozen copy of the policy's initial weights (model section); or a causal-LM "
        "checkpoint directory or hub id.",
    )
    tokenizer: str | None = Field(None, description="The judge checkpoint's tokenizer; none = its own (policy: model's).")
    template: str = Field(..., min_length=1,
                          description="The judge's prompt: a format string with {completion}, and {prompt} or any "
                          "dataset column by name.")
    chat_template: bool = Field(True, description="Send the template as one user message through the judge "
                                "tokenizer's chat template (when it has one); false = the text as is.")
    parser: str = Field(
        "number", min_length=1,
        description="How the reply becomes a score: number, yes_no, score_0_10 (grpo.core.judges), or a "
        "function by import path 'module:function' (text -> float | None).",
    )
    greedy: bool = Field(True, description="Greedy decoding; false samples at temperature.")
    temperature: float = Field(1.0, gt=0.0, le=100.0, description="Sampling temperature when greedy is false.")
    max_new_tokens: int = Field(16, ge=1, le=131072, description="Tokens the judge may reply with.")
    max_prompt_length: int = Field(
        512, ge=8, le=1_048_576,
        description="Tokens of the judge's prompt; a longer one keeps its last max_prompt_length tokens.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds a sampling judge (with the step and the row).")

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        if "completion" not in _fields(value):
            raise ValueError("a judge's template must place {completion}, the text it judges")
        return value

    @field_validator("model", "tokenizer")
    @classmethod
    def _model(cls, value: str | None) -> str | None:
        problem = None if value in (None, "policy") else checkpoint_problem(value)
        if problem:
            raise ValueError(problem)
        archs = None if value in (None, "policy") else architectures(value)
        if archs and any(a.endswith("ForSequenceClassification") for a in archs):
            raise ValueError(f"{value!r} is a {', '.join(archs)} checkpoint; a judge generates its reply: give a "
                             "causal-LM checkpoint (or a reward model as kind: reward_model)")
        return value

    @field_validator("parser")
    @classmethod
    def _parser(cls, value: str) -> str:
        from grpo.core.judges import check_parser

        check_parser(value)
        return value

    @model_validator(mode="after")
    def _tokenizer(self) -> "JudgeConfig":
        if self.model == "policy" and self.tokenizer is not None:
            raise ValueError("tokenizer: model=policy uses the policy's tokenizer (model.tokenizer); unset it")
        return self


ModelReward = Annotated[Union[RewardModelConfig, JudgeConfig], Field(discriminator="kind")]


def unique_names(value: list) -> list:
    """``task.model_rewards`` with distinct names (ValueError naming the repeated one)."""
    seen: set[str] = set()
    for i, r in enumerate(value):
        if r.name in seen:
            raise ValueError(f"[{i}].name {r.name!r} is used twice; each model reward needs its own name")
        seen.add(r.name)
    return value


__all__ = ["JudgeConfig", "ModelReward", "RewardModelConfig", "checkpoint_problem", "unique_names"]
