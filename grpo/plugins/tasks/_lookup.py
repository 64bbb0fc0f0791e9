"""``lookup``: find the value stored under a key, which only the ``lookup`` tool knows —
the tools quickstart's task.

A seeded random table maps ``num_keys`` distinct keys (``key_digits`` digits each) to
values (``value_digits`` digits each), drawn independently: nothing in a key says
anything about its value. The prompt asks ``"What is the value of 37?"``; the task's one
tool, ``lookup(key)``, returns the value (an unknown key raises, which the tool environment
answers with an error message and counts). The ideal trajectory is two model turns::

    <tool_call>\\n{"name": "lookup", "arguments": {"key": "37"}}\\n</tool_call>
    (tool: 52)
    52

A share ``test_fraction`` of the keys is held out: ``train`` asks only the others,
``test`` only those (the table is the same, only the keys asked differ). A policy could
memorise the values of its training keys; on held-out keys only a call answers.

Rewards (each in [0, 1]). ``completion`` is the model's last turn; ``example["messages"]``
the whole trajectory (a single-turn scoring, e.g. ``grpo task score``, sees the
completion alone, as the trajectory's only model turn).

- ``correct``: 1 when the last model turn, whitespace removed, is exactly the value.
- ``prefix``: 1 when the last model turn's leading digits are exactly the value, whatever
  follows: credit for the right value before the policy has learnt to end its turn
  (weight 0.5, as the arithmetic task's ``prefix``).
- ``call``: shaping for a random policy, which never writes a whole call by chance: the
  share of the ideal call's parts — ``<tool_call>``, the JSON up to the key's opening
  quote, each character of the asked key, the JSON's closing ``"}}``, ``</tool_call>`` —
  that the first model turn starts with, in order (whitespace between the parts
  tolerated); a key character that is another digit earns half its part. Each part it
  gets right raises the reward, so GRPO's group advantage can climb the call one token at
  a time: a random policy writes the right key digit once in ~300 samples (the tiny
  vocabulary) but some digit once in ~30, and among digits the right one once in 10.
  Weight 0.5 by default; 0 turns it off (it is still logged).
- ``answer``: shaping for the turn after the tool's reply: 1 when the trajectory has a
  tool reply and the last model turn starts with as many digits as a value has (0.5 for
  a digit run of another length). Without it, a policy that has learnt to open every turn
  with a call (the first turn's rewarded start) rarely tries a digit after the reply.
  Weight 0 by default.

What the shaping does and does not do (measured with configs/quickstart_tools.yaml, a
random 2-layer 64-wide model, 16 samples x 8 prompts a step, on CPU): the call's fixed
parts are learnt first (``<tool_call>`` by step ~30, the JSON by ~90) and every sample
calls by step ~180-260; with the half credit for another digit the policy settles on one
constant key, with entropy collapsing, so held-out pass@1 stays at 0.05-0.10 after 400
steps; with no credit for another digit (exact key digits only) no key digit was learnt in
350 steps (``call`` stuck at 2/6). Copying the asked key into the call is the part GRPO
from scratch learns slowest, as the arithmetic task's ``copy`` check is.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar, Mapping

from pydantic import BaseModel, Field, field_validator, model_validator

from grpo.core.contracts import PluginOptions, RewardFn, TaskPlugin, ToolFn
from grpo.core.errors import UserError
from grpo.plugins.tasks._common import coerce_options, merge_weights, require_text

DEFAULT_WEIGHTS: dict[str, float] = {"correct": 1.0, "prefix": 0.5, "call": 0.5, "answer": 0.0}
_LEADING_DIGITS = re.compile(r"[0-9]*")


class LookupOptions(PluginOptions):
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Seed of the table and the examples; none = the run's seed.")
    num_keys: int = Field(100, ge=2, le=100_000, description="Keys in the table (at most 10**key_digits).")
    key_digits: int = Field(2, ge=1, le=8, description="Digits of a key.")
    value_digits: int = Field(2, ge=1, le=8, description="Digits of a value.")
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of the keys held out for the test split; training never asks them."
    )
    num_examples: int = Field(2000, ge=1, le=10_000_000, description="Training examples to draw (keys repeat).")
    num_test_examples: int = Field(200, ge=1, le=10_000_000, description="Test examples: up to this many distinct held-out keys.")
    reward_weights: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_WEIGHTS),
        description="Weight of each reward in the total (correct, prefix, call, answer); unnamed ones keep their defaults.",
    )

    @field_validator("reward_weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        return merge_weights(value, DEFAULT_WEIGHTS)

    @model_validator(mode="after")
    def _fits(self):
        if self.num_keys > 10**self.key_digits:
            raise ValueError(f"num_keys={self.num_keys} exceeds the {10**self.key_digits} keys of {self.key_digits} digit(s)")
        return self


def _options(options: Any) -> LookupOptions:
    return coerce_options(LookupOptions, options)


def make_table(*, seed: int, num_keys: int, key_digits: int, value_digits: int) -> dict[str, str]:
    """key -> value, deterministic in the arguments; keys distinct, values independent."""
    rng = random.Random(f"grpo.lookup/{seed}/table")
    keys = rng.sample(range(10**key_digits), num_keys)
    return {f"{k:0{key_digits}d}": f"{rng.randrange(10**value_digits):0{value_digits}d}" for k in keys}


def split_keys(table: Mapping[str, str], *, seed: int, test_fraction: float) -> tuple[list[str], list[str]]:
    """(train keys, held-out keys): a seeded share ``test_fraction`` held out, at least one each."""
    keys = sorted(table)
    random.Random(f"grpo.lookup/{seed}/holdout").shuffle(keys)
    n_test = min(max(1, round(test_fraction * len(keys))), len(keys) - 1)
    return keys[n_test:], keys[:n_test]


def make_lookup_tool(table: Mapping[str, str]) -> ToolFn:
    """The ``lookup`` tool over ``table``. Its docstring is its schema's description (the
    tiny tokenizer holds the rendered schema as one token: keep the two in step)."""
    table = dict(table)

    def lookup(key: str) -> str:
        """The value stored under a key.

        Args:
            key: The key.
        """
        try:
            return table[str(key).strip()]
        except KeyError:
            raise KeyError(f"no key {key!r} in the table") from None

    return lookup


_CALL_OPEN = (r"\s*<tool_call>", r'\s*\{\s*"name"\s*:\s*"lookup"\s*,\s*"arguments"\s*:\s*\{\s*"key"\s*:\s*"')
_CALL_CLOSE = (r'"\s*\}\s*\}', r"\s*</tool_call>")


def call_progress(turn: str, key: str) -> float:
    """The credit of ``turn`` for starting with the ideal lookup call of ``key`` (see the
    module docstring): one part for each of the call's fixed parts matched in order, and
    for each of the key's characters one part when it is right, half when it is another
    digit, over the number of parts."""
    total = len(_CALL_OPEN) + len(key) + len(_CALL_CLOSE)
    pos, credit = 0, 0.0
    for part in _CALL_OPEN:
        match = re.compile(part).match(turn, pos)
        if match is None:
            return credit / total
        pos, credit = match.end(), credit + 1
    written = turn[pos:pos + len(key)]
    credit += sum(1.0 if ch == want else 0.5 if ch.isdigit() else 0.0 for ch, want in zip(written, key))
    if len(written) < len(key) or not written.isdigit():
        return credit / total
    pos += len(key)
    for part in _CALL_CLOSE:
        match = re.compile(part).match(turn, pos)
        if match is None:
            break
        pos, credit = match.end(), credit + 1
    return credit / total


def _model_turns(completion: str, example: Mapping[str, Any]) -> list[str]:
    turns = [str(m.get("content") or "") for m in example.get("messages") or () if m.get("role") == "assistant"]
    return turns or [completion]


class LookupTask(TaskPlugin):
    name: ClassVar[str] = "lookup"
    description: ClassVar[str] = (
        "Synthetic key -> value lookup whose values only the `lookup` tool knows, held-out keys in the test split; "
        "the tools quickstart's task."
    )
    Options: ClassVar[type[BaseModel]] = LookupOptions

    def _table(self, options: LookupOptions, seed: int) -> dict[str, str]:
        return make_table(seed=seed, num_keys=options.num_keys, key_digits=options.key_digits,
                          value_digits=options.value_digits)

    def load(self, *, split: str, options: BaseModel, seed: int = 0) -> list[dict[str, Any]]:
        options = _options(options)
        if split not in self.splits:
            raise UserError(f"The lookup task has splits {', '.join(self.splits)}; got {split!r}.")
        seed = seed if options.seed is None else options.seed
        table = self._table(options, seed)
        train, test = split_keys(table, seed=seed, test_fraction=options.test_fraction)
        if split == "train":
            rng = random.Random(f"grpo.lookup/{seed}/train")
            keys = [rng.choice(train) for _ in range(options.num_examples)]
        else:
            keys = test[:options.num_test_examples]
        return [{"key": k, "value": table[k], "seed": seed, "split": split, "index": i} for i, k in enumerate(keys)]

    def prepare_example(self, record: Mapping[str, Any], *, options: BaseModel, where: str = "row") -> dict[str, Any]:
        """An example from a raw row: ``key`` and ``value`` digit strings."""
        example = dict(record)
        for field in ("key", "value"):
            text = require_text(record, field, where).strip()
            if not text.isdigit():
                raise UserError(f"{where}: the {field!r} of a lookup example must be digits, got {text!r}")
            example[field] = text
        return example

    def prompt_messages(self, example: Mapping[str, Any], *, options: BaseModel) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"What is the value of {example['key']}?"}]

    def tools(self, *, options: BaseModel) -> dict[str, ToolFn]:
        """``lookup`` over the table of the options' seed (the run's seed when unset: the
        engine passes examples from :meth:`load`, whose ``seed`` field names the table)."""
        options = _options(options)
        return {"lookup": make_lookup_tool(self._table(options, options.seed or 0))}

    def environment(self, example, *, options, tool_format, timeout_s=10.0):
        """The built-in tool environment, over the table the example was drawn from."""
        from grpo.plugins.tools import ToolEnvironment

        opts = _options(options)
        seed = int(example.get("seed", opts.seed or 0))
        return ToolEnvironment(
            tools={"lookup": make_lookup_tool(self._table(opts, seed))}, format=tool_format,
            opening=self.prompt_messages(example, options=options), timeout_s=timeout_s,
        )

    def reward_functions(self, *, options: BaseModel) -> dict[str, RewardFn]:
        def correct(completion: str, example: Mapping[str, Any]) -> float:
            return 1.0 if "".join(completion.split()) == str(example["value"]) else 0.0

        def prefix(completion: str, example: Mapping[str, Any]) -> float:
            run = _LEADING_DIGITS.match("".join(completion.split())).group(0)  # type: ignore[union-attr]
            return 1.0 if run == str(example["value"]) else 0.0

        def call(completion: str, example: Mapping[str, Any]) -> float:
            return call_progress(_model_turns(completion, example)[0], str(example["key"]))

        def answer(completion: str, example: Mapping[str, Any]) -> float:
            if not any(m.get("role") == "tool" for m in example.get("messages") or ()):
                return 0.0
            run = _LEADING_DIGITS.match(completion.strip()).group(0)  # type: ignore[union-attr]
            return 1.0 if len(run) == len(str(example["value"])) else 0.5 if run else 0.0

        return {"correct": correct, "prefix": prefix, "call": call, "answer": answer}

    def reward_weights(self, *, options: BaseModel) -> dict[str, float]:
        return dict(_options(options).reward_weights)

    def is_correct(self, reward_values: Mapping[str, float], *, options: BaseModel) -> bool:
        return reward_values.get("correct", 0.0) >= 1.0
