"""Rewards computed by models on the rollout devices (``task.model_rewards``).

Each entry is a batched scorer in TRL's reward-function shape, lists in and a list out::

    scorer(completions, prompts=None, **columns) -> list[float | None]

``completions`` are strings (or TRL's ``[{"role": "assistant", "content": ...}]``),
``prompts`` strings or lists of chat messages, every other dataset column a keyword list.
Two kinds:

- :class:`RewardModelScorer` (``kind: reward_model``): a ``*ForSequenceClassification``
  checkpoint in grpo's own decoder (:mod:`grpo.models.classifier`), micro-batch by
  micro-batch, its score standardised (``mean``, ``std``) and optionally squashed;
- :class:`~grpo.engine.rollout.judge.JudgeScorer` (``kind: judge``): a generative model
  through a rollout engine, its reply parsed (None: a parse failure).

Both run on this process's devices of the rollout mesh (:func:`local_mesh`: the
training mesh in a synchronous run, the rollout side's in an asynchronous one), so a
process scores its own rows and no process waits for another: every mode (sync,
async, partial rollouts, streaming) scores the same way. Several processes are refused
before start-up (:func:`grpo.core.config.validate.model_reward_process_problems`): no
test has run them there yet.

:class:`ModelRewards` holds a run's scorers, built on first use by the step's collector,
and scores a batch of rows: per reward, the values [b] (a parse failure 0) and which rows
had none (a reward model's counted as "not applicable", ``reward/<name>/not_applicable``; a judge's as
parse failures, ``reward/<name>/parse_failures``).
Every value depends on its row alone (fixed standardisation, no batch statistics), so a
reward does not change with the batching, the mode or a resume.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from grpo.core.config.rewards import JudgeConfig, RewardModelConfig
from grpo.core.errors import UserError
from grpo.engine.rollout.prompts import bucket_for, default_buckets, has_chat_template
from grpo.engine.rollout.reward_inputs import (  # noqa: F401 (local_mesh: re-exported)
    BATCH_AXES,
    completion_text,
    fill_template,
    local_mesh,
    prompt_messages,
    prompt_text,
    round_up,
    row_columns,
)

from grpo.engine.rollout.judge import JudgeScorer

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- reward model


class RewardModelScorer:
    """A reward model (``kind: reward_model``) on ``mesh`` (its parameters sharded over
    the mesh's devices by the decoder's rules, the rows of a micro-batch split over them).

    Rows longer than ``max_length`` tokens keep their last ``max_length`` (the scored
    token is the last), counted in :attr:`truncated`."""

    def __init__(self, cfg: RewardModelConfig, *, mesh: Mesh, field: str):
        from transformers import AutoTokenizer

        from grpo.models.classifier import classifier_scores, load_classifier

        self.cfg, self.name, self.field = cfg, cfg.name, field
        self.classifier = clf = load_classifier(cfg.checkpoint, mesh, dtype=cfg.dtype, where=f"{field}.checkpoint")
        if cfg.label >= clf.num_labels:
            raise UserError(f"{field}.label={cfg.label}, but the score head of {cfg.checkpoint!r} has "
                            f"{clf.num_labels} output(s); choose one below {clf.num_labels}.")
        source = cfg.tokenizer or str(clf.directory)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception as err:  # noqa: BLE001 - the user's directory
            raise UserError(f"{field}.tokenizer: could not load a tokenizer from {source!r}: "
                            f"{type(err).__name__}: {err}") from None
        pad = clf.pad_token_id if clf.pad_token_id is not None else self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)
        shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
        self.rows = round_up(cfg.micro_batch, shards)
        self.buckets = default_buckets(cfg.max_length)
        self.sharding = NamedSharding(mesh, P(BATCH_AXES))
        self._scores = jax.jit(classifier_scores, static_argnums=0, static_argnames="pad_token_id")
        self.truncated = 0

    def text(self, prompt: Any, completion: str, columns: Mapping[str, Any]) -> str:
        """The reward model's input text for one row (``template``)."""
        if self.cfg.template != "chat":
            return fill_template(self.cfg.template, prompt=prompt, completion=completion, columns=columns,
                                 where=f"{self.field}.template")
        if has_chat_template(self.tokenizer):
            messages = prompt_messages(prompt) + [{"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt_text(prompt) + completion if prompt is not None else completion

    def token_ids(self, completions: Sequence[Any], prompts: Sequence[Any] | None,
                  columns: Mapping[str, Sequence[Any]]) -> list[list[int]]:
        out = []
        for i, completion in enumerate(completions):
            text = self.text(None if prompts is None else prompts[i], completion_text(completion), row_columns(columns, i))
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) or [self.pad_id]
            if len(ids) > self.cfg.max_length:
                self.truncated += 1
                ids = ids[-self.cfg.max_length:]
            out.append(ids)
        return out

    def raw_scores(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """The score head's label ``label`` [n] float32 for token rows ``ids``."""
        clf = self.classifier
        out = np.zeros((len(ids),), np.float32)
        for start in range(0, len(ids), self.rows):
            part = ids[start:start + self.rows]
            width = bucket_for(max(len(r) for r in part), self.buckets)
            tokens = np.full((self.rows, width), self.pad_id, np.int32)
            mask = np.zeros((self.rows, width), np.int32)
            mask[:, 0] = 1  # padding rows hold one token (never read back)
            for r, row in enumerate(part):
                tokens[r, :len(row)] = row
                mask[r, :len(row)] = 1
            put = lambda x: jax.device_put(x, self.sharding)  # noqa: E731
            scores = self._scores(clf.graphdef, clf.state, clf.score, put(tokens), put(mask),
                                  pad_token_id=clf.pad_token_id)
            out[start:start + len(part)] = np.asarray(scores[:, self.cfg.label])[:len(part)]
        return out

    def normalise(self, raw: np.ndarray) -> np.ndarray:
        z = (np.asarray(raw, np.float64) - self.cfg.mean) / self.cfg.std
        if self.cfg.normalize == "sigmoid":
            z = 1.0 / (1.0 + np.exp(-z))
        elif self.cfg.normalize == "tanh":
            z = np.tanh(z)
        return z.astype(np.float32)

    def __call__(self, completions: Sequence[Any], prompts: Sequence[Any] | None = None,
                 **columns: Sequence[Any]) -> list[float]:
        if not completions:
            return []
        return [float(v) for v in self.normalise(self.raw_scores(self.token_ids(completions, prompts, columns)))]


# --------------------------------------------------------------------------- a run's


class ModelRewards:
    """A run's model rewards (``task.model_rewards``), in config order."""

    def __init__(self, scorers: Sequence[Any], weights: Mapping[str, float]):
        self.scorers = list(scorers)
        self.weights = dict(weights)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.scorers]

    @classmethod
    def build(cls, config: Any, *, mesh: Mesh, plugins: Any, taken: Sequence[str]) -> "ModelRewards | None":
        """The scorers of ``config.task.model_rewards`` on this process's devices of
        ``mesh`` (None when there are none). ``taken``: the task's reward names, which a
        model reward may not reuse."""
        entries = list(config.task.model_rewards)
        if not entries:
            return None
        for i, entry in enumerate(entries):
            if entry.name in taken:
                raise UserError(f"task.model_rewards[{i}].name: {entry.name!r} is already a reward of task "
                                f"{config.task.name!r} ({', '.join(taken)}); give it another name.")
        here = local_mesh(mesh)
        scorers: list[Any] = []
        for i, entry in enumerate(entries):
            field = f"task.model_rewards[{i}]"
            if isinstance(entry, JudgeConfig):
                scorers.append(JudgeScorer(entry, config=config, mesh=here, plugins=plugins, field=field))
            else:
                scorers.append(RewardModelScorer(entry, mesh=here, field=field))
            log.info("model reward %r (%s) ready on %d device(s)", entry.name, entry.kind, here.devices.size)
        return cls(scorers, {e.name: float(e.weight) for e in entries})

    def score(self, prompts: Sequence[Any], completions: Sequence[str],
              columns: Mapping[str, Sequence[Any]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Each reward's values [b] float32 (0 where it had none) and the rows it had
        none for [b] bool (a judge's parse failures)."""
        out = {}
        for scorer in self.scorers:
            values = scorer(list(completions), prompts=list(prompts), **columns)
            if len(values) != len(completions):  # a bug of ours, not the user's
                raise RuntimeError(f"{scorer.name}: {len(values)} scores for {len(completions)} completions")
            missing = np.asarray([v is None or not math.isfinite(v) for v in values], bool)
            vals = np.asarray([0.0 if m else v for v, m in zip(values, missing)], np.float32)
            out[scorer.name] = (vals, missing)
        return out


def example_columns(examples: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The columns every example has, as keyword lists (TRL's convention)."""
    if not examples:
        return {}
    keys = [k for k in examples[0] if all(k in ex for ex in examples) and k not in ("prompts", "completions")]
    return {k: [ex[k] for ex in examples] for k in keys}


__all__ = ["ModelRewards", "RewardModelScorer", "example_columns", "local_mesh"]


class StepModelRewards:
    """What a step's collector holds: the run's model rewards, built on the first batch
    it scores (so only the processes that roll out load them, on their rollout devices),
    and their scores joined to the task's (:meth:`join`)."""

    def __init__(self, config: Any, programs: Any, task: Any, task_options: Any):
        self.config, self.programs, self.task, self.task_options = config, programs, task, task_options
        self._built: ModelRewards | None = None
        self.active = bool(config.task.model_rewards)

    def rewards(self, taken: Sequence[str]) -> ModelRewards:
        if self._built is None:
            self._built = ModelRewards.build(self.config, mesh=self.programs.rollout.mesh,
                                             plugins=self.programs.plugins, taken=taken)
        return self._built

    def join(self, examples: Sequence[Mapping[str, Any]], texts: Sequence[str], totals: np.ndarray,
             by_fn: dict[str, np.ndarray], flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Score ``texts`` with every model reward and join them to the task's rewards:
        ``by_fn`` gains each (in config order), ``totals`` [b] its weighted values, and
        ``flags`` [b, 4, F] a column per reward (never failed; "not applicable" where it
        had no value; scored; never timed out). Returns the new totals and flags."""
        if not self.active:
            return totals, flags
        rewards = self.rewards(list(by_fn))
        prompts = [self.task.prompt_messages(ex, options=self.task_options) for ex in examples]
        scored = rewards.score(prompts, texts, example_columns(examples))
        columns = []
        for name, (values, missing) in scored.items():
            by_fn[name] = values
            totals = totals + np.float32(rewards.weights[name]) * values
            col = np.zeros((len(texts), flags.shape[1], 1), np.int32)
            col[:, 1, 0] = missing
            col[:, 2, 0] = 1
            columns.append(col)
        return totals.astype(np.float32), np.concatenate([flags, *columns], axis=2)


__all__ += ["StepModelRewards"]
