"""Every Pallas kernel, by kind and backend: functions of arrays on one device, below the
models that place them on a mesh.

- ``attention``: blocked (flash) attention over whole sequences (``model.attention``):
  the contract every kernel keeps and its XLA reference (``contract``), splash for TPU
  (``tpu``), Pallas/Triton for GPU (``gpu``).
- ``paged_attention``: decode attention over a paged KV cache, one query per row: the
  plain-JAX reference and the Pallas TPU and GPU decode kernels.
- ``head_logprobs``: the output head fused with the log-softmax of the sampled tokens,
  with its custom VJP (``loss.impl: pallas``): the grid (TPU) and loop (GPU) schedules.
- ``grouped_matmul``: the dropless grouped (ragged) matmul of a mixture-of-experts
  layer's experts (``jax.lax.ragged_dot``) and its dense reference.

Placing a kernel on a mesh (``shard_map`` over the batch and heads) is its caller's:
:mod:`grpo.models.layers` for attention, the update's per-shard loss for the head.

May import: ``grpo.core``. Not the models, the engine or the plugins, which build on it.
"""
