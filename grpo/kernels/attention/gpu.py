"""Flash attention for GPUs in Pallas/Triton: the :data:`~grpo.kernels.attention.AttentionFn`
contract for GPUs (``model.attention: pallas_gpu``)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from grpo.kernels.attention.contract import pad_time, round_up


@dataclasses.dataclass(frozen=True)
class PallasGpuAttention:
    """Flash attention for GPUs in Pallas/Triton (``jax.experimental.pallas.ops.gpu.
    attention.mha``): causal, padding by segment ids, forward and backward kernels.

    That kernel has no grouped-query form: KV heads are repeated to the query heads
    (``[B, T, H, E]`` copies of k and v, linear in T; the gradient sums back over each
    group). The sequence is padded to a multiple of the blocks.
    """

    block_q: int = 64
    block_k: int = 64
    block_q_bwd: int = 32
    block_k_bwd: int = 32
    interpret: bool = False

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, scale: float) -> jax.Array:
        from jax.experimental.pallas.ops.gpu import attention as gpu

        B, T, H, E = q.shape
        group = H // k.shape[2]
        if group > 1:
            k = jnp.repeat(k, group, axis=2)
            v = jnp.repeat(v, group, axis=2)
        step = math.lcm(self.block_q, self.block_k, self.block_q_bwd, self.block_k_bwd)
        Tp = round_up(T, step)
        blocks = gpu.BlockSizes(
            block_q=self.block_q, block_k=self.block_k,
            block_q_dkv=self.block_q_bwd, block_kv_dkv=self.block_k_bwd,
            block_q_dq=self.block_q_bwd, block_kv_dq=self.block_k_bwd,
        )
        seg = pad_time(segment_ids.astype(jnp.int32), Tp, -1)
        out = gpu.mha(
            pad_time(q, Tp), pad_time(k, Tp), pad_time(v, Tp), seg,
            sm_scale=scale, causal=True, block_sizes=blocks, interpret=self.interpret,
        )
        return out[:, :T].astype(q.dtype)


__all__ = ["PallasGpuAttention"]
