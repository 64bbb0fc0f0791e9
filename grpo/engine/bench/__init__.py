"""``grpo bench``: speed and memory as JSON (measured here, never asserted in tests).

- ``rollout``: prefill + decode of the sampler that ``grpo run`` builds
  (:meth:`grpo.engine.programs.RunPrograms.sampler`), tokens/s and the HBM roofline;
  with ``--lengths``, ``engines``: the static and continuous engines on the same rows
  stopped at lengths drawn from a profile (valid tokens/s, slot occupancy, page pool).
- ``loss``: value+grad of a loss plugin as the update calls it
  (:meth:`grpo.engine.training.update.UpdateStep.head_loss` through the builder's
  :func:`grpo.engine.programs.loss_program`), and its compiled memory.
- ``memory``: an FSDP-sharded buffer against its all-gathered copy.
- ``reward``: reward scoring on the host: per completion, batched, and overlapped with
  the continuous engine's decode (``task.reward_scoring: overlap``).
- ``packed_update``: ``update``, the update padded against the update packed, on the
  same rows drawn from a length profile (:mod:`grpo.engine.planning.profiles`).

May import: ``grpo.core``, ``grpo.sharding``, ``grpo.models``, ``grpo.engine.programs``
and the rooms it builds on: ``grpo.engine.parallel``, ``grpo.engine.rollout``,
``grpo.engine.training``; ``grpo.engine.planning`` (the chip figures a serving layout's
``auto`` weighs). No module of grpo.plugins: plugins are reached through the registry.
"""
