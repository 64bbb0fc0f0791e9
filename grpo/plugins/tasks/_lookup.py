"""``lookup``: find the value stored under a key, which only the ``lookup`` tool knows —
the tools quickstart's task.

A seeded random table maps ``num_keys`` distinct keys to values, drawn independently:
nothing in a key says anything about its value. A key has ``key_digits`` digits, or one
character of each of ``key_alphabets`` (``["ABCDEFGHIJ", "0123456789"]`` makes keys like
``C7``); a value has ``value_digits`` characters of ``value_alphabet`` (digits by
default). The prompt is ``question`` with the key (``"What is the value of 37?"``); the
task's one tool, ``lookup(key)``, returns the value written through ``reply`` (``"{value}"``
by default; an unknown key raises, which the tool environment answers with an error
message and counts). The ideal trajectory is two model turns::

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
- ``prefix``: 1 when the last model turn's leading run of value characters is exactly the
  value, whatever follows: credit for the right value before the policy has learnt to
  end its turn (weight 0.5, as the arithmetic task's ``prefix``).
- ``call``: shaping for a random policy, which never writes a whole call by chance: the
  share of the ideal call's parts — ``<tool_call>``, the JSON up to the key's opening
  quote, each character of the asked key, the JSON's closing ``"}}``, ``</tool_call>`` —
  that the first model turn starts with, in order (whitespace between the parts
  tolerated). A key character earns its whole part when right, ``misplaced_credit`` when
  it is another character of the asked key, ``other_credit`` when it is another character
  of its position's alphabet; the closing parts count after a key written in its
  alphabets (``strict_call``: only after exactly the asked key). Weight 0.5 by default;
  0 turns it off (it is still logged).
- ``answer``: 1 when the last model turn starts with the value in the last tool reply
  (whatever key was asked): credit for reading the tool's answer, which varies with the
  trajectory, so it cannot be earned by a constant answer. Weight 0 by default.

What GRPO learns from these (measured on CPU with configs/quickstart_tools.yaml's random
2-layer 64-wide model, 16 samples x 8 prompts a step, ~0.25-0.3 s a step alone on 2
cores, so 300 s is ~1,000 steps):

- Any credit that a constant key earns on most prompts — ``other_credit`` 0.05-0.5, and
  ``answer`` (a constant key gets a constant reply to repeat) — makes the key collapse
  onto one constant (``"72"``, ``"82"``, ``"G2"``, ``"D4"``, ``"B5"``) within ~100 steps
  of the credit starting to pay, entropy falling to ~0.002 as the call's format locks in;
  held-out pass@1 stays at 0-0.15. ``misplaced_credit`` (a prompt-specific credit)
  teaches a copy by content, but settles on writing the same key character twice
  (``"DD"`` for ``"D0"``, ``"22"`` for ``"A2"``).
- Without such credit (``other_credit`` 0, ``misplaced_credit`` 0), only exact key
  characters pay, found by chance (~1 sample in 300). With digit keys, a bare
  ``question: "{key}"``, ``strict_call`` or a 128-wide model, none was learnt in 400-570
  steps (``call`` stuck at 2/6): the first turn ran to the token budget, and ~16 untrained
  tokens after the key carried each sample's advantage too.
- Keys of a letter and a digit (``key_alphabets: [ABCDEFGHIJ, "0123456789"]``,
  ``value_alphabet: abcdefghij``: each key character and the value is the only one of its
  kind in the context) with turns capped at the call's 6 tokens
  (``rollout.max_turn_tokens: 6``), lr 2e-3, entropy 0.1: the letter is copied by step
  ~550, then the digit, and calls close and repeat the reply from ~1100 steps. With
  ``answer`` 0.5 the key then collapsed (onto ``"B5"``) at ~1400 steps; with ``answer``
  0, held-out pass@1 was 0.65 at 1,750 and 2,000 steps, 0.70 at 2,250, 0.55 at 2,500.
  lr 4e-3: no key character in 1,000 steps; 32 samples a prompt: the letter by ~470
  steps, at twice the step's cost.
- Repeating what is copied (``question: "{key} {key} {key} {key}"``, ``reply: "{value}
  {value} {value} {value}"``): a random 2-layer model attends diffusely, so a token that
  is a larger share of the context is copied by chance more often. With entropy 0.05,
  calls closed by ~500-800 steps (eight copies of the key: ~450), but groups then
  turned deterministic on a wrong key or value character (no advantage within the group)
  and held-out pass@1 levelled at 0.4 (steps 1,250-1,750, four or eight copies). Entropy
  0.05 with the key and value once: the answer collapsed onto one constant letter; 26
  values (a-z) slowed that (pass@1 0.2 at 1,200 steps). Entropy 0.1 with four copies
  learnt the key no sooner than with one.
- Eight copies of the key, four of the value, entropy 0.05 and sampling temperature 1.5
  (configs/quickstart_tools.yaml; the loss reads the same tempered policy, so a
  deterministic group takes larger logits): held-out pass@1 0.6 at 1,250 and 1,500 steps,
  0.8 at 1,750, 0.7 at 2,000 (temperature 1.5 with four copies: 0.45 from 1,250 to 1,750).

- Turn-level credit (``train.advantage.credit: turn``: ``call`` moves only the call's
  tokens, ``answer`` only the answer's; ``correct`` and ``prefix`` every turn) on the
  shipped config: with ``answer`` 0 it changes little (calls by ~600 steps, held-out
  pass@1 0.05 at 900); with ``answer`` 0.5 and entropy 0.05 the answer collapsed onto
  one constant letter within ~40 steps of the calls closing (entropy 0.01, pass@1 0.05);
  with ``answer`` 0.5 and entropy 0.1 the reply is copied without collapse (``answer``
  0 -> 0.93 in ~700 steps, 1.0 by 1,900) but the calls close later (~800 steps): pass@1
  0.2 at 900, 0.4 at 1,000, 0.55 at 1,200, 0.6 at 1,400-1,700, 0.75 at 1,800-2,000,
  with ~30% of the training calls' keys still wrong (``correct`` 0.70). The same with a
  one-layer model: 0.2 at 1,200. The key's copy, not the reply's, is what is slow.

- Two dead ends of the tiny tokenizer, found from the held-out keys that failed: its merged
  words make tokens such as ``"Answ"``, ``"Co"``, ``"as"`` and ``" is"``. ``"Answ"`` in the
  key earns the credit of an ``A`` and can never be followed by a digit, ``" is"`` as the
  answer earns ``prefix`` for an ``i``: with keys ``A0``-``J9`` and values ``a``-``j``,
  every group of a key with ``A`` settled on ``"Answ"`` and 7 of the 20 held-out keys
  could not be answered (pass@1 at most 0.65, which is where the runs above levelled).
  Keys of ``BDEFGHIJKL`` and values of ``bcdefghjkl`` begin no merged token. And with the
  call's closing JSON and ``</tool_call>`` two tokens, some runs repeated the closing JSON
  where the tag goes (a random model's next token leans to its current one) until every
  sample wrote the same unclosed call (``call`` 5/6 on every row, entropy 0.005); the tiny
  tokenizer now holds them as one token (a five-token call).
- PODS down-sampling (``train.down_sampling.keep``; configs/quickstart_tools.yaml): with
  those alphabets and 32 samples of each prompt, the 8 of largest reward variance trained
  on (seed 0; two runs at a time on one core each, so only steps compare): calls close by
  ~400 steps and held-out pass@1 is 0.75 at 700-900 steps, 0.8 at 1,000 (16 samples, all
  trained on: 0.15 at 900, 0.45 at 1,200). 16 kept of 32: 0.85 at 1,000 but 0.75 at
  1,100, the entropy at 0.002; 8 of 16: the key collapsed onto constants for ~150 steps
  (0.05 at 800). 8 of 64: keys exact on every training prompt by step 500, then the
  answer turn collapsed onto ``<tool_call>`` (the call's tokens, credited with the whole
  trajectory's advantage, pulled the second turn's first token along; pass@1 0); with
  seed 1 the same config reached 0.85 at step 500. With turn credit (``call`` moving only
  the call's tokens) 8 of 64 never collapsed but levelled lower: 0.65 at 600, 0.6 at 800
  (seed 1: 0.35). The shipped config with turn credit: 0.9 at 600-800 steps on one core,
  but 0.05 with seed 1 (the answer collapsed) and 0.55 at 800-1,000 alone on 2 cores (a
  run's numerics, so its curve, differ with the core count). Sampling temperature 2.0: the
  keys exact by 900 steps, then the answer turn collapsed onto ``<tool_call>`` (seed 1:
  0.1). The shipped config with seed 1: 0.35 at 1,000, the failures mostly keys
  whose letter is copied as another (``D`` as ``G``, ``K`` as ``H``). The answer's and the
  key's copies are both found, then kept or lost, by chance: the runs are fast but not
  robust to the seed.
- The entropy bonus decides that (PODS 8 of 32, one core per run unless said, 800
  steps, seeds 0 / 1): once the call's format is learnt, entropy falls from ~0.5 to ~0.02
  within ~100 steps, and a letter then copied as another stays so (its group all alike).
  0.05: 0.75 / 0.35 (above); 0.1: 1.0 at 600 / 0.7 (``K`` called as ``L``, values ``d``
  answered as ``g``, ``f``, ``b``); 0.15: 1.0 at 700 / 0.65; 0.2: 0.85 / 1.0 at 700.
  With 2-core numerics (``train.seed`` 0, 1, 2, 3, 4; each run's numerics depend on the
  threads XLA uses, not on the load, so two 2-core runs at a time follow the curve of one
  alone): 0.1 gave 0.9 / 0.55 (seeds 0 / 1); 0.2 gave 1.0 by step 800 with seeds 0-2, 1.0 at 900
  with seed 3, 0.75 at 800 and 0.9 at 900-1,000 with seed 4 (calls close
  ~100 steps later than with 0.05, then the keys and answers are learnt together in
  ~250 steps). MHA instead of GQA (``num_key_value_heads: 4``, entropy 0.1): 0.9 / 0.75,
  ``K`` still called as ``L``: not the copy's width. configs/quickstart_tools.yaml takes
  0.2.

The same model learns the arithmetic task's one-token ``copy`` (``"7="`` -> ``"7"``, chat
template on) in ~100 steps; copying into the third and fourth tokens of a call whose first
two tokens it learns at the same time, with one sequence-level reward for the whole
trajectory, is what it learns slowly.
"""

from __future__ import annotations

import functools
import math
import random
import re
import string
from typing import Any, ClassVar, Mapping

from pydantic import BaseModel, Field, field_validator, model_validator

from grpo.core.contracts import PluginOptions, RewardFn, TaskPlugin, ToolFn
from grpo.core.errors import UserError
from grpo.plugins.tasks._common import coerce_options, merge_weights, require_text

DEFAULT_WEIGHTS: dict[str, float] = {"correct": 1.0, "prefix": 0.5, "call": 0.5, "answer": 0.0}
DIGITS = "0123456789"


def _radix(index: int, alphabets: list[str] | tuple[str, ...]) -> str:
    """``index`` written in the mixed radix of ``alphabets`` (the first most significant)."""
    chars = []
    for alphabet in reversed(alphabets):
        index, rest = divmod(index, len(alphabet))
        chars.append(alphabet[rest])
    return "".join(reversed(chars))


def _key_alphabets(key_alphabets: list[str] | tuple[str, ...] | None, key_digits: int) -> tuple[str, ...]:
    """One alphabet per key character: ``key_alphabets``, or ``key_digits`` digit alphabets."""
    return tuple(key_alphabets or [DIGITS] * key_digits)


def _fits(text: str, alphabets: tuple[str, ...]) -> bool:
    """Whether ``text`` has one character of each of ``alphabets``, in order."""
    return len(text) == len(alphabets) and all(ch in a for ch, a in zip(text, alphabets))


def _spell(alphabets: tuple[str, ...], *, counted: bool) -> str:
    """How an error message names the strings of ``alphabets``: "2 digits", "characters
    of 'AB', '01'" (``counted``: with their number)."""
    count = f"{len(alphabets)} " if counted else ""
    if set(alphabets) == {DIGITS}:
        return count + "digits"
    return count + "characters of " + ", ".join(repr(a) for a in dict.fromkeys(alphabets))


def _leading(text: str, alphabet: str) -> str:
    """The leading run of ``text`` (whitespace removed) over ``alphabet``."""
    text = "".join(text.split())
    end = 0
    while end < len(text) and text[end] in alphabet:
        end += 1
    return text[:end]


class LookupOptions(PluginOptions):
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Seed of the table and the examples; none = the run's seed.")
    num_keys: int = Field(100, ge=2, le=100_000, description="Keys in the table (at most 10**key_digits).")
    key_digits: int = Field(2, ge=1, le=8, description="Digits of a key.")
    value_digits: int = Field(2, ge=1, le=8, description="Characters of a value.")
    key_alphabets: list[str] | None = Field(
        None, min_length=1, max_length=8,
        description="One alphabet per key character (e.g. ['ABCDEFGHIJ', '0123456789']); none = key_digits digits.",
    )
    value_alphabet: str = Field(DIGITS, min_length=2, description="The characters of values.")
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of the keys held out for the test split; training never asks them."
    )
    num_examples: int = Field(2000, ge=1, le=10_000_000, description="Training examples to draw (keys repeat).")
    num_test_examples: int = Field(200, ge=1, le=10_000_000, description="Test examples: up to this many distinct held-out keys.")
    question: str = Field(
        "What is the value of {key}?", description="The user message; {key} stands for the key.",
    )
    reply: str = Field(
        "{value}", description="What the `lookup` tool returns; {value} stands for the value (e.g. '{value} {value}').",
    )
    other_credit: float = Field(
        0.5, ge=0.0, le=1.0,
        description="The `call` reward's credit for a key character of its position's alphabet that is not the asked one "
                    "(the right one earns 1).",
    )
    misplaced_credit: float = Field(
        0.5, ge=0.0, le=1.0,
        description="The `call` reward's credit for a key character that is another of the asked key's characters.",
    )
    strict_call: bool = Field(
        False, description="The `call` reward credits the call's closing parts only after exactly the asked key.",
    )
    reward_weights: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_WEIGHTS),
        description="Weight of each reward in the total (correct, prefix, call, answer); unnamed ones keep their defaults.",
    )

    @field_validator("reward_weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        return merge_weights(value, DEFAULT_WEIGHTS)

    @field_validator("key_alphabets", "value_alphabet")
    @classmethod
    def _alphabets(cls, value):
        for alphabet in [value] if isinstance(value, str) else value or ():
            if len(set(alphabet)) != len(alphabet) or not alphabet.isalnum() or not alphabet.isascii():
                raise ValueError(f"an alphabet must be distinct ASCII letters or digits, got {alphabet!r}")
        return value

    @field_validator("question", "reply")
    @classmethod
    def _template(cls, value: str, info):
        field = "key" if info.field_name == "question" else "value"
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        except ValueError as e:
            raise ValueError(f"not a format template ({e}): {value!r}") from None
        if names != {field}:
            raise ValueError(f"the template must use {{{field}}} and nothing else, got {value!r}")
        return value

    @property
    def alphabets(self) -> tuple[str, ...]:
        return _key_alphabets(self.key_alphabets, self.key_digits)

    @model_validator(mode="after")
    def _fits(self):
        space = math.prod(len(a) for a in self.alphabets)
        if self.num_keys > space:
            raise ValueError(f"num_keys={self.num_keys} exceeds the {space} possible keys")
        return self


@functools.lru_cache(maxsize=16)
def _cached_table(seed: int, num_keys: int, alphabets: tuple[str, ...], value_digits: int,
                  value_alphabet: str) -> dict[str, str]:
    # Shared: callers must not edit it (LookupTask._table hands out copies).
    return make_table(seed=seed, num_keys=num_keys, key_alphabets=alphabets, value_digits=value_digits,
                      value_alphabet=value_alphabet)


@functools.lru_cache(maxsize=16)
def _cached_tool(seed: int, num_keys: int, alphabets: tuple[str, ...], value_digits: int, value_alphabet: str,
                 reply: str) -> ToolFn:
    return make_lookup_tool(_cached_table(seed, num_keys, alphabets, value_digits, value_alphabet), reply)


def _options(options: Any) -> LookupOptions:
    return coerce_options(LookupOptions, options)


def make_table(*, seed: int, num_keys: int, key_digits: int = 2, value_digits: int = 2,
               key_alphabets: list[str] | tuple[str, ...] | None = None, value_alphabet: str = DIGITS) -> dict[str, str]:
    """key -> value, deterministic in the arguments; keys distinct, values independent.
    A key has one character of each of ``key_alphabets`` (default: ``key_digits`` digits);
    a value ``value_digits`` characters of ``value_alphabet``."""
    alphabets = _key_alphabets(key_alphabets, key_digits)
    rng = random.Random(f"grpo.lookup/{seed}/table")
    keys = rng.sample(range(math.prod(len(a) for a in alphabets)), num_keys)
    values = [value_alphabet] * value_digits
    return {_radix(k, alphabets): _radix(rng.randrange(len(value_alphabet) ** value_digits), values) for k in keys}


def split_keys(table: Mapping[str, str], *, seed: int, test_fraction: float) -> tuple[list[str], list[str]]:
    """(train keys, held-out keys): a seeded share ``test_fraction`` held out, at least one each."""
    keys = sorted(table)
    random.Random(f"grpo.lookup/{seed}/holdout").shuffle(keys)
    n_test = min(max(1, round(test_fraction * len(keys))), len(keys) - 1)
    return keys[n_test:], keys[:n_test]


def make_lookup_tool(table: Mapping[str, str], reply: str = "{value}") -> ToolFn:
    """The ``lookup`` tool over ``table``, answering ``reply`` with the value. Its docstring
    is its schema's description (the tiny tokenizer holds the rendered schema as one token:
    keep the two in step)."""
    table = dict(table)

    def lookup(key: str) -> str:
        """The value stored under a key.

        Args:
            key: The key.
        """
        try:
            value = table[str(key).strip()]
        except KeyError:
            raise KeyError(f"no key {key!r} in the table") from None
        return reply.format(value=value)

    return lookup


_CALL_OPEN = tuple(map(re.compile, (
    r"\s*<tool_call>", r'\s*\{\s*"name"\s*:\s*"lookup"\s*,\s*"arguments"\s*:\s*\{\s*"key"\s*:\s*"')))
_CALL_CLOSE = tuple(map(re.compile, (r'"\s*\}\s*\}', r"\s*</tool_call>")))


def call_progress(turn: str, key: str, other: float = 0.5, misplaced: float = 0.5, strict: bool = False,
                  alphabets: tuple[str, ...] | None = None) -> float:
    """The credit of ``turn`` for starting with the ideal lookup call of ``key`` (see the
    module docstring): one part for each of the call's fixed parts matched in order, and
    for each of the key's characters one part when it is right, ``misplaced`` when it is
    another character of the key, ``other`` when it is another character of its position's
    alphabet (``alphabets``, digits by default), over the number of parts. The closing
    parts count only after a key written wholly in its alphabets (``strict``: exactly the
    asked key)."""
    total = len(_CALL_OPEN) + len(key) + len(_CALL_CLOSE)
    pos, credit = 0, 0.0
    for part in _CALL_OPEN:
        match = part.match(turn, pos)
        if match is None:
            return credit / total
        pos, credit = match.end(), credit + 1
    written = turn[pos:pos + len(key)]
    alphabets = alphabets or (DIGITS,) * len(key)
    credit += sum(1.0 if ch == want else misplaced if ch in key else other if ch in alphabet else 0.0
                  for ch, want, alphabet in zip(written, key, alphabets))
    if not _fits(written, alphabets) or (strict and written != key):
        return credit / total
    pos += len(key)
    for part in _CALL_CLOSE:
        match = part.match(turn, pos)
        if match is None:
            break
        pos, credit = match.end(), credit + 1
    return credit / total


def _reply_pattern(reply: str, alphabet: str) -> re.Pattern[str]:
    """What a tool message written by the template ``reply`` matches in full (stripped),
    its first group the value (every ``{value}`` the same run of ``alphabet``)."""
    head, _, tail = reply.strip().partition("{value}")
    return re.compile(re.escape(head) + f"([{re.escape(alphabet)}]+)" + re.escape(tail).replace(r"\{value\}", r"\1"))


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
        return dict(_cached_table(seed, options.num_keys, options.alphabets, options.value_digits,
                                  options.value_alphabet))

    def _tool(self, options: LookupOptions, seed: int) -> ToolFn:
        """The ``lookup`` tool of the table of ``seed``: one function object per table and
        reply (every rollout row's environment shares it, and its schema is parsed once)."""
        return _cached_tool(seed, options.num_keys, options.alphabets, options.value_digits, options.value_alphabet,
                            options.reply)

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
        """An example from a raw row: a ``key`` of one character of each key alphabet, and a
        ``value`` over the value alphabet (digits by default)."""
        opts = _options(options)
        example = dict(record)
        for field in ("key", "value"):
            text = require_text(record, field, where).strip()
            # A value may have any length: its alphabet once per character it has.
            want = opts.alphabets if field == "key" else (opts.value_alphabet,) * max(1, len(text))
            if not _fits(text, want):
                raise UserError(f"{where}: the {field!r} of a lookup example must be {_spell(want, counted=field == 'key')}, got {text!r}")
            example[field] = text
        return example

    def prompt_messages(self, example: Mapping[str, Any], *, options: BaseModel) -> list[dict[str, str]]:
        return [{"role": "user", "content": _options(options).question.format(key=example["key"])}]

    def tools(self, *, options: BaseModel) -> dict[str, ToolFn]:
        """``lookup`` over the table of the options' seed (the run's seed when unset: the
        engine passes examples from :meth:`load`, whose ``seed`` field names the table)."""
        options = _options(options)
        return {"lookup": self._tool(options, options.seed or 0)}

    def environment(self, example, *, options, tool_format, timeout_s=10.0):
        """The built-in tool environment, over the table the example was drawn from."""
        from grpo.engine.rollout.tools import ToolEnvironment

        opts = _options(options)
        seed = int(example.get("seed", opts.seed or 0))
        return ToolEnvironment(
            tools={"lookup": self._tool(opts, seed)}, format=tool_format,
            opening=self.prompt_messages(example, options=options), timeout_s=timeout_s,
        )

    def reward_functions(self, *, options: BaseModel) -> dict[str, RewardFn]:
        opts = _options(options)
        other, misplaced, strict = opts.other_credit, opts.misplaced_credit, opts.strict_call
        value_alphabet = opts.value_alphabet
        reply = _reply_pattern(opts.reply, value_alphabet)

        def correct(completion: str, example: Mapping[str, Any]) -> float:
            return 1.0 if "".join(completion.split()) == str(example["value"]) else 0.0

        def prefix(completion: str, example: Mapping[str, Any]) -> float:
            return 1.0 if _leading(completion, value_alphabet) == str(example["value"]) else 0.0

        def call(completion: str, example: Mapping[str, Any]) -> float:
            return call_progress(_model_turns(completion, example)[0], str(example["key"]), other, misplaced, strict, opts.alphabets)

        def answer(completion: str, example: Mapping[str, Any]) -> float:
            replies = [str(m.get("content") or "") for m in example.get("messages") or () if m.get("role") == "tool"]
            match = reply.fullmatch(replies[-1].strip()) if replies else None
            return 1.0 if match and _leading(completion, value_alphabet) == match.group(1) else 0.0

        return {"correct": correct, "prefix": prefix, "call": call, "answer": answer}

    def reward_weights(self, *, options: BaseModel) -> dict[str, float]:
        return dict(_options(options).reward_weights)

    def reward_turns(self, *, options: BaseModel) -> dict[str, str]:
        """Under turn-level credit: ``call`` scores the first model turn (the call),
        ``answer`` the last (what is done with the tool's reply); ``correct`` and ``prefix``
        are the outcome, credited to every turn that led to it."""
        return {"call": "first", "answer": "last"}

    def is_correct(self, reward_values: Mapping[str, float], *, options: BaseModel) -> bool:
        return reward_values.get("correct", 0.0) >= 1.0
