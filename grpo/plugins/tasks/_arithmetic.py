"""``arithmetic``: small additions generated from a seed — the quickstart's task.

A prompt is one user message, the bare sum ``"3+4="`` (``operation: copy``: ``"7="``),
rendered through the tokenizer's chat template unless ``chat_template: false`` (then
the prompt text is exactly ``"3+4="``). The ideal completion is the answer, ``"7"``.
Examples are generated on the fly and need no download, deterministic in ``seed`` (the
run's seed when unset):

- The distinct prompts (operand pairs in ``[min_operand, max_operand]``, with a sum of at
  most ``max_sum`` when set) are split once: a share ``test_fraction`` is held out for
  the ``test`` split, chosen so that every held-out answer is also the answer of some
  training prompt. ``train`` draws ``num_examples`` examples (with repeats) from the
  rest; ``test`` lists up to ``num_test_examples`` distinct held-out prompts. So test
  accuracy is measured on prompts the policy never trained on.
- ``copy`` (``"7="`` -> ``"7"``) holds out whole operands, whose answers no training
  prompt rewards; it exists as a conditioning check (does the policy read its prompt?),
  evaluated on its training prompts (``task.eval_split: train``).

Rewards (each in [0, 1]). The completion is read with whitespace removed (Python's
``str.split`` whitespace), because a word-level tokenizer decodes ``1``, ``2`` as
``"1 2"``; its *leading digit run* is the model's answer.

- ``correct``: 1 when the completion is exactly the answer (weight 1 by default).
- ``prefix``: 1 when the leading digit run is exactly the answer, whatever follows
  (weight 0.5): credit for the right number before the model has learned to stop.
- ``close``: ``max(0, 1 - |answer - truth| / S)`` with ``S = max_operand - min_operand + 1``.
- ``length``: 1 when the digit run has as many digits as the true answer.
- ``format``: 1 when the completion is only digits, 0.5 when it starts with digits and
  then goes on, else 0.

``close``, ``length`` and ``format`` have weight 0 by default (they are still computed
and logged); ``reward_weights`` turns them on.

Why the default reward is only the prompt-specific terms
---------------------------------------------------------
Measured with the quickstart's model (random 2-layer, 64-wide Qwen2, 16 samples x 8
prompts a step, on CPU): with ``format``/``length``/``close`` weighted in (0.25, 0.25,
0.5), within 100-300 steps GRPO collapses every prompt
onto one constant answer — even on ``copy``, where the answer is the prompt's own
digit. The policy gradient raises a sampled token's logit in proportion to its
probability times its advantage, so a reward that every digit earns alike (``format``,
``length``) makes the most likely digit grow fastest, for every prompt at once; and
``close`` rewards the middle of the answer range on average over prompts. Group-std
normalisation scales a group whose only differences are formatting up to the same
strength as a group where one sample was right. Those prompt-independent signals win
long before the policy routes each prompt's operands to its answer, and once every
sample of a group agrees, the group's advantage is zero. ``correct`` and ``prefix``
reward only the right answer of each prompt, so nothing pulls all prompts to one answer;
the quickstart adds ``loss.entropy_coef`` so that a prompt answered wrongly keeps
sampling other answers, and a larger initialisation so that the answer position sees
its prompt from the start.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from typing import Any, ClassVar, Literal, Mapping

from pydantic import BaseModel, Field, field_validator, model_validator

from grpo.core.contracts import PluginOptions, RewardFn, TaskPlugin
from grpo.core.errors import UserError
from grpo.plugins.tasks._common import coerce_options, merge_weights, require_text

DEFAULT_WEIGHTS: dict[str, float] = {"correct": 1.0, "prefix": 0.5, "close": 0.0, "length": 0.0, "format": 0.0}

_MAX_RUN = 18  # longer digit runs are far from any answer; never turn them into huge ints
_LEADING_DIGITS = re.compile(r"[0-9]*")


class ArithmeticOptions(PluginOptions):
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Seed of the generated examples; none = the run's seed.")
    num_examples: int = Field(2000, ge=1, le=10_000_000, description="Training examples to generate.")
    num_test_examples: int = Field(200, ge=1, le=10_000_000, description="Test examples to generate.")
    min_operand: int = Field(0, ge=0, le=10**9, description="Smallest operand.")
    max_operand: int = Field(9, ge=0, le=10**9, description="Largest operand (9: single-digit additions, answers of 1-2 digits).")
    max_sum: int | None = Field(
        None, ge=0, le=2 * 10**9,
        description="add: keep only pairs whose sum is at most this (9: one-digit answers); none = every pair.",
    )
    operation: Literal["add", "copy"] = Field(
        "add", description="add: 'a+b=' -> a+b; copy: 'a=' -> a (a trivially routed check that the policy reads its prompt)."
    )
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0,
        description="Share of the distinct prompts held out for the test split; training never sees them.",
    )
    chat_template: bool = Field(
        True, description="Render the prompt through the tokenizer's chat template; false = the bare question text."
    )
    reward_weights: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_WEIGHTS),
        description="Weight of each reward in the total (correct, close, length, format); unnamed ones keep their defaults.",
    )

    @field_validator("reward_weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        return merge_weights(value, DEFAULT_WEIGHTS)

    @model_validator(mode="after")
    def _range(self):
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand={self.min_operand} must be <= max_operand={self.max_operand}")
        return self


def _options(options: Any) -> ArithmeticOptions:
    return coerce_options(ArithmeticOptions, options)


_ENUMERATE_LIMIT = 100_000  # prompt spaces up to this size are listed and split exactly


def _held_out(key: tuple[int, ...], *, seed: int, fraction: float) -> bool:
    """Whether the prompt ``key`` belongs to the test split of a space too large to list:
    a hash of (seed, key) in [0, 1) below ``fraction``."""
    digest = hashlib.blake2b(f"grpo.arithmetic/{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < fraction


def _allowed(key: tuple[int, ...], max_sum: int | None) -> bool:
    return max_sum is None or len(key) == 1 or sum(key) <= max_sum


def _example(key: tuple[int, ...], *, split: str, index: int) -> dict[str, Any]:
    if len(key) == 1:  # copy
        return {"question": f"{key[0]}=", "answer": str(key[0]), "split": split, "index": index}
    a, b = key
    return {"question": f"{a}+{b}=", "answer": str(a + b), "split": split, "index": index}


def _hold_out(keys: list[tuple[int, ...]], n_test: int, *, stratify: bool) -> tuple[list, list]:
    """The first ``n_test`` of the (shuffled) ``keys`` go to the test split — with
    ``stratify``, skipping any whose sum no other remaining key shares, so every held-out
    answer is also the answer of some training prompt (a policy can only learn to emit an
    answer that some training prompt rewards)."""
    if not stratify:
        return keys[:n_test], keys[n_test:]
    left: dict[int, int] = {}
    for key in keys:
        left[sum(key)] = left.get(sum(key), 0) + 1
    test, train = [], []
    for key in keys:
        if len(test) < n_test and left[sum(key)] > 1:
            test.append(key)
            left[sum(key)] -= 1
        else:
            train.append(key)
    return test, train


def generate(
    *, split: str, seed: int, count: int, low: int, high: int, operation: str = "add", test_fraction: float = 0.2,
    max_sum: int | None = None,
) -> list[dict[str, Any]]:
    """Examples of ``split``, deterministic in (seed, split), on disjoint sets of prompts.

    The distinct prompts (operand pairs for ``add``, single operands for ``copy``, each
    operand in [low, high]) are divided once, by ``seed`` alone, into a held-out share
    ``test_fraction`` and the rest. ``train`` draws ``count`` examples uniformly (with
    repeats) from the rest; ``test`` lists up to ``count`` *distinct* held-out prompts,
    so its accuracy is over prompts the policy never trained on.
    """
    arity = 1 if operation == "copy" else 2
    width = high - low + 1
    space = width**arity
    rng = random.Random(f"grpo.arithmetic/{seed}/{split}")
    draw = lambda: tuple(rng.randint(low, high) for _ in range(arity))  # noqa: E731
    if space <= _ENUMERATE_LIMIT:
        keys = [k for k in itertools.product(range(low, high + 1), repeat=arity) if _allowed(k, max_sum)]
        random.Random(f"grpo.arithmetic/{seed}/holdout").shuffle(keys)
        n = len(keys)
        n_test = min(max(1, round(test_fraction * n)), n - 1) if n > 1 else 0
        test, train = _hold_out(keys, n_test, stratify=operation == "add")
        if not test or not train:
            raise UserError(
                f"The arithmetic task's operands [{low}, {high}] (max_sum {max_sum}) give {n} distinct prompt(s): too few to hold "
                "some out for the test split. Widen task.options.min_operand/max_operand."
            )
        if split == "train":
            return [_example(rng.choice(train), split=split, index=i) for i in range(count)]
        return [_example(key, split=split, index=i) for i, key in enumerate(test[:count])]
    # Too many prompts to list: membership by hash, examples by rejection sampling.
    want_test = split != "train"
    out: list[dict[str, Any]] = []
    seen: set[tuple[int, ...]] = set()
    # A split with fewer distinct prompts than asked ends after a bounded number of draws.
    for _ in range(int(20 * count / min(test_fraction, 1 - test_fraction)) + 1000):
        if len(out) == count:
            break
        key = draw()
        if not _allowed(key, max_sum) or _held_out(key, seed=seed, fraction=test_fraction) != want_test or (
            want_test and key in seen
        ):
            continue
        seen.add(key)
        out.append(_example(key, split=split, index=len(out)))
    return out


def _scale(options: ArithmeticOptions) -> int:
    return options.max_operand - options.min_operand + 1


def arithmetic_rewards(completion: str, answer: str, *, scale: int) -> dict[str, float]:
    """All four rewards of one completion against the true ``answer`` (a digit string)."""
    text = "".join(completion.split())
    run = _LEADING_DIGITS.match(text).group(0)  # type: ignore[union-attr]
    fmt = 1.0 if run and run == text else (0.5 if run else 0.0)
    length = 1.0 if run and len(run) == len(answer) else 0.0
    if run and len(run) <= _MAX_RUN:
        close = max(0.0, 1.0 - abs(int(run) - int(answer)) / scale)
    else:
        close = 0.0
    correct = 1.0 if text == answer else 0.0
    prefix = 1.0 if run == answer else 0.0
    return {"correct": correct, "prefix": prefix, "close": close, "length": length, "format": fmt}


class ArithmeticTask(TaskPlugin):
    name: ClassVar[str] = "arithmetic"
    description: ClassVar[str] = "Synthetic small additions ('3+4=' -> '7') with held-out test prompts; the CPU quickstart's task."
    Options: ClassVar[type[BaseModel]] = ArithmeticOptions

    def load(self, *, split: str, options: BaseModel, seed: int = 0) -> list[dict[str, Any]]:
        options = _options(options)
        if split not in self.splits:
            raise UserError(f"The arithmetic task has splits {', '.join(self.splits)}; got {split!r}.")
        count = options.num_examples if split == "train" else options.num_test_examples
        return generate(
            split=split,
            seed=seed if options.seed is None else options.seed,
            count=count,
            low=options.min_operand,
            high=options.max_operand,
            operation=options.operation,
            test_fraction=options.test_fraction,
            max_sum=options.max_sum,
        )

    def prepare_example(self, record: Mapping[str, Any], *, options: BaseModel, where: str = "row") -> dict[str, Any]:
        """An example from a raw row (``question`` like ``3+4=``, ``answer`` digits)."""
        question = require_text(record, "question", where)
        answer = record.get("answer")
        if isinstance(answer, int) and not isinstance(answer, bool):
            answer = str(answer)
        else:
            answer = require_text(record, "answer", where).strip()
        if not re.fullmatch(r"[0-9]+", answer):
            raise UserError(f"{where}: the 'answer' of an arithmetic example must be a non-negative integer, got {answer!r}")
        return {"question": question, "answer": answer}

    def prompt_messages(self, example: Mapping[str, Any], *, options: BaseModel) -> list[dict[str, str]]:
        return [{"role": "user", "content": str(example["question"])}]

    def uses_chat_template(self, *, options: BaseModel) -> bool:
        return _options(options).chat_template

    def reward_functions(self, *, options: BaseModel) -> dict[str, RewardFn]:
        scale = _scale(_options(options))

        def make(name: str) -> RewardFn:
            def reward(completion: str, example: Mapping[str, Any]) -> float:
                return arithmetic_rewards(completion, str(example["answer"]), scale=scale)[name]

            reward.__name__ = name
            return reward

        return {name: make(name) for name in DEFAULT_WEIGHTS}

    def reward_weights(self, *, options: BaseModel) -> dict[str, float]:
        return dict(_options(options).reward_weights)

    def is_correct(self, reward_values: Mapping[str, float], *, options: BaseModel) -> bool:
        return reward_values.get("correct", 0.0) >= 1.0
