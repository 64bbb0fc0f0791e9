"""The rollout: prompts in, K completions per prompt out.

- ``prompts``: tokenized prompts, prompt-length buckets, the prompts of each step and
  each process's slice of them (the rollout's inputs).
- ``sampler``: the jitted prefill + KV-cache decode (:class:`Sampler`).
- ``multiturn``: the multi-turn rollout of tasks with environments (tools): turn decode,
  the host's environment steps, the jitted KV-cache append of their replies, and update
  rows with a loss mask on the model's own tokens (:class:`MultiTurnSampler`).
- ``dynamic_sampling``: DAPO's dynamic sampling: which groups of a step's rollout
  rounds have a reward spread, and which the step trains on (:class:`GroupFilter`).
- ``layout``: where the rollout runs: the training layout or a rollout style's own
  (the serving layout, resharded into once per step), and ``auto``'s roofline choice.
- ``_sampling``: the per-token sampling math (temperature, top-k/top-p, keys).

May import: ``grpo.core``, ``grpo.sharding``, ``grpo.models``, ``grpo.engine.parallel``;
``grpo.engine.planning.costs`` (the one cost model: ``auto``'s choice of a serving
layout weighs a decode step by it).
"""
