"""Splash attention (TPU Pallas/Mosaic): the :data:`~grpo.kernels.attention.AttentionFn`
contract for TPUs (``model.attention: splash``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from grpo.kernels.attention.contract import pad_time, round_up

LANES = 128
"""Mosaic's lane width: splash's sequence blocks are multiples of it."""


def fit_block(block: int, length: int) -> int:
    """The largest multiple of :data:`LANES` that is <= ``block`` and divides ``length``
    (itself a multiple of LANES), so no sequence is padded past the next 128."""
    best = LANES
    for b in range(LANES, min(block, length) + 1, LANES):
        if length % b == 0:
            best = b
    return best


@dataclasses.dataclass(frozen=True)
class SplashAttention:
    """Splash attention (TPU Pallas/Mosaic): causal mask by block sparsity, padding by
    segment ids, GQA natively (each KV head serves its group of query heads).

    The sequence is padded to a multiple of 128 (padding slots get segment id -1: they
    see only each other); each block is the largest multiple of 128 up to the configured
    size that divides the padded length. Splash has no scale argument: ``q`` is scaled
    first. Blocks are fields of ``model.attention_options``; the defaults are MaxText's.
    """

    block_q: int = 512
    block_kv: int = 512
    block_kv_compute: int = 512
    block_q_dkv: int = 512
    block_kv_dkv: int = 512
    block_kv_dkv_compute: int = 512
    block_q_dq: int = 512
    block_kv_dq: int = 512
    fused_backward: bool = False
    interpret: bool = False

    def block_sizes(self, length: int) -> Any:
        from jax.experimental.pallas.ops.tpu.splash_attention import BlockSizes

        f = functools.partial(fit_block, length=length)
        kv = f(self.block_kv)
        kv_dkv = f(self.block_kv_dkv)
        return BlockSizes(
            block_q=f(self.block_q),
            block_kv=kv,
            block_kv_compute=fit_block(self.block_kv_compute, kv),
            block_q_dkv=f(self.block_q_dkv),
            block_kv_dkv=kv_dkv,
            block_kv_dkv_compute=fit_block(self.block_kv_dkv_compute, kv_dkv),
            block_q_dq=None if self.fused_backward else f(self.block_q_dq),
            block_kv_dq=None if self.fused_backward else f(self.block_kv_dq),
            use_fused_bwd_kernel=self.fused_backward,
        )

    def kernel(self, heads: int, length: int) -> Any:
        return _splash_kernel(self, heads, length)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, scale: float) -> jax.Array:
        from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

        B, T, H, E = q.shape
        Tp = round_up(T, LANES)
        kernel = self.kernel(H, Tp)
        qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
        # [B, T, heads, E] -> [B, heads, T, E], the kernel's layout.
        qs, ks, vs = (jnp.swapaxes(pad_time(x, Tp), 1, 2) for x in (qs, k, v))
        seg = pad_time(segment_ids.astype(jnp.int32), Tp, -1)
        out = jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=SegmentIds(q=s, kv=s)))(qs, ks, vs, seg)
        return jnp.swapaxes(out, 1, 2)[:, :T].astype(q.dtype)


@functools.lru_cache(maxsize=64)
def _splash_kernel(cfg: SplashAttention, heads: int, length: int) -> Any:
    """One splash kernel per (settings, heads, padded length): building the block-sparsity
    tables walks the mask on the host."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([sa.CausalMask((length, length))] * heads)
    with jax.ensure_compile_time_eval():  # concrete tables even when first built under a trace
        return sa.make_splash_mha(
            mask,
            block_sizes=cfg.block_sizes(length),
            head_shards=1,
            q_seq_shards=1,
            interpret=cfg.interpret,
        )


__all__ = ["LANES", "SplashAttention", "fit_block"]
