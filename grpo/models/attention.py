"""Blocked (flash) attention over whole sequences: the update, the reference pass and
prefill. Decode (one query per row against the cache) keeps the decoder's own attention.

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

:func:`reference_attention` is that contract in plain XLA (the tests' reference).
:class:`SplashAttention` is the TPU kernel (``jax.experimental.pallas.ops.tpu.
splash_attention``), :class:`PallasGpuAttention` the Triton one (``jax.experimental.
pallas.ops.gpu.attention``). Both run on CPU in Pallas interpret mode (tests only: slow).

The decoder runs a kernel per device under ``shard_map`` (:func:`sharded`): the batch
over its mesh axes, the query heads over theirs, each KV head beside its query heads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

AttentionFn = Callable[..., jax.Array]

LANES = 128
"""Mosaic's lane width: splash's sequence blocks are multiples of it."""

def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, scale: float) -> jax.Array:
    """The :data:`AttentionFn` contract in plain XLA (materialises the scores)."""
    T = q.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = (causal[None] & same)[:, None]  # B 1 T T
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def fit_block(block: int, length: int) -> int:
    """The largest multiple of :data:`LANES` that is <= ``block`` and divides ``length``
    (itself a multiple of LANES), so no sequence is padded past the next 128."""
    best = LANES
    for b in range(LANES, min(block, length) + 1, LANES):
        if length % b == 0:
            best = b
    return best


def _pad_time(x: jax.Array, length: int, value: Any = 0) -> jax.Array:
    pad = length - x.shape[1]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


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
        Tp = _round_up(T, LANES)
        kernel = self.kernel(H, Tp)
        qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
        # [B, T, heads, E] -> [B, heads, T, E], the kernel's layout.
        qs, ks, vs = (jnp.swapaxes(_pad_time(x, Tp), 1, 2) for x in (qs, k, v))
        seg = _pad_time(segment_ids.astype(jnp.int32), Tp, -1)
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
        Tp = _round_up(T, step)
        blocks = gpu.BlockSizes(
            block_q=self.block_q, block_k=self.block_k,
            block_q_dkv=self.block_q_bwd, block_kv_dkv=self.block_k_bwd,
            block_q_dq=self.block_q_bwd, block_kv_dq=self.block_k_bwd,
        )
        seg = _pad_time(segment_ids.astype(jnp.int32), Tp, -1)
        out = gpu.mha(
            _pad_time(q, Tp), _pad_time(k, Tp), _pad_time(v, Tp), seg,
            sm_scale=scale, causal=True, block_sizes=blocks, interpret=self.interpret,
        )
        return out[:, :T].astype(q.dtype)


# --------------------------------------------------------------------------- self-check

CHECK_TOLERANCE = {"float32": 2e-2, "bfloat16": 6e-2, "float16": 4e-2}
"""The largest error a kernel may show against :func:`reference_attention` in the
start-up check, as a fraction of the reference's largest magnitude (outputs and each
gradient): above the rounding of two summation orders (TF32 or bf16 matmul passes on
GPU/TPU), far below what a wrong mask, scale or gradient gives (order 1)."""


def self_check(fn: AttentionFn, *, dtype: Any = jnp.float32, head_dim: int = 64, heads: int = 2,
               device: Any = None) -> str | None:
    """Why ``fn`` cannot be trusted on ``device``, or None: it is compiled there once on a
    tiny shape (2 rows of 40 tokens, ``heads`` query heads sharing one KV head, the
    model's ``head_dim``; one row left-padded, one holding two segments) and its outputs
    and gradients (q, k, v) compared with the XLA reference's, real query rows only.

    A kernel whose compile fails, or that is wrong, would otherwise surface in the middle
    of a run (a kernel is compiled with the update program) or not at all. Costs one
    small forward + backward compile of the kernel and of the reference."""
    B, T, H, K, E = 2, 40, heads, 1, head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, E), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (B, T, K, E), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (B, T, K, E), jnp.float32).astype(dtype)
    seg = jnp.asarray([[0] * 9 + [1] * (T - 9), [1] * 25 + [2] * (T - 25)], jnp.int32)  # B T
    weight = jax.random.normal(keys[3], (B, T, H, E), jnp.float32) * (seg > 0)[:, :, None, None]
    scale = 1.0 / math.sqrt(E)

    def outputs(attend):
        def loss(q, k, v):
            out = attend(q, k, v, seg, scale=scale).astype(jnp.float32)
            return jnp.sum(out * weight), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out * (seg > 0)[:, :, None, None], *grads)

    try:
        with jax.default_device(device) if device is not None else contextlib.nullcontext():
            got = jax.device_get(jax.jit(lambda: outputs(fn))())
            ref = jax.device_get(jax.jit(lambda: outputs(reference_attention))())
    except Exception as err:  # noqa: BLE001 - the kernel's own failure, reported in one line
        lines = str(err).strip().splitlines()
        return f"it failed to compile or run ({type(err).__name__}: {lines[0][:300] if lines else ''})"
    tol = CHECK_TOLERANCE.get(jnp.dtype(dtype).name, 2e-2)
    for what, a, b in zip(("outputs", "dq", "dk", "dv"), got, ref):
        a = np.asarray(a, np.float32)
        b = np.asarray(b, np.float32)
        if a.shape != b.shape:
            return f"its {what} have shape {a.shape}, the XLA reference's {b.shape}"
        err = float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-6) if np.all(np.isfinite(a)) else np.inf
        if not err <= tol:
            return (f"its {what} differ from the XLA reference's by {err:.3g} of their largest magnitude "
                    f"(tolerance {tol:g}, {jnp.dtype(dtype).name})")
    return None


# --------------------------------------------------------------------------- sharding


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def head_specs(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], mesh: Mesh, rules: Mapping[str, Any]
) -> tuple[PartitionSpec, PartitionSpec, tuple[str, ...]]:
    """The per-device ``shard_map`` specs of q and k/v, and the mesh axes that split a KV
    shard's query heads further (empty: none).

    The batch goes over its activation axes and the sequence stays whole. Query heads go
    over their axes when the KV heads' axes lead them (``kv_heads: tp``, ``heads: (tp,
    fsdp)``, the serving layout): a device then holds its KV shard whole and reads the KV
    heads of its own query heads (:func:`sharded` slices them). Otherwise the query
    heads are split only as the KV heads are.
    """
    from grpo.sharding import fit_spec

    qs = fit_spec(q_shape, ("batch", None, "heads", None), mesh, rules)
    ks = fit_spec(k_shape, ("batch", None, "kv_heads", None), mesh, rules)
    qh, kh = _axes(qs[2]), _axes(ks[2])
    rest = qh[len(kh):]
    if qh[: len(kh)] != kh:
        qh, rest = kh, ()
    elif rest:
        local = q_shape[2] // math.prod(mesh.shape[a] for a in qh)
        group = q_shape[2] // k_shape[2]
        if local % group and group % local:
            qh, rest = kh, ()
    batch = qs[0]
    return PartitionSpec(batch, None, _entry(qh), None), PartitionSpec(batch, None, _entry(kh), None), rest


def sharded(
    fn: AttentionFn, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
    scale: float, mesh: Mesh | None, rules: Mapping[str, Any],
) -> jax.Array:
    """``fn`` per device under ``shard_map`` (a Pallas call is opaque to XLA's partitioner,
    which would otherwise gather its operands onto every device)."""
    if mesh is None or mesh.size == 1:
        return fn(q, k, v, segment_ids, scale=scale)
    qspec, kspec, rest = head_specs(q.shape, k.shape, mesh, rules)
    group = q.shape[2] // k.shape[2]

    def body(a, b, c, s):
        if rest:  # this device's query heads read a slice of its KV shard
            local = a.shape[2]
            start = (jax.lax.axis_index(rest) * local) // group
            size = max(1, local // group)
            b = jax.lax.dynamic_slice_in_dim(b, start, size, axis=2)
            c = jax.lax.dynamic_slice_in_dim(c, start, size, axis=2)
        return fn(a, b, c, s, scale=scale)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(qspec, kspec, kspec, PartitionSpec(qspec[0], None)), out_specs=qspec,
        check_vma=False,
    )(q, k, v, segment_ids)


__all__ = [
    "AttentionFn",
    "LANES",
    "PallasGpuAttention",
    "SplashAttention",
    "fit_block",
    "head_specs",
    "reference_attention",
    "self_check",
    "sharded",
]
