"""GSM8K: grade-school math word problems with a numeric answer.

Data
    ``datasets.load_dataset("openai/gsm8k", "main")`` by default, or local jsonl/json/
    parquet/csv files through ``data_files`` (offline). Each row has ``question`` and
    ``answer``; the ground truth is the number on the answer's last ``#### N`` line, read
    by :func:`grpo.plugins.tasks._numbers.parse_number` (thousands separators,
    negatives, decimals, ``$``). A row whose answer holds just a number is accepted too.
    An unreadable ground truth is an error naming the split, the row and the text —
    or, with ``skip_unparseable``, the row is skipped and counted.

Answer formats
    ``tag`` (default): reasoning, then ``<answer>N</answer>`` (tag name configurable).
    ``hashes``: reasoning, then a last line ``#### N`` (GSM8K's own convention).

Rewards (each in [0, 1]; weights configurable)
    ``correct``: 1 when the extracted answer equals the ground truth by value.
      ``strict`` extraction reads the number inside the required format — the last
      ``<answer>...</answer>`` block, or the rest of the line after the last ``####`` —
      and only when that holds exactly one number (``<answer>$18 per day</answer>`` is
      18; ``<answer>3 + 4 = 7</answer>`` is no answer). ``flexible`` takes the last
      number anywhere in the completion. Strict rewards only answers a parser can trust;
      flexible measures whether the model got there at all. Comparing the two shows
      how much is lost to formatting.
    ``format``: 1 when the completion is exactly "reasoning, then one answer in the
      required format, then nothing": non-blank text before one ``<answer>`` block that
      holds one number and is followed only by whitespace (``hashes``: one ``####`` at
      the start of the last non-blank line, followed by one number).
    ``tags``: partial credit for the answer markup alone (0.25 per property), a dense
      shaping signal: ``tag`` — one opening tag, one closing tag, in that order, the
      completion ends with a closing tag; ``hashes`` — one ``####`` (0.5), on the last non-blank line
      (0.5). Weight 0 by default: logged, not trained on.

Tools
    ``tools: [calculator]`` gives the model built-in tools (:mod:`grpo.plugins.tools`):
    the rollout becomes multi-turn, the model's calls are run and answered, and the
    rewards read the model's last turn. An unknown name is a config error listing the
    built-in tools.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar, Iterable, Literal, Mapping

from pydantic import BaseModel, Field, field_validator

from grpo.core.contracts import PluginOptions, RewardFn, TaskPlugin
from grpo.core.errors import UserError
from grpo.plugins.tasks._common import (
    UnparseableAnswer,
    coerce_options,
    merge_weights,
    open_split,
    require_text,
    shorten,
)
from grpo.plugins.tasks import _verify as verify
from grpo.plugins.tasks._numbers import NumberToken, canonical, last_number, only_number, parse_number

log = logging.getLogger("grpo.tasks.gsm8k")

DEFAULT_WEIGHTS: dict[str, float] = {"correct": 1.0, "format": 0.2, "tags": 0.0}

_TAG_RE = r"^[A-Za-z][A-Za-z0-9_.-]*$"


class GSM8KOptions(PluginOptions):
    dataset: str = Field("openai/gsm8k", min_length=1, description="Hub dataset id (used when data_files is unset).")
    config_name: str | None = Field("main", description="Hub dataset config name.")
    data_files: dict[str, str | list[str]] | None = Field(
        None,
        description="Local files per split for offline use, e.g. {train: data/train.jsonl, test: data/test.jsonl} "
        "(.jsonl/.json/.parquet/.csv); overrides `dataset`.",
    )
    system_prompt: str | None = Field(
        None,
        description="System message; none = a built-in one that asks for the chosen answer format; "
        "empty = no system message.",
    )
    answer_format: Literal["tag", "hashes"] = Field(
        "tag", description="`tag`: reasoning then <answer>N</answer>; `hashes`: reasoning then a last line '#### N'."
    )
    answer_tag: str = Field("answer", pattern=_TAG_RE, description="Tag name for answer_format=tag.")
    correct_mode: Literal["strict", "flexible"] = Field(
        "strict",
        description="`strict`: the number inside the required answer format; `flexible`: the last number in the completion.",
    )
    answer_check: Literal["strict", "math_verify"] = Field(
        "strict",
        description="`strict`: the extracted number equals the ground truth by value; `math_verify`: that, or "
        "Hugging Face's math-verify finds the answer's text (the answer block's or the '####' line's; flexible: "
        "the completion's) equal to it, so 1/2 = 0.5 = \\frac{1}{2} (pip install 'grpo-jax[math]').",
    )
    reward_weights: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_WEIGHTS),
        description="Weight of each reward in the total (correct, format, tags); unnamed ones keep their defaults.",
    )
    skip_unparseable: bool = Field(
        False, description="Skip (and count) rows whose ground truth cannot be read, instead of failing."
    )
    max_examples: int | None = Field(None, ge=1, le=100_000_000, description="Keep the first N examples of a split.")
    tools: list[str] = Field(
        default_factory=list,
        description="Built-in tools the model may call (e.g. [calculator]); the rollout becomes multi-turn. "
        "Empty = single-turn.",
    )
    enable_thinking: bool = Field(
        False,
        description="Chat-template thinking switch (Qwen3): false renders the prompt with an empty "
        "<think></think> block so the model answers directly; true lets it think first. Templates without the "
        "switch (Qwen2.5, Llama 3) ignore it.",
    )

    @field_validator("reward_weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        return merge_weights(value, DEFAULT_WEIGHTS)

    @field_validator("answer_check")
    @classmethod
    def _check(cls, value: str) -> str:
        if value == "math_verify" and not verify.available():
            raise ValueError(f"math_verify needs Hugging Face's math-verify, which is not installed: {verify.INSTALL}")
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[str]) -> list[str]:
        from grpo.plugins.tools import BUILTIN_TOOLS

        unknown = [name for name in value if name not in BUILTIN_TOOLS]
        if unknown:
            raise ValueError(
                f"unknown tool(s) {', '.join(map(repr, unknown))}; the built-in tools are: {', '.join(sorted(BUILTIN_TOOLS))}"
            )
        if len(set(value)) != len(value):
            raise ValueError(f"a tool is listed twice: {value}")
        return value

    @field_validator("data_files")
    @classmethod
    def _files(cls, value: dict[str, str | list[str]] | None) -> dict[str, str | list[str]] | None:
        if value is not None:
            if not value:
                raise ValueError("data_files is empty; give at least one split, e.g. {test: test.jsonl}")
            for split, paths in value.items():
                if isinstance(paths, list) and not paths:
                    raise ValueError(f"data_files[{split!r}] is an empty list")
        return value


# --------------------------------------------------------------------------- ground truth


def parse_ground_truth(answer: str) -> str:
    """The canonical ground truth (e.g. ``"-1234"``) of a GSM8K ``answer`` text.

    Reads the rest of the line after the last ``####``; an answer without ``####``
    must be just a number. Raises :class:`UnparseableAnswer` (message without location).
    """
    if "####" in answer:
        line = answer.rsplit("####", 1)[1].split("\n", 1)[0]
        value = parse_number(line)
        if value is None:
            raise UnparseableAnswer(f"cannot read a number from the answer's '####' line: {('####' + line).strip()!r}")
    else:
        value = parse_number(answer)
        if value is None:
            raise UnparseableAnswer(f"the answer has no '#### N' line and is not a number: {shorten(answer)!r}")
    return canonical(value)


def _ground_truth(example: Mapping[str, Any]):
    if "ground_truth" in example:
        gt = parse_number(str(example["ground_truth"]))
        if gt is None:
            raise ValueError(f"ground_truth {example['ground_truth']!r} is not a number")
        return gt
    return parse_number(parse_ground_truth(str(example["answer"])))


# --------------------------------------------------------------------------- extraction


def last_tag_content(completion: str, tag: str) -> str | None:
    """The text of the last complete ``<tag>...</tag>`` block (None when there is none).

    The block ends at the last closing tag and starts at the last opening tag before it,
    so ``<answer>1<answer>2</answer>`` holds ``2``. Linear in the completion's length."""
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    end = completion.rfind(close_t)
    if end < 0:
        return None
    start = completion.rfind(open_t, 0, end)
    if start < 0:
        return None
    return completion[start + len(open_t) : end]


def extract_answer(
    completion: str, *, mode: str = "strict", answer_format: str = "tag", tag: str = "answer"
) -> NumberToken | None:
    """The answer a completion states, or None (see the module docstring for the rules)."""
    if mode == "flexible":
        return last_number(completion)
    if mode != "strict":
        raise ValueError(f"unknown extraction mode {mode!r}")
    if answer_format == "tag":
        content = last_tag_content(completion, tag)
        return None if content is None else only_number(content)
    if answer_format == "hashes":
        if "####" not in completion:
            return None
        return only_number(completion.rsplit("####", 1)[1].split("\n", 1)[0])
    raise ValueError(f"unknown answer format {answer_format!r}")


def answer_text(completion: str, *, mode: str = "strict", answer_format: str = "tag", tag: str = "answer"
                ) -> str | None:
    """The text that states the answer: the last answer block's (``tag``) or the rest of
    the last ``####`` line (``hashes``); ``flexible``: the whole completion."""
    if mode == "flexible":
        return completion
    if answer_format == "tag":
        return last_tag_content(completion, tag)
    return completion.rsplit("####", 1)[1].split("\n", 1)[0] if "####" in completion else None


def answer_checks(completion: str, example: Mapping[str, Any], *, mode: str = "strict", answer_format: str = "tag",
                  tag: str = "answer", math_verify: bool = True) -> dict[str, bool]:
    """Whether the completion's answer is right by each check: ``strict`` (the extracted
    number equals the ground truth by value) and, with ``math_verify``, math-verify's
    (the answer's text equal to the ground truth; in ``flexible`` mode the completion's
    last expression)."""
    truth = _ground_truth(example)
    found = extract_answer(completion, mode=mode, answer_format=answer_format, tag=tag)
    out = {"strict": found is not None and found.value is not None and found.value == truth}
    if math_verify:
        text = answer_text(completion, mode=mode, answer_format=answer_format, tag=tag)
        out["math_verify"] = text is not None and (
            verify.equivalent_text(canonical(truth), text) if mode == "flexible" else verify.equivalent(canonical(truth), text))
    return out


def format_ok(completion: str, *, answer_format: str = "tag", tag: str = "answer") -> bool:
    """Reasoning, then exactly one answer in the required format, then nothing."""
    if answer_format == "tag":
        open_t, close_t = f"<{tag}>", f"</{tag}>"
        if completion.count(open_t) != 1 or completion.count(close_t) != 1:
            return False
        before, rest = completion.split(open_t, 1)
        if close_t not in rest:
            return False
        content, after = rest.split(close_t, 1)
        return bool(before.strip()) and not after.strip() and only_number(content) is not None
    if answer_format == "hashes":
        if completion.count("####") != 1:
            return False
        before, after = completion.split("####", 1)
        own_line = before.rstrip(" \t").endswith("\n")
        return (
            own_line and bool(before.strip()) and "\n" not in after.strip() and only_number(after) is not None
        )
    raise ValueError(f"unknown answer format {answer_format!r}")


def tag_score(completion: str, *, answer_format: str = "tag", tag: str = "answer") -> float:
    """Partial credit for the answer markup (see the module docstring)."""
    if answer_format == "tag":
        open_t, close_t = f"<{tag}>", f"</{tag}>"
        one_open = completion.count(open_t) == 1
        one_close = completion.count(close_t) == 1
        ordered = one_open and one_close and completion.index(open_t) < completion.index(close_t)
        clean_end = completion.rstrip().endswith(close_t)
        return 0.25 * (one_open + one_close + ordered + clean_end)
    if answer_format == "hashes":
        n = completion.count("####")
        lines = [ln for ln in completion.splitlines() if ln.strip()]
        last = bool(lines) and "####" in lines[-1]
        return 0.5 * (n == 1) + 0.5 * (n >= 1 and last)
    raise ValueError(f"unknown answer format {answer_format!r}")


# --------------------------------------------------------------------------- the task

_SYSTEM_PROMPTS = {
    "tag": (
        "You are a helpful assistant that solves math word problems. Reason step by step, "
        "then give the final answer as a single number inside <{tag}></{tag}> tags, "
        "for example <{tag}>42</{tag}>."
    ),
    "hashes": (
        "You are a helpful assistant that solves math word problems. Reason step by step, "
        "then write the final answer as a single number on a last line that starts with '####', "
        "for example '#### 42'."
    ),
}


def _options(options: Any) -> GSM8KOptions:
    return coerce_options(GSM8KOptions, options)


@dataclasses.dataclass(frozen=True)
class LoadStats:
    """What loading one split did: rows read, examples kept, rows skipped (and why)."""

    split: str
    rows_read: int
    kept: int
    skipped: int
    skipped_examples: tuple[str, ...] = ()


class GSM8KTask(TaskPlugin):
    name: ClassVar[str] = "gsm8k"
    description: ClassVar[str] = "GSM8K math word problems: numeric answers, strict/flexible correctness, format rewards."
    Options: ClassVar[type[BaseModel]] = GSM8KOptions

    # ---- data

    def prepare_example(self, record: Mapping[str, Any], *, options: BaseModel, where: str = "row") -> dict[str, Any]:
        """An example from a raw row (``question`` + ``answer``); UserError naming ``where``."""
        question = require_text(record, "question", where)
        answer = record.get("answer") if isinstance(record, Mapping) else None
        if isinstance(answer, int) and not isinstance(answer, bool):
            answer = str(answer)
        else:
            answer = require_text(record, "answer", where)
        try:
            gt = parse_ground_truth(answer)
        except UnparseableAnswer as err:
            raise UnparseableAnswer(f"{where}: {err}") from None
        return {"question": question, "answer": answer, "ground_truth": gt}

    def _open(self, split: str, options: GSM8KOptions):
        return open_split(
            split, dataset=options.dataset, config_name=options.config_name, data_files=options.data_files,
            task="gsm8k", example_files="{train: gsm8k/train.jsonl, test: gsm8k/test.jsonl}",
        )

    def load_with_stats(self, *, split: str, options: BaseModel, seed: int = 0) -> tuple[list[dict[str, Any]], LoadStats]:
        """:meth:`load`, plus how many rows were read and skipped."""
        options = _options(options)
        rows, label = self._open(split, options)
        return self._examples(rows, split=split, label=label, options=options)

    def _examples(
        self, rows: Iterable[Mapping[str, Any]], *, split: str, label: str, options: GSM8KOptions
    ) -> tuple[list[dict[str, Any]], LoadStats]:
        examples: list[dict[str, Any]] = []
        bad: list[str] = []
        read = 0
        for index, row in enumerate(rows):
            if options.max_examples is not None and len(examples) >= options.max_examples:
                break
            read += 1
            try:
                ex = self.prepare_example(row, options=options, where=f"GSM8K {label} row {index}")
            except UnparseableAnswer as err:
                bad.append(str(err))
                continue
            ex.update(split=split, index=index)
            examples.append(ex)
        if bad and not options.skip_unparseable:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise UserError(
                f"{len(bad)} row(s) of GSM8K {label} have no readable ground truth{more}. Fix them, or set "
                "task.options.skip_unparseable=true to skip them:",
                problems=bad[:5],
            )
        stats = LoadStats(split=split, rows_read=read, kept=len(examples), skipped=len(bad), skipped_examples=tuple(bad[:5]))
        if bad:
            log.warning("gsm8k: skipped %d of %d rows of %s with no readable ground truth; first: %s",
                        len(bad), read, label, bad[0])
        if not examples:
            raise UserError(f"GSM8K {label} has no usable examples ({read} row(s) read, {len(bad)} skipped).")
        return examples, stats

    def load(self, *, split: str, options: BaseModel, seed: int = 0) -> list[dict[str, Any]]:
        return self.load_with_stats(split=split, options=options, seed=seed)[0]

    # ---- prompts

    def system_prompt(self, options: BaseModel) -> str:
        options = _options(options)
        if options.system_prompt is not None:
            return options.system_prompt
        return _SYSTEM_PROMPTS[options.answer_format].format(tag=options.answer_tag)

    def prompt_messages(self, example: Mapping[str, Any], *, options: BaseModel) -> list[dict[str, str]]:
        messages = []
        system = self.system_prompt(options)
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": str(example["question"])})
        return messages

    # ---- rewards

    def tools(self, *, options: BaseModel) -> dict[str, Any]:
        from grpo.plugins.tools import builtin_tools

        return builtin_tools(_options(options).tools, where="task.options.tools")

    def reward_functions(self, *, options: BaseModel) -> dict[str, RewardFn]:
        options = _options(options)
        fmt, tag, mode = options.answer_format, options.answer_tag, options.correct_mode
        check = options.answer_check

        def correct(completion: str, example: Mapping[str, Any]) -> float:
            checks = answer_checks(completion, example, mode=mode, answer_format=fmt, tag=tag,
                                   math_verify=check == "math_verify")
            return 1.0 if any(checks.values()) else 0.0

        def format(completion: str, example: Mapping[str, Any]) -> float:  # noqa: A001 - the reward's name
            return 1.0 if format_ok(completion, answer_format=fmt, tag=tag) else 0.0

        def tags(completion: str, example: Mapping[str, Any]) -> float:
            return tag_score(completion, answer_format=fmt, tag=tag)

        return {"correct": correct, "format": format, "tags": tags}

    def reward_weights(self, *, options: BaseModel) -> dict[str, float]:
        options = _options(options)
        return dict(options.reward_weights)

    def is_correct(self, reward_values: Mapping[str, float], *, options: BaseModel) -> bool:
        return reward_values.get("correct", 0.0) >= 1.0

    def answer_checks(self, completion: str, example: Mapping[str, Any], *, options: BaseModel) -> dict[str, bool]:
        """Each answer check's verdict (``strict``, ``math_verify`` when installed), for
        ``grpo task score``'s agreement report."""
        options = _options(options)
        return answer_checks(completion, example, mode=options.correct_mode, answer_format=options.answer_format,
                             tag=options.answer_tag, math_verify=verify.available())

    def reference_completion(self, example: Mapping[str, Any], *, options: BaseModel) -> str:
        """The labelled solution as a completion in the required format: GSM8K's answer
        text, its ``#### N`` line written as ``<answer>N</answer>`` for ``tag``."""
        options = _options(options)
        text = str(example["answer"])
        if options.answer_format == "hashes" or "####" not in text:
            return text
        head, line = text.rsplit("####", 1)
        return f"{head.rstrip()}\n<{options.answer_tag}>{line.strip()}</{options.answer_tag}>"

    # ---- helpers for people

    def reference_completion(self, example: Mapping[str, Any], *, options: BaseModel) -> str:
        """A completion that states the ground truth in the required format (scores 1 on
        ``correct`` and ``format``): for checking data and rewards against each other."""
        options = _options(options)
        gt = example["ground_truth"] if "ground_truth" in example else parse_ground_truth(str(example["answer"]))
        if options.answer_format == "tag":
            return f"Let me work it out step by step.\n<{options.answer_tag}>{gt}</{options.answer_tag}>"
        return f"Let me work it out step by step.\n#### {gt}"
