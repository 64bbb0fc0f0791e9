"""``grpo plan``: the run's programs compiled for a TPU topology this machine does not
have, and what they need (memory per chip, fit, roofline).

- ``plan``: the :class:`~grpo.engine.planning.plan.Planner`: builds the run's programs
  through :mod:`grpo.engine.programs` on abstract state, compiles them and reports their
  memory, costs and communication.
- ``shapes``: the abstract state the programs are lowered on (optimizer state, rollout
  and eval prompts, the update batch padded or packed) in the run's shardings.
- ``compiled``: one program compiled (memory, the compiler's figures, HLO, or its error)
  and its entry in the report.
- ``memory``: bytes per device of the state trees, the resident state, LoRA's report.
- ``headline``: one step's roofline, the rollout costed as the config's engine runs it.
- ``costs``: the one cost model (FLOPs, HBM bytes, roofline of each program; one decode
  step, also what a serving layout's ``tensor_parallel: auto`` weighs).
- ``profiles``: completion-length profiles (``--lengths``): built-in, a file of lengths, a
  run's ``samples.jsonl``.
- ``packed``: the packed bins of a profile's steps and the packed passes' costs.
- ``engine``: the continuous rollout engine's figures: its simulated schedule's roofline,
  concurrent rows, the largest pool that fits, the steady state per valid token.
- ``quantized``: a low-precision rollout (``rollout.quantization``): the engine's decode
  and prefill with int8/fp8 weights and KV pages beside the unquantized ones.
- ``pipeline``: asynchronous GRPO (``train.async``): the split, the weight sync and the
  pipelined step.
- ``search``: ``--search``, the largest value of a field whose plan fits (or the best
  asynchronous split).
- ``report``: the attention each program runs, and the report as text.
- ``tpu``: the TPU compiler's topologies (libtpu) and the chip table.
- ``hlo``: the collectives of a compiled program's optimized HLO text (communication).
- ``reward_plan``: the run's model rewards (``task.model_rewards``): their programs compiled
  for the rollout side, their memory there, and the plan's peak with them.

May import: ``grpo.core``, ``grpo.sharding``, ``grpo.models``, ``grpo.engine.programs``
and the rooms it builds on: ``grpo.engine.parallel``, ``grpo.engine.rollout``,
``grpo.engine.training``.
"""
