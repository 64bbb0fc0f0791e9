"""Blocked (flash) attention over whole sequences: the update, the reference pass and
prefill. Decode (one query per row against the cache) keeps the decoder's own attention
(:mod:`grpo.models.layers.attention`), or the paged kernels of
:mod:`grpo.kernels.paged_attention`.

The XLA attention materialises ``[rows, heads, T, T]`` float32 scores (and, in the
backward pass, their probabilities and gradients): at 2,304 tokens and 16 heads that is
340 MB per row per tensor. The kernels here stream key/value blocks through an online
softmax, keeping only ``[rows, heads, T]`` statistics (the log-sum-exp) beside the output.

Every kernel has one contract, :data:`AttentionFn`::

    out = fn(q, k, v, segment_ids, scale=scale)

* ``q`` [B, T, H, E], ``k``/``v`` [B, T, K, E] with ``H % K == 0`` (grouped-query
  attention: query head ``h`` reads KV head ``h // (H // K)``), in the compute dtype.
* ``segment_ids`` [B, T] int32. The query in slot ``i`` sees key slot ``j`` iff
  ``j <= i`` and both slots have the same segment id. The decoder passes its ``kv_mask``
  as ids (1 real, 0 padding), so a real token sees exactly the real tokens up to itself,
  which is what the decoder's masked XLA attention computes. A padding query sees the
  padding before it (always at least itself, so no row is empty and nothing is NaN);
  its output is never read by anything real.
* Returns [B, T, H, E] in ``q``'s dtype.

- ``contract``: :data:`AttentionFn`, :func:`reference_attention` (that contract in plain
  XLA, the tests' reference), :func:`self_check` (a kernel against the reference, once
  at start-up) and the padding of a sequence to a kernel's blocks.
- ``tpu``: :class:`SplashAttention` (``jax.experimental.pallas.ops.tpu.splash_attention``).
- ``gpu``: :class:`PallasGpuAttention` (``jax.experimental.pallas.ops.gpu.attention``).

Both kernels run on CPU in Pallas interpret mode (tests only: slow). The decoder runs a
kernel per device under ``shard_map`` (:func:`grpo.models.layers.attention.sharded`).
"""

from grpo.kernels.attention.contract import CHECK_TOLERANCE, AttentionFn, reference_attention, self_check
from grpo.kernels.attention.gpu import PallasGpuAttention
from grpo.kernels.attention.tpu import LANES, SplashAttention, fit_block

__all__ = [
    "AttentionFn",
    "CHECK_TOLERANCE",
    "LANES",
    "PallasGpuAttention",
    "SplashAttention",
    "fit_block",
    "reference_attention",
    "self_check",
]
