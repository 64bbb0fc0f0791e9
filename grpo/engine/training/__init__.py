"""The update: rewards -> advantages -> loss -> gradients -> optimizer step.

- ``advantages``: group-relative advantages (GRPO, Dr. GRPO, RLOO), turn-level credit,
  and the host-side filter of informative groups.
- ``update``: :class:`UpdateStep` (the loss plugin over micro-batches, exact gradient
  accumulation, master weights, the reference pass) and :class:`UpdateBatch`.
- ``optim``: the optimizer and its learning-rate schedule.
- ``packing``: the step's sequences first-fit into bins (host plan, bin counts rounded
  to a bounded set), the packed arrays every pass over the batch runs on, and the
  update's pack programs.
- ``routing``: a mixture-of-experts model's routing in the update: the rollout's routed
  experts laid out for the forward (router replay), the ``moe/`` metrics and the router
  losses.

May import: ``grpo.core``, ``grpo.sharding``, ``grpo.models``. Nothing else of
``grpo.engine``: the loop that drives these pieces is the trainer, one floor up.
"""
