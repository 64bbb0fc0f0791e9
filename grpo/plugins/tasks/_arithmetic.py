"""``arithmetic``: small additions generated from a seed — the quickstart's task.

A prompt is the bare sum, ``"3+4="`` (one user message; with no chat template the
rendered prompt is exactly that), and the ideal completion is the answer alone,
``"7"``, then end-of-sequence. Examples are generated on the fly and need no download:
``num_examples`` training and ``num_test_examples`` test additions of two operands drawn
uniformly from ``[min_operand, max_operand]`` by a generator seeded with ``seed`` (the
run's seed when unset) and the split name, so a split is the same on every run and host.

Rewards (each in [0, 1]). The completion is read with all whitespace removed, because a
word-level tokenizer decodes ``1``, ``2`` as ``"1 2"``; its *leading digit run* is the
model's answer.

- ``format``: 1 when the completion is only digits, 0.5 when it starts with digits and
  then goes on (it did not stop), else 0.
- ``length``: 1 when the digit run has as many digits as the true answer.
- ``close``: ``max(0, 1 - |answer - truth| / S)`` with ``S = max_operand - min_operand + 1``
  (10 for single digits): partial credit for being near.
- ``correct``: 1 when the completion is exactly the answer.

Why GRPO alone can learn this from a random initialisation
-----------------------------------------------------------
GRPO learns only from reward differences *within* a group of completions of one prompt;
a sparse exact-match reward gives a random model groups of all-zero rewards (zero
advantage, no gradient) almost every step. This reward is shaped so that the gradient
is never empty and always points towards the exact answer:

1. ``format`` and ``length`` do not depend on the operands. A random model already puts
   some probability on digit tokens and on stopping, so in a group of 8 some completions
   score and some do not: from the first step the model learns to answer with a short
   digit string and stop. Completions are 1-2 tokens, so credit assignment is trivial.
2. ``close`` is dense and monotone in the distance to the truth. Once the model emits
   numbers, two completions of one prompt almost always differ in distance, so the
   advantage pushes probability towards the nearer one — first towards the typical sum,
   then, as the operands' tokens start to matter, towards each prompt's own sum. The
   first digit of a two-digit answer is rewarded through ``close`` too.
3. Every shaping term is maximised by the exact answer, so no term can be gamed at the
   expense of ``correct`` (a right-length wrong number still loses ``close`` and
   ``correct``); ``correct`` adds the last step from "near" to "exact".
4. The function to learn is tiny: with single-digit operands there are 100 prompts of 4
   tokens and 19 possible answers, well within a 2-layer, 64-wide transformer.

What limits progress is not the reward but exploration: once the model answers with
one confident number, groups stop varying and GRPO's signal thins out. A smaller range
(``max_operand: 4``: 25 prompts, one-digit answers) gets to above-chance accuracy
soonest and is the better choice for a short CPU demo.
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
from grpo.plugins.tasks._common import merge_weights, require_text

DEFAULT_WEIGHTS: dict[str, float] = {"correct": 1.0, "prefix": 0.0, "close": 0.5, "length": 0.25, "format": 0.25}

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
    if isinstance(options, ArithmeticOptions):
        return options
    if options is None or isinstance(options, Mapping):
        return ArithmeticOptions.model_validate(dict(options or {}))
    raise TypeError(f"expected ArithmeticOptions, got {type(options).__name__}")


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
    description: ClassVar[str] = "Synthetic small additions ('3+4=' -> '7') with a shaped reward; the CPU quickstart's task."
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
