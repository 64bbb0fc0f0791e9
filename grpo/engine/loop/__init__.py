"""The training loop: one loop for every mode, a rollout source x a weight sync.

- ``loop``: the one step (fill -> the entry due -> acceptance -> advantages -> update ->
  ledger, step and weight sync -> metrics row), its buffer, draw cursor and data-position
  ledger, and the checkpoint of what is buffered (:class:`Loop`).
- ``sources``: where rollouts come from: in line (synchronous), a background thread on
  the rollout mesh (whole batches, or the partial-rollouts stream).
- ``sync``: how weights reach the rollout side: nothing to move, or resharded onto the
  rollout mesh; :meth:`WeightSync.sync` is the one way in.
- ``processes``: the source and sync of a run split by processes (the exchange), and the
  rollout process's far end.
- ``buffer``: the record every source yields (:class:`Buffered`), the staleness
  refusal, and the one checkpoint format of buffered rollouts.
- ``factory``: the one place a mode is chosen (:func:`build_loop`).

The loop calls the trainer's stages (advantages, update batch, optimizer steps, metrics
row) and advances its step and data position; nothing here imports the trainer.

May import: ``grpo.core``, ``grpo.sharding``, ``grpo.engine.parallel``, ``grpo.engine.rollout``.
"""
