"""The task contract: data, prompts, rewards, and (multi-turn) tools or an environment."""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Mapping

from pydantic import BaseModel

from grpo.core.contracts.base import _PluginBase
from grpo.core.contracts.tools import Environment, ToolCallFormat, ToolFn

RewardFn = Callable[..., float]
"""``fn(completion: str, example: Mapping) -> float``: one completion's reward; ``None`` or
NaN means "not applicable" (0 in the total, counted in ``reward/<name>/not_applicable``),
and a function that raises or returns anything else (a string, an infinity) scores 0
there, counted as an error.

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

    def uses_chat_template_for(self, example: Mapping[str, Any], *, options: BaseModel) -> bool:
        """Whether ``example``'s prompt goes through the chat template: for a task whose
        rule depends on the prompt (the ``custom`` task's ``auto``: conversational prompts
        templated, plain text verbatim). Default: :meth:`uses_chat_template`."""
        return self.uses_chat_template(options=options)

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
