"""The rollout: prompts in, K completions per prompt out.

- ``prompts``: a task's examples rendered into prompt text (through the chat template),
  tokenized prompts, prompt-length buckets, the prompts of each step and each process's
  slice of them (the rollout's inputs).
- ``decoding``: the one decode body every engine runs: the row-key derivation, the
  prefill's forward pass, the draw of a step and its record into the output buffers,
  and the chunked decode loop.
- ``sampler``: the JAX engines' shared base (:class:`BaseSampler`, a
  :class:`grpo.RolloutEngine`: ``sample`` -> :class:`Sampled`, ``lowerings`` for the
  plan) and the static engine's single-turn jitted prefill + KV-cache decode
  (:class:`Sampler`).
- ``batch_rows``: the static engine's rows through the contract (``begin``, ``submit``,
  ``step``, ``read``, ``outputs``), a step rolling out everything queued as one batch.
- ``multiturn``: the multi-turn rollout of tasks with environments (tools): turn decode,
  the host's environment steps, the jitted KV-cache append of their replies, and update
  rows with a loss mask on the model's own tokens (:class:`MultiTurnSampler`).
- ``paged``: the continuous engine's core: the page allocator (which pool pages each
  decode slot holds), the scheduler (queue, slots, refill, eviction) and the one loop
  over a runner (:class:`EngineCore`); only the engine's own modules import it.
- ``continuous``: the continuous-batching engine over a paged KV cache
  (``rollout.engine: continuous``, :class:`ContinuousSampler`): the rollout-engine
  contract (:class:`grpo.RolloutEngine`: ``update_weights``, ``begin``, ``submit``,
  ``step``, ``read``) and its jitted programs.
- ``feeders``: what streams rows into an engine through the contract alone: streaming
  dynamic sampling (:func:`stream`) and the row keys of a step's rounds.
- ``continuous_multiturn``: its multi-turn rows: a row leaves its slot at a tool call,
  parks its pages, and its next turn is appended into them
  (:class:`ContinuousMultiTurnSampler`).
- ``partial``: partial rollouts of asynchronous GRPO: one continuous stream across
  optimizer steps whose in-flight rows go on under new weights, each token's policy
  version, and the ledger that makes a resume lose no group (:class:`PartialStream`).
- ``conversations``: a multi-turn task's environments and chat rendering with tools
  (the wiring between a task plugin and the multi-turn rollout).
- ``step``: a training step's rollout as one record (:class:`StepRollout`): rounds,
  scoring, dynamic sampling and down-sampling (:class:`StepCollector`).
- ``tools``: the tool environment of a task with tools (calls run on reused daemon
  threads), the model families' tool-call formats and tool JSON schemas.
- ``model_rewards``: rewards computed by models on this process's rollout devices
  (``task.model_rewards``): reward models (sequence classifiers) as batched scorers in
  TRL's list-in, list-out shape, joined to the task's rewards in the step's scoring.
- ``reward_inputs``: a model reward's inputs: prompt and completion as text, its
  template filled, this process's devices of the rollout mesh.
- ``judge``: a generative judge: a causal LM (the policy's initial weights or another
  checkpoint) prompted with a template through a rollout engine, its reply parsed.
- ``scoring``: completions scored with a task's named reward functions and weights,
  per completion or batched (:class:`RewardScorer`: started now, collected later, in row
  order), and DAPO's overlong shaping (:func:`score_completions`, :class:`Scores`).
- ``reward_pool``: where reward calls run (inline, on threads, in child processes), each
  within ``task.reward_timeout_s`` (:class:`RewardPool`).
- ``failures``: what a run says about its reward functions' failures: each one's first
  failure logged once and kept in ``reward_errors.jsonl``, a function failing on every
  row of a step stopping the run (:class:`RewardFailures`).
- ``dynamic_sampling``: DAPO's dynamic sampling: which groups of a step's rollout
  rounds are informative (their advantages not all zero), and which the step trains on
  (:class:`GroupFilter`); PODS's down-sampling (:func:`down_sample`).
- ``layout``: where the rollout runs: the training layout or a rollout style's own
  (the serving layout, resharded into once per step), and ``auto``'s roofline choice.
- ``weights``: the run's rollout placement, and the weights the sampler reads each step
  (as is, LoRA merged, or resharded into the rollout's layout).
- ``engines``: the run's sampler built through its ``rollout.engine`` plugin.
- ``_sampling``: the per-token sampling math (temperature, top-k/top-p, keys).

May import: ``grpo.core``, ``grpo.sharding``, ``grpo.models``, ``grpo.engine.parallel``;
``grpo.engine.planning.costs`` (the one cost model: ``auto``'s choice of a serving
layout weighs a decode step by it).
"""
