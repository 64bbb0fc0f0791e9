"""A generative judge (``task.model_rewards[i]``, ``kind: judge``) through a rollout engine.

The judge is a causal LM: ``model: policy`` loads the ``model`` section again (the
policy's initial weights, frozen: the copy is never updated; LoRA adapters left out), or
``model: <checkpoint>`` another one. Its engine is the run's ``rollout.engine`` plugin,
built through :func:`~grpo.engine.rollout.engines.build_sampler` exactly as the run's
own (so any engine, an external one included, can judge) with the judge's sampling: one
reply per row, ``max_new_tokens``, greedy or at ``temperature``. Its weights enter once,
through :meth:`~grpo.RolloutEngine.update_weights`.

A row's judge prompt is ``template`` filled with ``{prompt}`` (the policy prompt's text),
``{completion}`` and the row's dataset columns, sent as one user message through the
judge tokenizer's chat template (``chat_template``); a prompt over ``max_prompt_length``
tokens keeps its last ones (where a template puts its question). Rows go to the engine in
batches of ``micro_batch`` (rounded up to split over the devices; short batches padded
with their first row), left-padded to a length bucket, so the judge compiles once per
bucket. A sampling judge draws from ``fold_in(key(seed), crc32 of the batch's prompts)``:
the same rows are judged alike in every mode and after a resume.

The reply is parsed by ``parser`` (:mod:`grpo.core.judges`); a reply it cannot read is
None (a parse failure: 0, counted in ``reward/<name>/parse_failures``); the first one is
logged with the reply.
"""

from __future__ import annotations

import logging
import math
import zlib
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from grpo.core.config.rewards import JudgeConfig
from grpo.core.judges import get_parser
from grpo.engine.rollout.reward_inputs import (
    BATCH_AXES,
    completion_text,
    fill_template,
    round_up,
    row_columns,
)
from grpo.engine.rollout.prompts import bucket_for, default_buckets, render_messages

log = logging.getLogger(__name__)


def judge_model_config(cfg: JudgeConfig, config: Any) -> Any:
    """The ``model`` section the judge is built from: the run's (``policy``, without LoRA)
    or a checkpoint's, in the run's dtypes."""
    if cfg.model == "policy":
        return config.model.model_copy(update={"lora": None})
    return config.model.model_copy(update={"source": "hf", "path": cfg.model, "tokenizer": cfg.tokenizer,
                                           "lora": None, "architecture": "auto"})


def judge_run_config(cfg: JudgeConfig, config: Any) -> Any:
    """The run config the judge's engine is built from: the judge's model and sampling."""
    rollout = config.rollout.model_copy(update={
        "max_new_tokens": cfg.max_new_tokens, "num_generations": 1, "temperature": cfg.temperature,
        "max_prompt_length": cfg.max_prompt_length, "top_k": 0, "top_p": 1.0, "prompt_buckets": None,
    })
    return config.model_copy(update={"model": judge_model_config(cfg, config), "rollout": rollout})


class JudgeScorer:
    """A judge on ``mesh`` (see the module docstring): ``judge(completions, prompts=None,
    **columns) -> list[float | None]``."""

    def __init__(self, cfg: JudgeConfig, *, config: Any, mesh: Mesh, plugins: Any, field: str):
        from grpo.engine.rollout.engines import build_sampler
        from grpo.engine.rollout.layout import RolloutPlacement
        from grpo.models.policy import load_policy

        self.cfg, self.name, self.field = cfg, cfg.name, field
        self.parser = get_parser(cfg.parser, field=f"{field}.parser")
        run = judge_run_config(cfg, config)
        self.policy = load_policy(run.model, mesh, seed=config.train.seed)
        graphdef, state = nnx.split(self.policy.model)
        shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
        self.rows = round_up(cfg.micro_batch, shards)
        self.buckets = default_buckets(cfg.max_prompt_length)
        self.engine = build_sampler(
            run, placement=RolloutPlacement.training(mesh, BATCH_AXES), graphdef=graphdef, plugins=plugins,
            eos_ids=self.policy.eos_ids, pad_id=self.policy.pad_id, multi_turn=False, lora_adapters=False,
            detokenize=self.policy.decode, greedy=cfg.greedy, num_generations=1,
        )
        self.engine.update_weights(state, 0)
        self.truncated = 0
        self.failures = 0
        self.replies: list[str] = []  # the last batch's replies (for tests and logs)

    def prompt(self, prompt: Any, completion: str, columns: dict) -> str:
        """One row's judge prompt text (the template, through the chat template)."""
        text = fill_template(self.cfg.template, prompt=prompt, completion=completion, columns=columns,
                             where=f"{self.field}.template")
        tokenizer = self.policy.tokenizer if self.cfg.chat_template else None
        return render_messages([{"role": "user", "content": text}], tokenizer)

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        out = []
        for text in texts:
            ids = list(self.policy.tokenizer(text, add_special_tokens=False)["input_ids"]) or [self.policy.pad_id]
            if len(ids) > self.cfg.max_prompt_length:
                self.truncated += 1
                ids = ids[-self.cfg.max_prompt_length:]
            out.append(ids)
        return out

    def replies_of(self, texts: Sequence[str]) -> list[str]:
        """The judge's replies to prompt ``texts``, batch by batch through the engine."""
        ids = self.token_ids(texts)
        replies: list[str] = []
        for start in range(0, len(ids), self.rows):
            part = ids[start:start + self.rows]
            width = bucket_for(max(len(r) for r in part), self.buckets)
            tokens = np.full((self.rows, width), self.policy.pad_id, np.int32)
            mask = np.zeros((self.rows, width), np.int32)
            for r in range(self.rows):
                row = part[r] if r < len(part) else part[0]  # padding rows: the first again
                tokens[r, width - len(row):] = row
                mask[r, width - len(row):] = 1
            salt = zlib.crc32("\x00".join(texts[start:start + len(part)]).encode("utf-8"))
            rng = jax.random.fold_in(jax.random.key(self.cfg.seed), salt & 0x7FFFFFFF)
            sampled = self.engine.sample(self.engine.weights, tokens, mask, rng, [{} for _ in range(self.rows)])
            replies += list(sampled.texts[:len(part)])
        return replies

    def __call__(self, completions: Sequence[Any], prompts: Sequence[Any] | None = None,
                 **columns: Sequence[Any]) -> list[float | None]:
        if not completions:
            return []
        texts = [self.prompt(None if prompts is None else prompts[i], completion_text(c), row_columns(columns, i))
                 for i, c in enumerate(completions)]
        self.replies = self.replies_of(texts)
        values: list[float | None] = []
        for reply in self.replies:
            try:
                value = self.parser(reply)
                value = None if value is None else float(value)
            except Exception as err:  # noqa: BLE001 - a parser of the user's: its failure is a parse failure
                log.debug("judge %r: parser raised %s", self.name, err)
                value = None
            if value is None:
                if not self.failures:
                    log.warning("judge %r: parser %r could not read its reply %r (the row scores 0; parse failures "
                                "count in reward/%s/parse_failures)", self.name, self.cfg.parser, reply[:200],
                                self.name)
                self.failures += 1
            values.append(value)
        return values


__all__ = ["JudgeScorer", "judge_model_config", "judge_run_config"]
