"""Turning a task's example into the prompt text the model sees (task-independent)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from pydantic import BaseModel

from grpo.core.contracts import TaskPlugin

JOIN = "\n\n"
"""Separator of message contents when the tokenizer has no chat template."""


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is a Hugging Face tokenizer with a chat template set."""
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def render_messages(
    messages: Sequence[Mapping[str, str]], tokenizer: Any = None, template_kwargs: Mapping[str, Any] | None = None
) -> str:
    """Chat messages -> prompt text.

    With a chat template: ``tokenizer.apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True, **template_kwargs)`` (the template's assistant header
    ends the prompt; ``template_kwargs`` are variables the template may read, e.g.
    Qwen3's ``enable_thinking``; templates ignore the ones they do not use).
    Without one (a base model, a tiny test tokenizer, or ``tokenizer=None``): the
    message contents joined by a blank line, so a single user message ``"3+4="`` renders
    as exactly ``"3+4="``.
    """
    messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **dict(template_kwargs or {})
        )
        if not isinstance(text, str):  # pragma: no cover - defensive against API drift
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
        return text
    return JOIN.join(m["content"] for m in messages)


def render_prompt(task: TaskPlugin, options: BaseModel, example: Mapping[str, Any], tokenizer: Any = None) -> str:
    """The prompt text of one example: the task's messages through :func:`render_messages`,
    with the task's :meth:`~grpo.TaskPlugin.chat_template_kwargs`."""
    return render_messages(
        task.prompt_messages(example, options=options), tokenizer, task.chat_template_kwargs(options=options)
    )


def render_prompts(
    task: TaskPlugin, options: BaseModel, examples: Sequence[Mapping[str, Any]], tokenizer: Any = None
) -> list[str]:
    """:func:`render_prompt` for each example."""
    return [render_prompt(task, options, ex, tokenizer) for ex in examples]
