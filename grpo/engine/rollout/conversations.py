"""The multi-turn side of a run: a task's environments and the chat template with tools.

A task is multi-turn when its :meth:`~grpo.TaskPlugin.environment` gives an environment
(a task with tools gets the built-in :class:`~grpo.engine.rollout.tools.ToolEnvironment`); then
:class:`Conversations` makes one environment per rollout row, renders prompts as the
environment's opening messages with its tools' schemas in the template's ``tools=``, and
hands the rollout (:class:`~grpo.engine.rollout.multiturn.MultiTurnSampler`, which makes
each row's environment through it) the render function it builds every reply's tokens
with. Single-turn tasks never construct one: their
path and programs are unchanged.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

from grpo.core.contracts import Environment, TaskPlugin
from grpo.core.errors import UserError


class Conversations:
    """Environments and rendering of a multi-turn task (see the module docstring).

    ``tool_format``: the model family's :class:`~grpo.ToolCallFormat` name
    (``ModelPlugin.tool_call_format``); ``timeout_s``: ``rollout.tool_timeout_s``."""

    def __init__(self, task: TaskPlugin, options: Any, tokenizer: Any, *, tool_format: str, timeout_s: float):
        from grpo.engine.rollout.tools import tool_call_format

        self.task = task
        self.options = options
        self.tokenizer = tokenizer
        self.format = tool_call_format(tool_format)
        self.timeout_s = float(timeout_s)
        self.template_kwargs = dict(task.chat_template_kwargs(options=options))

    @classmethod
    def of(cls, task: TaskPlugin, options: Any, tokenizer: Any, example: Mapping[str, Any], *, tool_format: str,
           timeout_s: float) -> "Conversations | None":
        """The conversations of a task whose ``example`` has an environment; None for a
        single-turn task. A multi-turn task needs the tokenizer's chat template (its
        replies are rendered by it): without one it is a :class:`grpo.UserError`."""
        from grpo.engine.rollout.prompts import has_chat_template

        if type(task).environment is TaskPlugin.environment and not task.tools(options=options):
            return None  # the default environment() of a task without tools: single-turn
        conv = cls(task, options, tokenizer, tool_format=tool_format, timeout_s=timeout_s)
        env = conv.environment(example)
        if env is None:
            return None
        env.close()
        if not (task.uses_chat_template(options=options) and has_chat_template(tokenizer)):
            raise UserError(
                f"task {task.name!r} is multi-turn (it has tools or an environment), which needs the tokenizer's "
                "chat template to render the model's turns and the replies; this run has none (a tokenizer "
                "without a chat template, or a task whose uses_chat_template() is false)."
            )
        return conv

    def environment(self, example: Mapping[str, Any]) -> Environment | None:
        """The task's own environment for ``example``, or for a task with tools and none of
        its own the built-in tool environment; None: single-turn."""
        from grpo.engine.rollout.tools import task_environment

        return task_environment(self.task, example, options=self.options, tool_format=self.format,
                                timeout_s=self.timeout_s)

    def environments(self, examples: Sequence[Mapping[str, Any]]) -> tuple[list[Environment], list[list[dict]]]:
        """One environment per row and the opening messages its ``reset`` gave."""
        envs, openings = [], []
        for ex in examples:
            env = self.environment(ex)
            if env is None:
                raise ValueError(f"task {self.task.name!r} gave no environment for {dict(ex)!r:.200}")
            envs.append(env)
            openings.append([dict(m) for m in env.reset(ex)])
        return envs, openings

    def schemas(self, tools: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        """The tools' JSON schemas (each function's is parsed once:
        :func:`~grpo.engine.rollout.tools.tool_schemas` caches them per function object)."""
        if not tools:
            return None
        from grpo.engine.rollout.tools import tool_schemas

        return tool_schemas(tools, where=f"task {self.task.name!r} tools")

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Mapping[str, Any], add_generation_prompt: bool) -> str:
        """A conversation through the chat template, the tools in its ``tools=``."""
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tools=self.schemas(tools), tokenize=False,
            add_generation_prompt=add_generation_prompt, **self.template_kwargs,
        )

    def memo_render(self) -> Callable[[Sequence[Mapping[str, Any]], Mapping[str, Any], bool], str]:
        """:meth:`render` with a memo, for one rollout: the samples of a prompt open with the
        same messages, and often write the same turns and get the same replies, so most rows
        render a conversation another row has rendered (the template costs ~0.2 ms a row)."""
        memo: dict[tuple, str] = {}

        def render(messages: Sequence[Mapping[str, Any]], tools: Mapping[str, Any], add_generation_prompt: bool) -> str:
            key = (json.dumps(list(messages), sort_keys=True, default=repr),
                   tuple((name, id(fn)) for name, fn in tools.items()), bool(add_generation_prompt))
            text = memo.get(key)
            if text is None:
                text = memo[key] = self.render(messages, tools, add_generation_prompt)
            return text

        return render

    def prompt(self, example: Mapping[str, Any]) -> str:
        """The prompt text of ``example``: its environment's opening messages rendered."""
        env = self.environment(example)
        try:
            return self.render(env.reset(example), env.tools, True)
        finally:
            env.close()

    def turn_stop_ids(self) -> tuple[int, ...]:
        """The token that ends a tool call (the format's ``call_end``), when the tokenizer
        has it as one token: a turn then stops there rather than at the end of the
        sequence. Empty otherwise (turns end at a stop token)."""
        end = self.format.call_end
        if not end:
            return ()
        ids = self.tokenizer(end, add_special_tokens=False)["input_ids"]
        stops = {int(ids[0])} if len(ids) == 1 else set()
        # An added token that ends with it ends a call too (a tokenizer that holds a call's
        # closing text as one token, as the tiny one does for the lookup call).
        stops |= {int(i) for text, i in self.tokenizer.get_added_vocab().items() if text.endswith(end)}
        return tuple(sorted(stops))


__all__ = ["Conversations"]
