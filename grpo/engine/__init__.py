"""The machinery plugins plug into. Imports JAX.

Rooms follow the data: prompts -> rollout -> rewards/advantages -> update ->
checkpoints/metrics, plus parallelism, planning and benchmarks. Each room's ``__init__``
says what it holds and what it may import (``tests/test_architecture.py`` enforces it):

- ``parallel/``: the mesh, multi-process start-up, rows of batch-sharded arrays.
- ``rollout/``: prompts in, completions out (prompt rendering and batches, the samplers,
  conversations and tool environments, scoring with a task's rewards, the step's rollout
  record).
- ``training/``: advantages, the update step (loss, gradients, optimizer), the optimizer.
- ``loop/``: the one training loop of every mode (synchronous, asynchronous in one
  process, partial rollouts, two processes): a rollout source x a weight sync, one buffer
  and checkpoint format, one data-position ledger.
- ``runs/``: the run directory, metrics, checkpoints, export.
- ``planning/``: ``grpo plan`` (the TPU compiler on abstract state).
- ``bench/``: ``grpo bench`` (rollout, loss, memory), JSON out.

One floor above the rooms, the modules that wire them together:

- ``programs``: the program builder, every jitted program a run executes; ``grpo run``,
  ``grpo plan`` and ``grpo bench`` all build theirs here (the plan lists each one).
- ``schedule``: the shapes the packed passes can take, listed from the config and
  compiled ahead of step 1 in parallel; a compile outside the list warned of and counted.
- ``trainer``: a run's state and stages (one :class:`~grpo.engine.trainer.Trainer` per
  process); its step is the loop's (``loop/``).
- ``evaluation``: periodic evaluation (pass@k) through the builder's sampler.
- ``eval_metrics``: pass@k and mean@n over groups of scored samples (pure).
- ``cli``: ``grpo run``, ``export``, ``plot``, ``plan``.

Below the engine: ``grpo.core`` (config, contracts, plugins), ``grpo.sharding`` (logical
axis rules) and ``grpo.models`` (the decoder families); nothing below imports the engine.
The built-in plugins (``grpo.plugins``) are leaves: they use the engine's machinery as a
third-party plugin would, and nothing in ``grpo.core``, the engine or the models imports
them (``grpo.core.plugins`` names them by string to register them).
"""
