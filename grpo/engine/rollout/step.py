"""A training step's rollout as one record: :class:`StepRollout`, built by
:meth:`StepCollector.collect`.

The collector owns everything between the data order and the update batch:

1. **Rounds.** A round rolls out ``train.prompts_per_step`` prompts of the data order,
   ``rollout.num_generations`` samples each, through the run's sampler (single- or
   multi-turn alike: :meth:`~grpo.engine.rollout.sampler.BaseSampler.sample`), and scores
   every row with the task's reward functions (``task.overlong``'s length penalty joins
   as the reward ``overlong``). Round 0 samples with the step's key
   ``fold_in(key(seed), step)``; round r with that key folded with r.
2. **Dynamic sampling** (DAPO, ``train.dynamic_sampling``): rounds until the step holds
   ``prompts_per_step`` informative groups
   (:class:`~grpo.engine.rollout.dynamic_sampling.GroupFilter`): groups whose advantages,
   under the configured credit, baseline and scale, are not all zero on the tokens they
   train (:func:`~grpo.engine.training.advantages.informative_groups`, computed here on
   the host with the update's own advantage functions). A short step's filler groups are
   marked (``StepRollout.filler``): the trainer gives them exactly zero advantage. On
   the continuous engine the groups stream instead (:class:`_Stream`, through
   :func:`~grpo.engine.rollout.feeders.stream`): prompts fed at
   chunk boundaries, groups scored as they finish, the first informative ones in finish
   order kept (:class:`~grpo.engine.rollout.dynamic_sampling.StreamFilter`).
3. **Down-sampling** (PODS, ``train.down_sampling``): ``keep`` rows of each group the
   step trains on (:func:`~grpo.engine.rollout.dynamic_sampling.down_sample`), keeping
   the spread that made a group informative.

Without 2 and 3 the step's rollout is its one round as sampled (the rollout's layout);
with either, the rows trained on are gathered from the rounds into the update's row
layout (the builder's ``gather_rows``). Either way the record says what the logs report
of the rewards: with down-sampling every sample rolled out for the batch's groups (what
the policy earns), not only the subset trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from grpo.core.errors import UserError
from grpo.engine.parallel.mesh import mesh_processes
from grpo.engine.parallel.rows import gather_processes, local_rows, to_global
from grpo.engine.rollout.feeders import StreamFeeder, stream
from grpo.engine.rollout.dynamic_sampling import GroupFilter, StreamFilter, down_sample, selection_scores
from grpo.engine.rollout.model_rewards import StepModelRewards
from grpo.engine.rollout.prompts import PromptSet, bucket_for, build_batch, position_indices, process_slice
from grpo.engine.rollout.sampler import RolloutOutput, Sampled
from grpo.engine.rollout.scoring import OVERLONG, RewardScorer, Scores, overlong_penalty


@dataclasses.dataclass
class ToolTotals:
    """The tool counters of a step's rounds: ``counts`` [5] (model turns, tool calls,
    errors, timeouts, results cut to fit) over every process's rows (a replicated device array), the rows
    rolled out, and this process's host seconds in the environments and in rendering +
    appends."""

    counts: jax.Array
    rows: int
    tools_s: float
    append_s: float

    def __add__(self, other: "ToolTotals") -> "ToolTotals":
        return ToolTotals(self.counts + other.counts, self.rows + other.rows, self.tools_s + other.tools_s,
                          self.append_s + other.append_s)


@dataclasses.dataclass
class SampleGroup:
    """The first prompt's group of completions of a step (what ``samples.jsonl`` shows):
    its example, the completions' texts and total rewards, and in a multi-turn rollout
    each completion's turns ``[{role, text, trained}]``; the completions' lengths in
    tokens (inserted environment tokens included) and the prompt's: a length profile for
    ``grpo plan --lengths``."""

    example: dict[str, Any]
    texts: list[str]
    rewards: np.ndarray
    turns: list[list[dict[str, Any]]] | None
    completion_lengths: list[int] | None = None
    prompt_length: int | None = None


@dataclasses.dataclass
class StepRollout:
    """A training step's rollout: the rows the update trains on and what the logs report.

    - ``output``: the rows trained on (global arrays ``[B, ...]``; row ``b*K + j`` is
      sample j of prompt b): in the rollout's layout as sampled, or in the update's when
      rows were selected (dynamic sampling, down-sampling).
    - ``rewards`` [B] and ``rewards_by_fn`` (name -> [B]): their total and per-function
      rewards, global arrays in ``output``'s row layout.
    - ``logged_rewards`` / ``logged_by_fn``: the rewards ``reward/*`` reports: the same
      arrays, or with rows selected host arrays of every row rolled out for the batch's
      groups.
    - ``reward_names``, ``reward_errors`` [functions]: each reward function's failures
      over every process's rows of every round (replicated); ``reward_counts``
      [2 * functions]: how many rows each returned "not applicable" for (None or NaN),
      then how many rows each scored (replicated; None in a record saved before it
      existed); ``first_errors``: reward name -> ``(row, "TypeError: ...")``, its first
      failure among this process's rows (row: the row's index in the scored batch).
    - ``generated_tokens``: completion tokens of every round, trained on or not.
    - ``rollout_s``: the sampler's seconds (every round); ``tools``: the tool counters
      (multi-turn only); ``metrics``: ``dynamic_sampling/*`` and ``down_sampling/*``;
      ``group``: round 0's first group when asked for; ``prompts_drawn``: prompts taken
      from the data order (the data position moves past them).
    - ``informative`` [B] bool (global, ``output``'s rows): whether the row's group is
      informative over all the samples rolled out for it, before down-sampling (the
      filter's verdict); None unless dynamic sampling is on, or down-sampling could lose
      a spread (``rule: random`` or turn credit). ``filler`` [B] bool: the rows of the
      groups filling a short step (exactly zero advantage); None when none did.
    """

    output: RolloutOutput
    rewards: jax.Array
    rewards_by_fn: dict[str, jax.Array]
    logged_rewards: Any
    logged_by_fn: dict[str, Any]
    reward_names: list[str]
    reward_errors: jax.Array
    generated_tokens: jax.Array
    rollout_s: float
    tools: ToolTotals | None
    metrics: dict[str, float]
    group: SampleGroup | None
    prompts_drawn: int
    informative: jax.Array | None = None
    filler: jax.Array | None = None
    reward_counts: jax.Array | None = None
    first_errors: dict[str, Any] | None = None

    @property
    def trained(self) -> jax.Array:
        """The tokens the loss trains on [B, N]: the model's own (every real token of a
        single-turn row; a multi-turn row's inserted tokens excluded)."""
        out = self.output
        return out.mask if out.loss_mask is None else out.loss_mask


@dataclasses.dataclass
class _Round:
    """One round: the rollout (global arrays) and this process's rows' rewards."""

    output: RolloutOutput
    totals: np.ndarray  # [b] float32
    by_fn: dict[str, np.ndarray]  # name -> [b] float32
    errors: jax.Array  # [functions] int32, every process's rows (replicated)
    seconds: float
    tools: ToolTotals | None
    group: SampleGroup | None
    counts: jax.Array | None = None  # [2 * functions] int32: not applicable, scored (replicated)
    first_errors: dict[str, Any] = dataclasses.field(default_factory=dict)


class StepCollector:
    """Builds each step's :class:`StepRollout` (see the module docstring).

    ``programs``: the run's :class:`~grpo.engine.programs.RunPrograms` (shardings, the
    ``row_sums`` and ``gather_rows`` programs); ``sampler``: the run's sampler;
    ``prompts``: the tokenized training prompts; ``task``/``task_options``: the task
    plugin whose reward functions score the rows."""

    def __init__(self, config: Any, programs: Any, sampler: Any, *, prompts: PromptSet, buckets: Any, pad_id: int,
                 task: Any, task_options: Any):
        self.config = config
        self.programs = programs
        self.sampler = sampler
        self.prompts = prompts
        self.buckets = buckets
        self.pad_id = pad_id
        self.task = task
        self.task_options = task_options
        self.model_rewards = StepModelRewards(config, programs, task, task_options)  # task.model_rewards
        self.scorer = RewardScorer.for_run(config, task, task_options, group_size=config.rollout.num_generations)

    def collect(self, *, step: int, position: int, sample_group: bool) -> StepRollout:
        """The rollout of step ``step`` (0-based) from data position ``position``, under
        the weights of the sampler's last ``update_weights`` (the loop's weight sync):
        every round reads the sampler's prepared :attr:`~grpo.RolloutEngine.weights`,
        released when the draw is done (a resharded or merged copy never outlives it).
        ``sample_group``: keep round 0's first group for ``samples.jsonl``."""
        train = self.config.train
        try:
            if train.dynamic_sampling.enabled or train.down_sampling.keep is not None:
                return self._selected(step, position, sample_group)
            return self.step_rollout(self._round(step, position, 0, sample_group), drawn=train.prompts_per_step)
        finally:
            self.sampler.release()

    def scored(self, out: RolloutOutput, *, examples: list[dict], texts: list[str], lengths: np.ndarray,
               seconds: float, sample: tuple[dict, int, Any] | None = None, tools: ToolTotals | None = None,
               scores: Scores | None = None) -> _Round:
        """Rows of a rollout scored with the task's rewards (this process's rows:
        ``examples``, ``texts``, ``lengths``; ``scores``: their rewards when already
        scored, as the overlapped rollout does); ``sample`` = (example, its prompt's
        tokens, turns or None) keeps the first group for ``samples.jsonl``. What a round
        of the step and a batch of partial rollouts share."""
        k = self.config.rollout.num_generations
        totals, by_fn, flags, first = self._score(examples, texts, lengths, scores=scores)
        f = len(by_fn)
        sums = self.programs.row_sums(to_global(flags.reshape(len(texts), 4 * f), self.programs.rollout_sharding))
        errors, counts = sums[:f], sums[f:]  # [functions], [3 * functions]
        group = None
        if sample is not None:
            example, prompt_tokens, turns = sample
            group = SampleGroup(example, texts[:k], totals[:k], turns, [int(n) for n in lengths[:k]], prompt_tokens)
        return _Round(out, totals, by_fn, errors, seconds, tools, group, counts, first)

    def step_rollout(self, r: _Round, *, drawn: int) -> StepRollout:
        """A scored batch (every row trained) as the step's record, ``drawn`` prompts of the data order."""
        rewards = to_global(r.totals, self.programs.rollout_sharding)
        by_fn = {n: to_global(v, self.programs.rollout_sharding) for n, v in r.by_fn.items()}
        return StepRollout(
            output=r.output, rewards=rewards, rewards_by_fn=by_fn, logged_rewards=rewards, logged_by_fn=by_fn,
            reward_names=list(r.by_fn), reward_errors=r.errors, generated_tokens=jnp.sum(r.output.lengths),
            rollout_s=r.seconds, tools=r.tools, metrics={}, group=r.group, prompts_drawn=drawn,
            reward_counts=r.counts, first_errors=r.first_errors,
        )

    # ------------------------------------------------------------------ one round

    def _round(self, step: int, position: int, round_: int, sample_group: bool) -> _Round:
        """Roll out and score the ``prompts_per_step`` prompts at ``position``."""
        cfg = self.config
        k = cfg.rollout.num_generations
        t0 = time.perf_counter()
        batch = self._prompt_batch(position)
        sharding = self.programs.prompt_sharding((cfg.train.prompts_per_step, batch.tokens.shape[1]))
        rng = jax.random.fold_in(jax.random.key(cfg.train.seed), step)
        if round_:
            rng = jax.random.fold_in(rng, round_)
        examples = [ex for ex in batch.examples for _ in range(k)]  # row b*K+j: sample j of prompt b
        scores = None
        if self._overlaps():
            # Each group scored on the reward workers as it finishes, while the rest decodes.
            sampled, scores = self._overlapped(batch, rng, examples)
        else:
            sampled = self.sampler.sample(self.sampler.weights, to_global(batch.tokens, sharding),
                                          to_global(batch.mask, sharding), rng, examples)
        texts = list(sampled.texts)  # the rollout's time includes detokenizing them
        seconds = time.perf_counter() - t0

        out = sampled.output
        # The completion's length (model and inserted tokens alike: rollout.max_new_tokens bounds both).
        lengths = local_rows(out.mask).sum(axis=1)
        ep = sampled.episodes
        tools = None
        if ep is not None:
            counts = np.stack([ep.num_turns, ep.tool_calls, ep.tool_errors, ep.tool_timeouts, ep.tool_truncated],
                              axis=1)
            counts = self.programs.row_sums(to_global(counts.astype(np.int32), self.programs.rollout_sharding))
            tools = ToolTotals(counts, out.tokens.shape[0], ep.tools_s, ep.append_s)
        sample = None
        if round_ == 0 and sample_group:
            sample = (batch.examples[0], int(np.asarray(batch.mask[0]).sum()), None if ep is None else ep.turns[:k])
        return self.scored(out, examples=sampled.examples, texts=texts, lengths=lengths, seconds=seconds,
                           sample=sample, tools=tools, scores=scores)

    def _overlaps(self) -> bool:
        """Whether a round's groups are scored as they finish (``task.reward_scoring:
        overlap`` on an engine that streams single-turn rows, one rollout process);
        elsewhere the round is scored once its rollout is done."""
        return (self.config.task.reward_scoring == "overlap" and self.sampler.streams and not self.sampler.loss_mask
                and self.programs.process_count == 1)

    def _overlapped(self, batch: Any, rng: jax.Array, examples: list[dict]) -> tuple[Sampled, Scores]:
        """A round's rows streamed through the engine (every prompt fed at once, so each row
        draws what :meth:`~grpo.RolloutEngine.sample` would: the same key, the same
        admission order), each group's rewards started on the reward workers as soon as its
        K rows finish, collected in row order once the rollout is done."""
        feeder = _ScoreAsFinished(self, batch, examples)
        out = stream(self.sampler, feeder, rng, rows=len(examples), prompt_length=batch.tokens.shape[1],
                     round_rows=len(examples))
        texts = [feeder.texts[r] for r in range(len(examples))]
        scores = self.scorer.collect(feeder.parts)
        return Sampled(output=out, texts=texts, examples=[dict(ex) for ex in examples]), scores

    def _all(self, local: np.ndarray) -> np.ndarray:
        """Every rollout process's rows of a host array (:func:`_all_rows`)."""
        return _all_rows(local, mesh=self.programs.mesh)

    def _prompt_batch(self, position: int):
        """The prompts at ``position .. position + prompts_per_step`` of the data order
        (this process's slice of them)."""
        cfg = self.config
        indices = position_indices(len(self.prompts), start=position, count=cfg.train.prompts_per_step,
                                   seed=cfg.train.seed)
        # The rollout mesh's processes: every process, or (multi-process async) its own alone.
        local = process_slice(cfg.train.prompts_per_step, *mesh_processes(self.programs.mesh))
        return build_batch(self.prompts, indices, local=local, buckets=self.buckets, pad_id=self.pad_id)

    def _score(self, examples: list[dict], texts: list[str], lengths: np.ndarray, scores: Scores | None = None):
        """This process's rows scored (or their ``scores``, already): totals [b], each
        reward [b] by name, flags [b, 4, rewards] (int32, in ``by_fn``'s order): whether
        each reward function failed on the row (raised, returned a non-number or ran past
        its timeout), whether it was not applicable (None or NaN), 1 (the row was scored),
        and whether it timed out; and each function's first failure ``(row, message)``.
        With ``task.overlong`` the length penalty joins as the reward ``overlong``."""
        scored = self.scorer.score(examples, texts) if scores is None else scores
        by_fn = {name: np.asarray([r[name] for r in scored.rewards], np.float32) for name in scored.names}
        late = scored.timed_out or [()] * len(texts)
        failed = np.asarray([[[name in bad or name in slow for name in scored.names] for bad, slow in zip(scored.failed, late)],
                             [[name in na for name in scored.names] for na in scored.inapplicable],
                             [[1] * len(scored.names) for _ in texts],
                             [[name in slow for name in scored.names] for slow in late]], np.int32)
        failed = failed.reshape(4, len(texts), len(scored.names)).transpose(1, 0, 2)  # b 4 F
        first = {n: (scored.first_error_rows[n], msg) for n, msg in scored.first_errors.items()}
        totals = np.asarray(scored.totals, np.float32)
        totals, failed = self.model_rewards.join(examples, texts, totals, by_fn, failed)
        overlong = self.config.task.overlong
        if overlong.buffer:
            if OVERLONG in by_fn:
                raise UserError(
                    f"task {self.task.name!r} defines a reward named {OVERLONG!r}, the name task.overlong's penalty "
                    "is logged under; rename the task's reward or set task.overlong.buffer=0."
                )
            penalty = overlong_penalty(
                lengths, max_new_tokens=self.config.rollout.max_new_tokens,
                buffer=overlong.buffer, factor=overlong.factor,
            )
            by_fn[OVERLONG] = penalty
            totals = totals + penalty
            # It never fails and always applies.
            failed = np.concatenate([failed, np.asarray([0, 0, 1, 0], np.int32)[None, :, None].repeat(len(texts), 0)],
                                    axis=2)
        return totals, by_fn, failed, first

    # ------------------------------------------------------------------ selected rows

    def _dynamic_rounds(self, step: int, position: int, sample_group: bool) -> tuple[list[_Round], GroupFilter]:
        """Rounds until the step holds ``prompts_per_step`` informative groups, and the
        filter that picked them."""
        cfg = self.config
        p = cfg.train.prompts_per_step
        picker = GroupFilter(want=p, max_rounds=cfg.train.dynamic_sampling.max_rounds)
        rounds: list[_Round] = []
        while not picker.done:
            r = self._round(step, position + p * len(rounds), picker.rounds, sample_group)
            rounds.append(r)
            picker.add(self._informative(self._all(r.totals), {n: self._all(v) for n, v in r.by_fn.items()},
                                         lambda: self._trained_rows(r.output)))
        return rounds, picker

    def _trained_rows(self, out: RolloutOutput) -> np.ndarray:
        """The model's own tokens [B, N] of every process's rows of ``out``, on the host
        (turn credit's informativeness needs the turns)."""
        return self._all(local_rows(out.mask if out.loss_mask is None else out.loss_mask))

    def _informative(self, totals: np.ndarray, by_fn: dict[str, np.ndarray],
                     trained: Callable[[], np.ndarray]) -> np.ndarray:
        """Which groups of these rows ([G*K] rewards, every process's, group-major) are
        informative ([G] bool), judged over all K samples by the update's own advantage
        functions (:meth:`~grpo.engine.programs.RunPrograms.informative_groups`)."""
        return self.programs.informative_groups(totals, by_fn, trained,
                                                num_generations=self.config.rollout.num_generations)

    def _kept_rows(self, full: np.ndarray, per_full: dict[str, np.ndarray], step: int) -> np.ndarray:
        """``train.down_sampling``'s rows of each group of the batch's rows (host indices
        into them, [G*keep]): ranked by :func:`selection_scores` (under turn credit a group
        with equal totals by the scope component with a spread)."""
        cfg = self.config
        ds, k = cfg.train.down_sampling, cfg.rollout.num_generations
        scores = full
        if cfg.train.advantage.credit == "turn":
            scores = selection_scores(full, self.programs.scope_components(per_full), k)
        rng = np.random.default_rng([cfg.train.seed, step]) if ds.rule == "random" else None
        return down_sample(scores, k, ds.keep, rule=ds.rule, rng=rng)

    def _tracks_informative(self) -> bool:
        """Whether the step records each group's verdict for the trainer's metrics
        (``advantage/informative_groups``, ``down_sampling/degenerate_groups``): with
        dynamic sampling, or a down-sampling that could lose a spread (``random``, or
        turn credit; ``max_variance`` of the totals keeps one whenever there is one)."""
        train = self.config.train
        ds = train.down_sampling
        return train.dynamic_sampling.enabled or (
            ds.keep is not None and (ds.rule == "random" or train.advantage.credit == "turn"))

    def _streams(self) -> bool:
        """Whether dynamic sampling streams groups (a single-turn engine that streams
        rows, :func:`~grpo.engine.rollout.feeders.stream`, one process) instead of rolling
        out rounds."""
        return (self.config.train.dynamic_sampling.enabled and self.sampler.streams
                and not self.sampler.loss_mask and self.programs.process_count == 1)

    def _picked_rounds(self, step: int, position: int, sample_group: bool) -> _Picked:
        """The batch's groups from rounds (:class:`GroupFilter`), or without dynamic
        sampling the one round's."""
        cfg = self.config
        p, k = cfg.train.prompts_per_step, cfg.rollout.num_generations
        if cfg.train.dynamic_sampling.enabled:
            rounds, picker = self._dynamic_rounds(step, position, sample_group)
        else:
            rounds, picker = [self._round(step, position, 0, sample_group)], None
        totals = [self._all(r.totals) for r in rounds]
        by_fn = [{n: self._all(v) for n, v in r.by_fn.items()} for r in rounds]
        informative, filled = None, 0
        if picker is not None:
            groups, filled = picker.picks()
            used = sorted({r for r, _ in groups})  # rounds the batch takes groups from
            slot = {r: i for i, r in enumerate(used)}
            rows = np.asarray([(slot[r] * p + g) * k + j for r, g in groups for j in range(k)])
            # The batch's rewards, every process's rows (rows of a round: r*B + row).
            src = np.asarray([r * p * k + (g * k + j) for r, g in groups for j in range(k)])
            full = np.concatenate(totals)[src]
            per_full = {n: np.concatenate([f[n] for f in by_fn])[src] for n in by_fn[0]}
            metrics = picker.metrics()
            informative = np.arange(p) < p - filled  # the kept groups first, then the fill
        else:
            used, rows, full, per_full, metrics = [0], np.arange(rounds[0].output.tokens.shape[0]), totals[0], by_fn[0], {}
            if self._tracks_informative():
                informative = self._informative(full, per_full, lambda: self._trained_rows(rounds[0].output))
        tools = [r.tools for r in rounds if r.tools is not None]
        return _Picked(
            outs=[rounds[r].output for r in used], rows=rows, full=full, per_full=per_full, metrics=metrics,
            informative=informative, filled=filled, reward_names=list(rounds[0].by_fn),
            errors=functools.reduce(operator.add, (r.errors for r in rounds)),
            counts=functools.reduce(operator.add, (r.counts for r in rounds)),
            first_errors=_first_errors((r.first_errors, len(r.totals)) for r in rounds),
            generated=sum(jnp.sum(r.output.lengths) for r in rounds), seconds=sum(r.seconds for r in rounds),
            tools=sum(tools[1:], tools[0]) if tools else None, group=rounds[0].group, drawn=p * len(rounds),
        )

    def _picked_stream(self, step: int, position: int, sample_group: bool) -> _Picked:
        """The batch's groups streamed through the continuous engine (:class:`_Stream`)."""
        cfg = self.config
        p, k = cfg.train.prompts_per_step, cfg.rollout.num_generations
        t0 = time.perf_counter()
        feeder = _Stream(self, step, position)
        rng = jax.random.fold_in(jax.random.key(cfg.train.seed), step)
        out = stream(self.sampler, feeder, rng, rows=feeder.filter.limit * k, prompt_length=feeder.width,
                     round_rows=p * k)
        groups, filled = feeder.filter.picks()
        rows = np.asarray([g * k + j for g in groups for j in range(k)])
        full = np.concatenate([feeder.scores[g][0] for g in groups])
        per_full = {n: np.concatenate([feeder.scores[g][1][n] for g in groups]) for n in feeder.names}
        failed = np.concatenate([feeder.scores[g][2] for g in sorted(feeder.scores)])  # every row scored, b 4 F
        sums = failed.sum(axis=0).astype(np.int32)  # 4 F
        errors = jax.device_put(sums[0], self.programs.replicated)
        counts = jax.device_put(sums[1:].reshape(-1), self.programs.replicated)
        group = None
        if sample_group and feeder.order:
            g = feeder.order[0]  # the first group to finish
            totals, _, _, texts, lengths = feeder.scores[g]
            group = SampleGroup(feeder.example(g), texts, totals, None, lengths, int(feeder.prompt(g)[1].sum()))
        return _Picked(
            outs=[out], rows=rows, full=full, per_full=per_full, metrics=feeder.filter.metrics(),
            informative=np.arange(p) < p - filled, filled=filled, reward_names=list(feeder.names), errors=errors,
            generated=jnp.sum(out.lengths), seconds=time.perf_counter() - t0, tools=None, group=group,
            drawn=feeder.filter.fed, counts=counts, first_errors=feeder.first_errors,
        )

    def _selected(self, step: int, position: int, sample_group: bool) -> StepRollout:
        """The step's rollout when rows are selected (dynamic sampling, down-sampling):
        the rows trained on gathered from the rounds (or the stream) into the update's layout."""
        cfg = self.config
        p = cfg.train.prompts_per_step
        picked = (self._picked_stream if self._streams() else self._picked_rounds)(step, position, sample_group)
        rows, full, per_full, metrics = picked.rows, picked.full, picked.per_full, picked.metrics
        logged = (full, per_full)
        ds = cfg.train.down_sampling
        if ds.keep is not None:
            keep = self._kept_rows(full, per_full, step)
            rows, full, per_full = rows[keep], full[keep], {n: v[keep] for n, v in per_full.items()}
            metrics = {**metrics, "down_sampling/kept_reward_mean": float(np.mean(full)),
                       "down_sampling/kept_reward_std": float(np.std(full))}
        out = self.programs.gather_rows(picked.outs, rows)
        place = lambda a: jax.make_array_from_callback(a.shape, self.programs.train_sharding, lambda idx: a[idx])  # noqa: E731
        per_group, filled = cfg.group_size, picked.filled
        marks = {}
        if picked.informative is not None:
            marks["informative"] = place(np.repeat(picked.informative, per_group))
        if filled:
            marks["filler"] = place(np.repeat(np.arange(p) >= p - filled, per_group))
        return StepRollout(
            output=out, rewards=place(full), rewards_by_fn={n: place(v) for n, v in per_full.items()},
            logged_rewards=logged[0], logged_by_fn=logged[1], reward_names=picked.reward_names,
            reward_errors=picked.errors, generated_tokens=picked.generated, rollout_s=picked.seconds,
            tools=picked.tools, metrics=metrics, group=picked.group, prompts_drawn=picked.drawn, **marks,
            reward_counts=picked.counts, first_errors=picked.first_errors,
        )


@dataclasses.dataclass
class _Picked:
    """The groups a step's batch takes, before down-sampling: ``rows`` [P*K] host indices
    into ``outs`` stacked, their rewards ``full`` [P*K] / ``per_full``, every process's;
    ``informative`` [P] the groups' verdicts (None: not tracked), ``filled`` uninformative
    groups filling a short step (last); and what the step record reports of the rollout."""

    outs: list[RolloutOutput]
    rows: np.ndarray
    full: np.ndarray
    per_full: dict[str, np.ndarray]
    metrics: dict[str, float]
    informative: np.ndarray | None
    filled: int
    reward_names: list[str]
    errors: jax.Array
    generated: jax.Array
    seconds: float
    tools: ToolTotals | None
    group: SampleGroup | None
    drawn: int
    counts: jax.Array | None = None
    first_errors: dict[str, Any] = dataclasses.field(default_factory=dict)


class _Stream(StreamFeeder):
    """A step's stream of groups (dynamic sampling on the continuous engine): feeds the
    prompts :class:`StreamFilter` asks for, the next ones of the data order from the
    step's position, and scores each group on the host once its K rows finished (the
    task's reward functions, as a round's), handing the verdicts to the filter in finish
    order (groups finishing at one boundary: in feed order). Prompt ``g`` fed is the
    prompt at data position ``position + g``, prompt ``g % P`` of round ``g // P`` of the
    static step: the same prompt, key and therefore tokens."""

    def __init__(self, collector: StepCollector, step: int, position: int):
        cfg = collector.config
        self.c, self.position = collector, position
        self.p, self.k = cfg.train.prompts_per_step, cfg.rollout.num_generations
        self.filter = StreamFilter(want=self.p, limit=self.p * cfg.train.dynamic_sampling.max_rounds)
        self.indices = position_indices(len(collector.prompts), start=position, count=self.filter.limit,
                                        seed=cfg.train.seed)
        # One width for every prompt the step may feed: a round's when they share its bucket.
        self.width = bucket_for(max(len(collector.prompts.token_ids[i]) for i in self.indices), collector.buckets)
        self.rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # finished row -> (tokens, mask)
        self.scores: dict[int, tuple] = {}  # group -> (totals [K], by_fn, flags [K, 4, F], texts, lengths)
        self.order: list[int] = []  # groups in finish order
        self.names: list[str] = []
        self.first_errors: dict[str, tuple[int, str]] = {}  # reward -> (row in scoring order, message)
        self.scored_rows = 0

    def prompt(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        batch = build_batch(self.c.prompts, self.indices[g:g + 1], local=slice(None), buckets=self.c.buckets,
                            pad_id=self.c.pad_id, width=self.width)
        return batch.tokens[0], batch.mask[0]

    def example(self, g: int) -> dict:
        return self.c.prompts.examples[self.indices[g]]

    def feed(self):
        n = self.filter.to_feed()
        if not n:
            return None
        prompts = [self.prompt(g) for g in range(self.filter.fed, self.filter.fed + n)]
        self.filter.fed += n
        return np.stack([t for t, _ in prompts]), np.stack([m for _, m in prompts])

    def finished(self, rows, tokens, mask) -> bool:
        k = self.k
        for r, t, m in zip(rows, tokens, mask):
            self.rows[int(r)] = (t, m)
        ready = sorted(g for g in {int(r) // k for r in rows} if all(g * k + j in self.rows for j in range(k)))
        if not ready:
            return False
        toks = np.stack([self.rows[g * k + j][0] for g in ready for j in range(k)])  # G*K N
        masks = np.stack([self.rows[g * k + j][1] for g in ready for j in range(k)])
        texts = list(self.c.sampler.detokenize(toks, masks))
        lengths = masks.sum(axis=1)
        examples = [self.example(g) for g in ready for _ in range(k)]
        totals, by_fn, failed, first = self.c._score(examples, texts, lengths)
        self.names = list(by_fn)
        for n, (row, msg) in first.items():  # rows counted in the stream's scoring order
            self.first_errors.setdefault(n, (self.scored_rows + row, msg))
        self.scored_rows += len(texts)
        verdicts = self.c._informative(totals, by_fn, lambda: masks)
        for i, g in enumerate(ready):
            part = slice(i * k, (i + 1) * k)
            self.scores[g] = (totals[part], {n: v[part] for n, v in by_fn.items()}, failed[part], texts[part],
                              [int(x) for x in lengths[part]])
            self.order.append(g)
            self.filter.add(g, bool(verdicts[i]))
        return self.filter.done


class _ScoreAsFinished(StreamFeeder):
    """A round's stream with overlapped scoring: every prompt fed at the first boundary;
    each row detokenized as it ends and its per-completion rewards started at once, a
    group's batched rewards once its K rows are done
    (:meth:`~grpo.engine.rollout.scoring.RewardScorer.start`), without waiting for them."""

    def __init__(self, collector: StepCollector, batch: Any, examples: list[dict]):
        self.c, self.batch, self.examples = collector, batch, examples
        self.k = collector.config.rollout.num_generations
        self.fed = False
        self.done: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.texts: dict[int, str] = {}
        self.parts: list[Any] = []

    def feed(self):
        if self.fed:
            return None
        self.fed = True
        return np.asarray(self.batch.tokens), np.asarray(self.batch.mask)

    def finished(self, rows, tokens, mask) -> bool:
        k, scorer = self.k, self.c.scorer
        ended = [int(r) for r in rows]
        for r, t, m in zip(ended, tokens, mask):
            self.done[r] = (t, m)
        self.texts.update(zip(ended, self.c.sampler.detokenize(np.asarray(tokens), np.asarray(mask))))
        per_row = scorer.row_names  # called per completion: each row as soon as it ends
        if per_row and ended:
            self.parts.append(scorer.start([self.examples[r] for r in ended], [self.texts[r] for r in ended],
                                           rows=ended, names=per_row))
        ready = sorted(g for g in {r // k for r in ended} if all(g * k + j in self.done for j in range(k)))
        rest = [n for n in scorer.names if n not in per_row]  # batched: once the group is whole
        if ready and rest:
            ids = [g * k + j for g in ready for j in range(k)]
            self.parts.append(scorer.start([self.examples[r] for r in ids], [self.texts[r] for r in ids], rows=ids,
                                           names=rest))
        return False


def _first_errors(parts: Any) -> dict[str, Any]:
    """Each reward's first failure over rounds (rows counted across the rounds)."""
    out: dict[str, Any] = {}
    offset = 0
    for part, rows in parts:
        for n, (row, msg) in part.items():
            out.setdefault(n, (offset + row, msg))
        offset += rows
    return out


def _all_rows(local: np.ndarray, *, mesh: Any) -> np.ndarray:
    """Every process's rows of a host array, in global row order (tiny: rewards), over the
    processes of the rollout ``mesh`` (one: this process's rows are all of them)."""
    return gather_processes(local, mesh, tiled=True)


__all__ = ["SampleGroup", "StepCollector", "StepRollout", "ToolTotals"]
