"""``grpo plan``: the run's programs compiled for a TPU topology this machine does not
have, and what they need (memory per chip, fit, roofline).

- ``plan``: builds the run's programs through :mod:`grpo.engine.programs` on abstract
  state and compiles them; the report.
- ``tpu``: the TPU compiler's topologies (libtpu) and the chip table.
- ``hlo``: the collectives of a compiled program's optimized HLO text (communication).

May import: ``grpo.core``, ``grpo.sharding``, ``grpo.models``, ``grpo.engine.programs``
and the rooms it builds on: ``grpo.engine.parallel``, ``grpo.engine.rollout``,
``grpo.engine.training``.
"""
