"""Parallelism: the device mesh, JAX's multi-controller start-up, and the rows of
batch-sharded arrays that each process owns.

- ``mesh``: the topology of this runtime and the ``Mesh`` a mesh policy's layout asks for.
- ``distributed``: ``jax.distributed.initialize`` from the ``distributed`` config section.
- ``rows``: process-local rows <-> global batch-sharded arrays.
- ``split``: the devices split into a rollout mesh and an update mesh (``train.async``).
- ``exchange``: the one move between the two sides of a multi-process asynchronous run.

May import: ``grpo.core``, ``grpo.sharding``. Nothing else of ``grpo.engine``.
"""
