"""The task contract: data, prompts, rewards, and (multi-turn) tools or an environment."""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Literal, Mapping, TypeVar

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
``user``), in order.

A function marked with :func:`batched_reward` is called once per batch instead: see there."""

BATCHES = ("step", "group")
"""What a batched reward function is handed at once: a step's rows, or one group's."""

_F = TypeVar("_F", bound=Callable[..., Any])


def reward_values(out: Any, *, field: str, expected: int) -> list[Any]:
    """What a TRL reward function returned, as a list of ``expected`` values: any iterable
    of numbers, as TRL iterates over it (a list, a tuple, a NumPy array, a tensor through
    its ``tolist()``); ``None`` and NaN stay as they are (not applicable, see
    ``grpo.engine.rollout.scoring.score_completions``). TypeError for a string, a
    mapping or a non-iterable, ValueError for a wrong length; both name ``field``."""
    if isinstance(out, (str, bytes, Mapping)) or out is None:
        raise TypeError(f"{field} returned {type(out).__name__} {out!r:.60}; expected a list with one number "
                        "per completion")
    tolist = getattr(out, "tolist", None)
    try:
        values = tolist() if callable(tolist) else list(out)
    except TypeError:
        raise TypeError(f"{field} returned {type(out).__name__} {out!r:.60}, which is not iterable; expected a "
                        "list with one number per completion") from None
    if not isinstance(values, list):  # a 0-d array's tolist() is its scalar
        raise TypeError(f"{field} returned {type(out).__name__} {out!r:.60}, a single value; expected a list with "
                        "one number per completion")
    if len(values) != expected:
        raise ValueError(f"{field} returned {len(values)} value(s) for {expected} completion(s); expected one per "
                         "completion")
    return values


def batched_reward(fn: _F | None = None, *, per: Literal["step", "group"] = "step") -> Any:
    """Mark a task's reward function as batched (TRL's convention: lists in, a list out)::

        @batched_reward                      # or @batched_reward(per="group")
        def score(completions, prompts, **columns) -> list[float | None]: ...

    It is called with keyword arguments: ``completions`` (the rows' texts, a list of
    strings), ``prompts`` (each row's chat messages, :meth:`TaskPlugin.prompt_messages`)
    and every field of the rows' examples as a list (a function without ``**kwargs`` gets
    the fields it names), and returns one number per completion (``None`` or NaN: not
    applicable). ``per="step"`` hands it every row a step scores at once (with
    ``task.reward_scoring: overlap``, the groups that finished together); ``per="group"``
    one group's rows (one prompt's samples) per call, e.g. for a rank within the group.

    A batched call that raises, times out (``task.reward_timeout_s``) or returns the wrong
    length fails every row it was handed (each scores 0, counted); a ``per="step"``
    function that raised or returned the wrong length is then called again row by row
    (lists of one), so one bad completion costs only its own row."""
    if per not in BATCHES:
        raise ValueError(f"per must be one of {BATCHES}; got {per!r}")

    def mark(f: _F) -> _F:
        if not callable(f):
            raise TypeError(f"batched_reward marks a function; got {type(f).__name__}")
        f.grpo_batch = per  # type: ignore[attr-defined]
        return f

    return mark if fn is None else mark(fn)


def reward_batch(fn: Any) -> str | None:
    """How ``fn`` is called: ``"step"`` or ``"group"`` (:func:`batched_reward`), or None
    (one completion per call: ``fn(completion, example)``)."""
    per = getattr(fn, "grpo_batch", None)
    return per if per in BATCHES else None


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
        """Named reward functions; names appear in metrics as ``reward/<name>/mean``. Each
        is per-completion (``fn(completion, example)``) or batched
        (:func:`batched_reward`)."""

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
