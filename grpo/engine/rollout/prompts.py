"""Prompt data: deterministic order from the seed, epochs without replacement,
per-process shards, tokenisation into left-padded length buckets.

The global order is a function of (seed, position) only — the position is the step times
the prompts per step, or with dynamic sampling the checkpointed count of prompts drawn —
so a resumed run continues exactly where it stopped and every process agrees on which prompts form a step without talking
to the others. Each process then materialises only its own slice of the step's prompts.

Rendering (task-independent): a task's example -> its chat messages -> the prompt text,
through the tokenizer's chat template when it has one (:func:`render_prompt`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from pydantic import BaseModel

from grpo.core.contracts import TaskPlugin
from grpo.core.errors import UserError

log = logging.getLogger(__name__)


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
    with the task's :meth:`~grpo.TaskPlugin.chat_template_kwargs` (and without the chat
    template when the task's :meth:`~grpo.TaskPlugin.uses_chat_template_for` the example says so)."""
    if not task.uses_chat_template_for(example, options=options):
        tokenizer = None
    return render_messages(
        task.prompt_messages(example, options=options), tokenizer, task.chat_template_kwargs(options=options)
    )


def render_prompts(
    task: TaskPlugin, options: BaseModel, examples: Sequence[Mapping[str, Any]], tokenizer: Any = None
) -> list[str]:
    """:func:`render_prompt` for each example."""
    return [render_prompt(task, options, ex, tokenizer) for ex in examples]


def default_buckets(max_len: int, smallest: int = 16) -> list[int]:
    """Powers of two from ``smallest`` below ``max_len``, then ``max_len`` itself."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass
class PromptSet:
    """Tokenised prompts of one split (every process holds the token ids: small)."""

    examples: list[dict[str, Any]]
    token_ids: list[list[int]]
    skipped_too_long: int = 0

    def __len__(self) -> int:
        return len(self.examples)


def tokenize_prompts(
    examples: Sequence[dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    tokenizer: Any,
    *,
    max_prompt_length: int,
    split: str,
) -> PromptSet:
    kept, ids, skipped = [], [], 0
    for ex in examples:
        toks = tokenizer(render(ex), add_special_tokens=False)["input_ids"]
        if len(toks) > max_prompt_length:
            skipped += 1
            continue
        if not toks:
            raise UserError(f"{split} example {ex!r:.200} renders to an empty prompt.")
        kept.append(ex)
        ids.append(list(toks))
    if not kept:
        raise UserError(
            f"No {split} prompt fits rollout.max_prompt_length={max_prompt_length} "
            f"({skipped} were longer). Raise rollout.max_prompt_length."
        )
    if skipped:
        log.warning(
            "%d of %d %s prompts are longer than rollout.max_prompt_length=%d and are skipped",
            skipped, len(examples), split, max_prompt_length,
        )
    return PromptSet(kept, ids, skipped)


def position_indices(num_examples: int, *, start: int, count: int, seed: int) -> np.ndarray:
    """Global example indices at positions ``start .. start + count`` of the data order: a
    fresh permutation per epoch, no replacement within an epoch."""
    pos = np.arange(start, start + count)
    epochs = pos // num_examples
    out = np.empty_like(pos)
    for e in np.unique(epochs):
        perm = np.random.default_rng([seed, int(e)]).permutation(num_examples)
        sel = epochs == e
        out[sel] = perm[pos[sel] % num_examples]
    return out


def step_indices(num_examples: int, *, step: int, prompts_per_step: int, seed: int) -> np.ndarray:
    """Global example indices of ``step`` when every step consumes ``prompts_per_step``
    prompts (dynamic sampling consumes more: the trainer keeps its own position)."""
    return position_indices(num_examples, start=step * prompts_per_step, count=prompts_per_step, seed=seed)


def process_slice(n: int, process_index: int, process_count: int) -> slice:
    if n % process_count:
        raise UserError(f"{n} prompts per step do not split evenly over {process_count} processes.")
    per = n // process_count
    return slice(process_index * per, (process_index + 1) * per)


@dataclasses.dataclass
class PromptBatch:
    tokens: np.ndarray  # P Lp, left-padded
    mask: np.ndarray  # P Lp, 1 on prompt tokens
    examples: list[dict[str, Any]]


def build_batch(
    prompts: PromptSet,
    indices: np.ndarray,
    *,
    local: slice,
    buckets: Sequence[int],
    pad_id: int,
    width: int | None = None,
) -> PromptBatch:
    """Left-pad this process's prompts to ``width``, by default the bucket of the longest
    prompt of the *global* batch, so every process compiles and runs the same shapes."""
    if width is None:
        width = bucket_for(max(len(prompts.token_ids[i]) for i in indices), buckets)
    mine = indices[local]
    tokens = np.full((len(mine), width), pad_id, dtype=np.int32)
    mask = np.zeros((len(mine), width), dtype=np.int32)
    for row, i in enumerate(mine):
        ids = prompts.token_ids[i]
        tokens[row, width - len(ids):] = ids
        mask[row, width - len(ids):] = 1
    return PromptBatch(tokens, mask, [prompts.examples[i] for i in mine])
