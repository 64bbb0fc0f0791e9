"""``math``: MATH-style problems whose answer is a ``\\boxed{}`` expression, checked by
Hugging Face's ``math-verify`` (the ``[math]`` extra) or by strict string matching.

Data
    Local jsonl/json/parquet/csv files through ``data_files`` (``data/math_sample/``
    ships 24 problems, MIT), or a hub ``dataset``. A row has the problem
    (``problem_field``) and its ground truth: the ``answer`` column when the row has
    one, else the last ``\\boxed{}`` of its ``solution`` (MATH's own layout). A row
    without either is an error naming it, or with ``skip_unparseable`` skipped.

Rewards (each in [0, 1]; weights configurable)
    ``correct``: the completion's answer (the content of its last ``\\boxed{}``;
      without one, math-verify's own pick of the completion's last expression) equals
      the ground truth: ``answer_check: math_verify`` (default) by math-verify's
      symbolic comparison (``\\frac{1}{2}`` = ``0.5`` = ``1/2``, ``50\\%`` = ``0.5``,
      ``-3, 3`` = ``3, -3``, ``120^\\circ`` = ``120``); ``strict`` by the strings'
      normal forms (:func:`grpo.plugins.tasks._verify.normalize`: spacing, ``\\left``,
      ``\\dfrac`` and the like aside).
    ``boxed``: the completion states its answer in a ``\\boxed{}``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Mapping

from pydantic import BaseModel, Field, field_validator

from grpo.core.contracts import PluginOptions, RewardFn, TaskPlugin
from grpo.core.errors import UserError
from grpo.plugins.tasks import _verify as verify
from grpo.plugins.tasks._common import UnparseableAnswer, coerce_options, merge_weights, open_split, require_text, shorten

DEFAULT_WEIGHTS: dict[str, float] = {"correct": 1.0, "boxed": 0.1}

DEFAULT_SYSTEM_PROMPT = ("Solve the problem. Reason step by step, then give the final answer in LaTeX as "
                         "\\boxed{ANSWER}.")


class MathOptions(PluginOptions):
    dataset: str | None = Field(None, description="Hub dataset id (used when data_files is unset).")
    config_name: str | None = Field(None, description="Hub dataset config name.")
    data_files: dict[str, str | list[str]] | None = Field(
        None, description="Local files per split, e.g. {train: data/math_sample/train.jsonl, test: "
        "data/math_sample/test.jsonl}; overrides `dataset`.",
    )
    problem_field: str = Field("problem", min_length=1, description="Column holding the problem.")
    solution_field: str = Field("solution", min_length=1,
                                description="Column holding a worked solution ending in \\\\boxed{answer}.")
    answer_field: str = Field("answer", min_length=1,
                              description="Column holding the answer; a row without it reads its solution's \\\\boxed{}.")
    system_prompt: str | None = Field(None, description="System message; none = a built-in one asking for \\\\boxed{}; "
                                      "empty = no system message.")
    answer_check: Literal["math_verify", "strict"] = Field(
        "math_verify", description="`math_verify`: Hugging Face's math-verify compares the answers symbolically "
        "(pip install 'grpo-jax[math]'); `strict`: their normalised strings must be equal.",
    )
    reward_weights: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_WEIGHTS),
        description="Weight of each reward in the total (correct, boxed); unnamed ones keep their defaults.",
    )
    skip_unparseable: bool = Field(False, description="Skip (and count) rows without an answer, instead of failing.")
    max_examples: int | None = Field(None, ge=1, le=100_000_000, description="Keep the first N examples of a split.")

    @field_validator("reward_weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        return merge_weights(value, DEFAULT_WEIGHTS)


def _options(options: Any) -> MathOptions:
    return coerce_options(MathOptions, options)


def answer_checks(completion: str, truth: str, *, math_verify: bool = True) -> dict[str, bool]:
    """Whether ``completion`` answers ``truth`` by each check: ``strict`` (its last
    ``\\boxed{}``'s normal form is the truth's) and, with ``math_verify``, math-verify's."""
    boxed = verify.last_boxed(completion)
    out = {"strict": boxed is not None and verify.normalize(boxed) == verify.normalize(truth)}
    if math_verify:
        out["math_verify"] = (verify.equivalent(truth, boxed) if boxed is not None
                              else verify.equivalent_text(truth, completion))
    return out


class MathTask(TaskPlugin):
    name: ClassVar[str] = "math"
    description: ClassVar[str] = "MATH-style problems with \\boxed{} answers, checked by math-verify or strictly."
    Options: ClassVar[type[BaseModel]] = MathOptions

    def prepare_example(self, record: Mapping[str, Any], *, options: BaseModel, where: str = "row") -> dict[str, Any]:
        options = _options(options)
        require_text(record, options.problem_field, where)
        out = dict(record)
        answer = record.get(options.answer_field)
        if answer is None:
            solution = record.get(options.solution_field)
            answer = verify.last_boxed(solution) if isinstance(solution, str) else None
            if answer is None:
                raise UnparseableAnswer(
                    f"{where}: no {options.answer_field!r} column and no \\boxed{{}} answer in its "
                    f"{options.solution_field!r} ({shorten(str(solution))!r})")
        out["ground_truth"] = str(answer).strip()
        return out

    def load(self, *, split: str, options: BaseModel, seed: int = 0) -> list[dict[str, Any]]:
        options = _options(options)
        rows, label = open_split(split, dataset=options.dataset, config_name=options.config_name,
                                 data_files=options.data_files, task="math",
                                 example_files="{train: data/math_sample/train.jsonl, test: data/math_sample/test.jsonl}")
        examples = []
        for index, row in enumerate(rows):
            if options.max_examples is not None and len(examples) >= options.max_examples:
                break
            try:
                examples.append(self.prepare_example(row, options=options, where=f"{label} row {index}"))
            except UnparseableAnswer:
                if not options.skip_unparseable:
                    raise
        if not examples:
            raise UserError(f"task.options.data_files: {label} has no usable rows.")
        return examples

    def prompt_messages(self, example: Mapping[str, Any], *, options: BaseModel) -> list[dict[str, str]]:
        options = _options(options)
        system = DEFAULT_SYSTEM_PROMPT if options.system_prompt is None else options.system_prompt
        messages = [{"role": "system", "content": system}] if system else []
        return messages + [{"role": "user", "content": str(example[options.problem_field])}]

    def reward_functions(self, *, options: BaseModel) -> dict[str, RewardFn]:
        options = _options(options)
        mv = options.answer_check == "math_verify"
        if mv:
            verify.require("task.options.answer_check")

        def correct(completion: str, example: Mapping[str, Any]) -> float:
            checks = answer_checks(completion, str(example["ground_truth"]), math_verify=mv)
            return 1.0 if checks["math_verify" if mv else "strict"] else 0.0

        def boxed(completion: str, example: Mapping[str, Any]) -> float:
            return 0.0 if verify.last_boxed(completion) is None else 1.0

        return {"correct": correct, "boxed": boxed}

    def reward_weights(self, *, options: BaseModel) -> dict[str, float]:
        return dict(_options(options).reward_weights)

    def is_correct(self, reward_values: Mapping[str, float], *, options: BaseModel) -> bool:
        return reward_values.get("correct", 0.0) >= 1.0

    def answer_checks(self, completion: str, example: Mapping[str, Any], *, options: BaseModel) -> dict[str, bool]:
        """Each check's verdict (``strict``, ``math_verify`` when installed), for ``grpo
        task score``'s agreement report."""
        return answer_checks(completion, str(example["ground_truth"]), math_verify=verify.available())

    def reference_completion(self, example: Mapping[str, Any], *, options: BaseModel) -> str:
        """The row's worked solution (``\\boxed{answer}`` when it has none)."""
        options = _options(options)
        solution = example.get(options.solution_field)
        return solution if isinstance(solution, str) else f"\\boxed{{{example['ground_truth']}}}"
