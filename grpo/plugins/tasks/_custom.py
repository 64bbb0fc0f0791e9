"""``custom``: your reward functions and your dataset, named in the config — no plugin package.

Rewards
    ``rewards`` lists import paths ``module:function`` (the module importable from the
    working directory or the Python path), or ``session:NAME`` for a callable handed to
    :mod:`grpo.api`. Each function follows TRL's ``GRPOTrainer`` convention, so a TRL
    reward function works unchanged::

        def reward(completions, prompts=None, **columns) -> list[float | None]

    ``completions`` and ``prompts`` are lists of strings for plain-text prompts, or for
    conversational ones (a prompt that is a list of ``{"role", "content"}`` messages)
    lists of message lists, each completion ``[{"role": "assistant", "content": ...}]``.
    Every other dataset column comes as a keyword argument holding a list (a function
    without ``**kwargs`` gets the columns it names). ``None`` means "not applicable to
    this sample" and counts 0 in the total, as TRL's ``nansum`` does (NaN too). Each function is
    called once per step with the step's completions, as TRL calls it (with
    ``task.reward_scoring: overlap``, once per batch of groups that finished together); a
    call that raises or returns the wrong length is retried row by row (lists of one), so
    one bad completion costs only its own row. Its name in metrics is the function's
    ``__name__`` (``reward/<name>/mean``).
    ``reward_weights`` (TRL's argument of the same name) weighs them; default 1 each.
    Evaluation counts a completion as solved (pass@k) when ``correct_reward`` (default:
    the first function) scores at least 1; shaping rewards beside it do not decide that.

Data
    ``data_files`` (local jsonl/json/csv/parquet per split, or ``session:NAME`` for a
    ``datasets.Dataset`` or list of dicts handed to :mod:`grpo.api`) or a hub ``dataset``.
    ``prompt_column`` holds the prompt (a string, or a list of messages);
    ``answer_column``, when set, must exist in every row (rewards get it as a keyword).

Chat template
    A plain-text prompt is one user message; a conversational one is its messages (with
    ``system_prompt`` first when set and it has no system message). ``chat_template``:
    ``auto`` (the default, TRL's rule) templates conversational prompts with the
    tokenizer's chat template and uses plain-text prompts verbatim (``system_prompt`` then
    joins as a paragraph before the text); ``true`` templates every prompt (a plain-text
    prompt as one user message, as an instruct model expects); ``false`` uses every
    prompt's message contents verbatim. A tokenizer without a template (the tiny test
    tokenizer) always gets the contents verbatim.

Bad references fail at config load (exit 2, naming ``task.options.rewards[i]``): a path
that does not import, an attribute that is not there, an object that is not callable, a
function that cannot take ``completions`` and ``prompts`` by keyword. A function that
requires an argument no column provides, or a missing prompt/answer column, fails when the
split loads, naming the field; one that requires an argument TRL passes and grpo does not
(``completion_ids``, ``trainer_state``: :data:`NOT_PASSED`) is refused saying so.

Return values: any iterable of numbers, one per completion (a list, a tuple, a NumPy
array, a tensor through its ``tolist()``). ``None`` or NaN means "not applicable": 0 in
the total, counted in ``reward/<name>/not_applicable``, not as an error (``reward/<name>/mean``
counts them as 0; TRL's logged mean, a ``nanmean``, leaves them out). Anything else (a
wrong length, a string, a non-number) is an error: that completion scores 0 for the
function, counted in ``reward_errors``; the function's first error in a run is logged once
(name, step, row, message) and kept in the run directory's ``reward_errors.jsonl``, and a
function that fails on every completion of a step stops the run (exit status 2).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, ClassVar, Literal, Mapping, Sequence

from pydantic import BaseModel, Field, field_validator, model_validator

from grpo.core.contracts import PluginOptions, RewardFn, TaskPlugin, batched_reward
from grpo.core.contracts.task import reward_values
from grpo.core.errors import UserError
from grpo.core.references import SESSION, resolve
from grpo.plugins.tasks._common import coerce_options, open_split

NOT_PASSED = {
    "completion_ids": "it scores completions as text; tokenize the completion if you need its ids",
    "trainer_state": "it has no transformers TrainerState",
}
"""Keyword arguments TRL's ``GRPOTrainer`` gives reward functions that grpo does not, and why."""

RESERVED = ("total", "overlong")
"""Reward names the engine uses itself; a function named so is renamed ``<name>_fn``."""


class CustomOptions(PluginOptions):
    rewards: list[str] = Field(
        ..., min_length=1,
        description="Reward functions as import paths 'module:function' (TRL's convention: "
        "fn(completions, prompts=..., **columns) -> list[float | None]), or session:NAME from the Python API.",
    )
    reward_weights: list[float] | None = Field(
        None, description="Weight of each reward function in the total, in the order of `rewards`; default 1 each."
    )
    dataset: str | None = Field(None, description="Hub dataset id (used when data_files is unset).")
    config_name: str | None = Field(None, description="Hub dataset config name.")
    data_files: dict[str, str | list[str]] | None = Field(
        None,
        description="Per split: local files (.jsonl/.json/.csv/.parquet), or session:NAME for a dataset handed to "
        "the Python API; overrides `dataset`.",
    )
    prompt_column: str = Field("prompt", min_length=1, description="Column holding the prompt: a string or a list of messages.")
    answer_column: str | None = Field(
        None, min_length=1, description="Column every row must have (e.g. the reference answer); rewards get it by name."
    )
    system_prompt: str | None = Field(None, description="System message put first; none = no system message.")
    chat_template: bool | Literal["auto"] = Field(
        "auto",
        description="auto (TRL's rule): conversational prompts (lists of messages) through the tokenizer's chat "
        "template, plain-text prompts verbatim; true: every prompt through the template (a plain-text prompt is "
        "one user message); false: every prompt's message contents verbatim.",
    )
    max_examples: int | None = Field(None, ge=1, le=100_000_000, description="Keep the first N examples of a split.")
    correct_reward: str | None = Field(
        None, min_length=1,
        description="The reward (by metrics name) whose value >= 1 counts a completion as solved, for pass@k; "
        "none = the first function in `rewards`.",
    )

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, value: list[str]) -> list[str]:
        problems = []
        for i, ref in enumerate(value):
            if ref.startswith(SESSION) and not _session_known(ref):
                continue  # e.g. `grpo export` of a Python-API run: checked when the rewards are used
            try:
                check_reward(resolve(ref, field=None))
            except UserError as err:
                problems.append(f"task.options.rewards[{i}]: {err}")
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _weights(self) -> "CustomOptions":
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(
                f"task.options.reward_weights has {len(self.reward_weights)} weight(s) for {len(self.rewards)} "
                "reward function(s); give one per function, in the order of task.options.rewards"
            )
        return self

    @field_validator("data_files")
    @classmethod
    def _files(cls, value: dict[str, str | list[str]] | None) -> dict[str, str | list[str]] | None:
        if value is not None and not value:
            raise ValueError("data_files is empty; give at least one split, e.g. {train: train.jsonl}")
        return value


def _session_known(ref: str) -> bool:
    try:
        resolve(ref, field=None)
    except UserError:
        return False
    return True


def _options(options: Any) -> CustomOptions:
    return coerce_options(CustomOptions, options)


# --------------------------------------------------------------------------- signatures


def _accepts(sig: inspect.Signature) -> tuple[set[str], bool, list[str]]:
    """(keyword names it takes, whether it takes ``**kwargs``, names it requires)."""
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {n for n, p in sig.parameters.items() if p.kind in by_keyword}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    required = [
        n for n, p in sig.parameters.items()
        if p.default is inspect.Parameter.empty and p.kind in (*by_keyword, inspect.Parameter.POSITIONAL_ONLY)
    ]
    return names, var_kw, required


def check_reward(fn: Any) -> inspect.Signature | None:
    """Refuse (UserError, no field) what cannot be called the way TRL calls a reward
    function: ``fn(prompts=..., completions=..., **columns)``. None: no signature to read
    (a builtin); it is called and its failures counted like any reward's."""
    if not callable(fn):
        raise UserError(f"{fn!r:.80} is a {type(fn).__name__}, not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names, var_kw, required = _accepts(sig)
    missing = [n for n in ("completions", "prompts") if n not in names and not var_kw]
    if missing:
        raise UserError(
            f"{_name(fn)}{sig} has the wrong signature: it cannot take {' and '.join(missing)} by keyword. "
            "A reward function follows TRL's convention: def fn(completions, prompts=None, **kwargs) -> list[float]"
        )
    positional_only = [n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    if positional_only:
        raise UserError(f"{_name(fn)}{sig} has the wrong signature: {positional_only} are positional-only; "
                        "rewards are called with keyword arguments (completions=..., prompts=...)")
    return sig


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def reward_names(functions: Sequence[Any]) -> list[str]:
    """Each function's metrics name: its ``__name__``, made unique (``name_2``, ...) and
    kept off the engine's own names."""
    out: list[str] = []
    for fn in functions:
        base = _name(fn)
        base = f"{base}_fn" if base in RESERVED else base
        name, n = base, 1
        while name in out:
            n += 1
            name = f"{base}_{n}"
        out.append(name)
    return out


# --------------------------------------------------------------------------- calling


def trl_reward(fn: Callable[..., Any], *, prompt_column: str, field: str) -> RewardFn:
    """``fn`` (TRL's batched convention) as a batched reward of the step
    (:func:`grpo.batched_reward`): the engine hands it the step's completions, and it
    calls ``fn`` once with them, the prompts from ``prompt_column`` and the other columns
    as keyword lists, as TRL's ``GRPOTrainer`` does; a completion of a conversational
    prompt is handed over as ``[{"role": "assistant", "content": ...}]``. Any iterable of
    numbers is a valid return (:func:`reward_values`); ``None`` or NaN passes through as
    "not applicable" (0 in the total, as TRL's ``nansum`` adds them)."""
    sig = check_reward(fn)
    names, var_kw, required = _accepts(sig) if sig is not None else (set(), True, [])

    @batched_reward(per="step")
    def reward(completions: list[str], prompts: Any = None, **columns: list[Any]) -> list[Any]:
        prompt_list = columns[prompt_column]
        done = [[{"role": "assistant", "content": c}] if isinstance(p, list) else c
                for c, p in zip(completions, prompt_list)]
        kwargs = {
            k: v for k, v in columns.items()
            if k != prompt_column and k not in ("completions", "prompts") and (var_kw or k in names)
        }
        out = fn(completions=done, prompts=prompt_list, **kwargs)
        return reward_values(out, field=field, expected=len(completions))

    reward.__name__ = _name(fn)
    reward.required = [n for n in required if n not in ("completions", "prompts")]  # type: ignore[attr-defined]
    return reward


# --------------------------------------------------------------------------- the task


class CustomTask(TaskPlugin):
    name: ClassVar[str] = "custom"
    description: ClassVar[str] = (
        "Your reward functions by import path (TRL's convention) on a local, hub or in-memory dataset."
    )
    Options: ClassVar[type[BaseModel]] = CustomOptions

    def _functions(self, options: CustomOptions) -> list[Any]:
        return [resolve(ref, field=f"task.options.rewards[{i}]") for i, ref in enumerate(options.rewards)]

    def reward_functions(self, *, options: BaseModel) -> dict[str, RewardFn]:
        options = _options(options)
        fns = self._functions(options)
        for i, fn in enumerate(fns):
            try:
                check_reward(fn)
            except UserError as err:
                raise UserError(f"task.options.rewards[{i}]: {err}") from None
        names = reward_names(fns)
        return {
            name: trl_reward(fn, prompt_column=options.prompt_column, field=f"task.options.rewards[{i}] ({name})")
            for i, (name, fn) in enumerate(zip(names, fns))
        }

    def reward_weights(self, *, options: BaseModel) -> dict[str, float]:
        options = _options(options)
        names = reward_names(self._functions(options))
        weights = options.reward_weights or [1.0] * len(names)
        return dict(zip(names, map(float, weights)))

    def is_correct(self, reward_values: Mapping[str, float], *, options: BaseModel) -> bool:
        options = _options(options)
        name = options.correct_reward or next(iter(reward_values))
        if name not in reward_values:
            raise UserError(
                f"task.options.correct_reward: no reward named {name!r}; the rewards are {', '.join(reward_values)}."
            )
        return reward_values[name] >= 1.0

    # ---- data

    def _open(self, split: str, options: CustomOptions) -> tuple[Any, str]:
        files = options.data_files or {}
        ref = files.get(split)
        if isinstance(ref, str) and ref.startswith(SESSION):
            return resolve(ref, field=f"task.options.data_files[{split!r}]"), f"split {split!r} (in memory)"
        return open_split(split, dataset=options.dataset, config_name=options.config_name, data_files=options.data_files,
                          task="custom", example_files="{train: train.jsonl, test: test.jsonl}")

    def load(self, *, split: str, options: BaseModel, seed: int = 0) -> list[dict[str, Any]]:
        options = _options(options)
        rows, label = self._open(split, options)
        columns = _columns(rows)
        for field in ("prompt_column", "answer_column"):
            column = getattr(options, field)
            if column is not None and columns is not None and column not in columns:
                raise UserError(
                    f"task.options.{field}: the column {column!r} is not in {label} "
                    f"(its columns: {', '.join(columns) or 'none'})."
                )
        self._check_required(options, columns, label)
        examples = []
        for index, row in enumerate(rows):
            if options.max_examples is not None and len(examples) >= options.max_examples:
                break
            examples.append(self.prepare_example(row, options=options, where=f"{label} row {index}"))
        if not examples:
            raise UserError(f"task.options.data_files: {label} has no rows.")
        return examples

    def _check_required(self, options: CustomOptions, columns: Sequence[str] | None, label: str) -> None:
        functions = self.reward_functions(options=options)
        if options.correct_reward is not None and options.correct_reward not in functions:
            raise UserError(
                f"task.options.correct_reward: no reward named {options.correct_reward!r}; the rewards are "
                f"{', '.join(functions)}."
            )
        if columns is None:
            return
        for i, (name, fn) in enumerate(functions.items()):
            absent = [n for n in fn.required if n not in columns]  # type: ignore[attr-defined]
            unpassed = [n for n in absent if n in NOT_PASSED]
            if unpassed:
                raise UserError(
                    f"task.options.rewards[{i}]: {name} requires {', '.join(map(repr, unpassed))}, which TRL's "
                    f"GRPOTrainer passes and grpo does not ({NOT_PASSED[unpassed[0]]}). grpo passes completions, "
                    "prompts and the dataset's columns; give the parameter a default (e.g. "
                    f"{unpassed[0]}=None) or compute it from the completion."
                )
            if absent:
                raise UserError(
                    f"task.options.rewards[{i}]: {name} requires the argument(s) {', '.join(map(repr, absent))}, "
                    f"which no column of {label} provides (its columns: {', '.join(columns)})."
                )

    def prepare_example(self, record: Mapping[str, Any], *, options: BaseModel, where: str = "row") -> dict[str, Any]:
        options = _options(options)
        if not isinstance(record, Mapping):
            raise UserError(f"{where}: expected a mapping of columns, got {type(record).__name__}")
        for field in ("prompt_column", "answer_column"):
            column = getattr(options, field)
            if column is not None and record.get(column) is None:
                have = ", ".join(sorted(map(str, record))) or "none"
                raise UserError(f"task.options.{field}: {where} has no {column!r} column (columns: {have}).")
        prompt = record[options.prompt_column]
        if not isinstance(prompt, str) and not _is_messages(prompt):
            raise UserError(
                f"task.options.prompt_column: {where}'s {options.prompt_column!r} is a {type(prompt).__name__}; "
                "a prompt is a string or a list of {'role': ..., 'content': ...} messages."
            )
        return {k: (list(map(dict, v)) if k == options.prompt_column and not isinstance(v, str) else v)
                for k, v in record.items()}

    # ---- prompts

    def prompt_messages(self, example: Mapping[str, Any], *, options: BaseModel) -> list[dict[str, str]]:
        options = _options(options)
        prompt = example[options.prompt_column]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if options.system_prompt and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": options.system_prompt})
        return messages

    def uses_chat_template(self, *, options: BaseModel) -> bool:
        return _options(options).chat_template is not False  # auto templates the conversational prompts

    def uses_chat_template_for(self, example: Mapping[str, Any], *, options: BaseModel) -> bool:
        options = _options(options)
        if options.chat_template == "auto":  # TRL's maybe_apply_chat_template: messages templated, text verbatim
            return not isinstance(example[options.prompt_column], str)
        return options.chat_template


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)


def _columns(rows: Any) -> list[str] | None:
    """The column names of a ``datasets.Dataset`` or of a list of dicts (the first row's)."""
    names = getattr(rows, "column_names", None)
    if names is not None:
        return list(names)
    if isinstance(rows, Sequence) and rows and isinstance(rows[0], Mapping):
        return list(rows[0])
    return None
