"""Fused output-head + log-softmax in Pallas: per-token log-probs without ``[B, T, V]``
(the ``pallas`` loss of :mod:`grpo.plugins.losses`; its options become a
:class:`KernelConfig` there).

The token rows ``N = B * T`` of the hidden states and the vocabulary are cut into blocks
of ``block_t`` rows and ``block_v`` columns. For each (row, vocab) block the kernel
computes ``logits = hidden_blk @ W_blk / temperature`` ([block_t, block_v], f32) and
folds it into an online log-sum-exp (running max ``m``, running sum ``s``), the target
logit and a running entropy term; only those per-row numbers leave the kernel. The
custom VJP takes ``g = d loss / d logp`` [N] (and the entropy's cotangent, non-zero with
an entropy bonus) and recomputes each logits block from the saved log-sum-exp:
``dlogits = g * (onehot(target) - softmax) / temperature`` (see ``_dlogits``), then
``dH += dlogits @ W_blk^T`` and ``dW_blk += H_blk^T @ dlogits``. ``dH`` reduces over the
vocabulary and ``dW`` over the rows, so they are two kernels, each owning its output
block while it sweeps the other axis (deterministic; no atomics). The forward pass does
one head matmul and the backward pass four (each kernel recomputes its logits blocks,
then does the dH or the dW matmul): 5 against the reference's 3, the price of never
storing the logits.

Two schedules of the same block math (``_online_update``, ``_dlogits``):

- ``grid`` (TPU Mosaic, and CPU interpret mode): the reduction axis is the last grid
  axis ("arbitrary"); accumulators live in VMEM scratch, initialised at its first step
  and written out at its last. Pallas pads edge blocks (V not a multiple of
  ``block_v``, N not a multiple of ``block_t``) with unspecified values, so the kernels
  mask vocab columns >= V and rows >= N before any arithmetic that could mix them in.
- ``loop`` (GPU Triton, where grid programs run concurrently and there is no scratch):
  one program per row block (forward, dH) or vocab block (dW) loops over the other axis
  and over ``block_d`` chunks of the hidden size in-kernel, with masked loads. dH and dW
  accumulate in f32 outputs owned by one program each (read-modify-write, no atomics).

Both schedules run in interpret mode on CPU, which is how they are tested (the grid
schedule also under the TPU interpreter, with race detection across two cores). The
tests also lower both for their hardware by cross-platform export (grid -> Mosaic TPU,
loop -> Triton), and compile the grid schedule with the real TPU compiler for a v6e
topology (libtpu, no TPU needed; ``grpo plan`` does the same at the run's shapes), so
Mosaic's own checks (tiling, VMEM) run; execution on a TPU or GPU has not been run.

Numerics: matmuls take the input dtype and accumulate in f32 (f32 inputs use
``Precision.HIGHEST``), the log-sum-exp, softmax and entropy run in f32, and ``dlogits``
is rounded to the input dtype for the backward matmuls (as XLA does in the reference).
In f32 the results match the ``jax`` loss within 1e-4; in bf16 gradients agree within a
couple of bf16 ulps of the largest gradient (tests/plugins/losses/test_pallas.py).

Memory: besides the outputs, only per-row vectors ([N] f32: log-sum-exp, log-probs,
entropy) live in HBM; the loop schedule adds an f32 [N, D] dH buffer and an f32
[D, dw_chunk] dW buffer. Sharding: the kernel needs the whole vocabulary (the plugin
refuses tp > 1); a batch-sharded call is correct, but XLA runs an opaque kernel on
gathered operands, so the caller should shard_map it over the batch axes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# A finite "minus infinity": exp(MASK - m) underflows to 0 and, unlike -inf, never
# produces inf - inf = nan in the running-max corrections.
MASK_VALUE = -1e30

Schedule = Literal["grid", "loop"]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Resolved kernel parameters (hashable: a static argument)."""

    block_t: int
    block_v: int
    block_d: int
    schedule: Schedule
    interpret: Any  # bool, or pltpu.InterpretParams for TPU-semantics interpretation (tests)
    backend: str  # "cpu" | "gpu" | "tpu"
    vmem_limit_bytes: int | None = None
    # Compile-only memory measurement (``grpo bench loss --opaque-kernels``): each kernel
    # becomes an opaque host call with the same operands and results, which reads its
    # operands in place the way a Mosaic/Triton custom call does, instead of the
    # interpreter's while loop (which copies every operand into its loop carry). Never run.
    opaque: bool = False
    # Loop schedule: vocab columns per dW kernel call (its f32 buffer is D x dw_chunk).
    dw_chunk: int = 16384


def _never_called(*args):
    raise RuntimeError("opaque kernels only exist to measure compiled memory; they cannot run")


def _pallas_call(cfg: KernelConfig, kernel, *, out_shape, **kwargs):
    if cfg.opaque:
        return lambda *args: jax.pure_callback(_never_called, out_shape, *args)
    return pl.pallas_call(kernel, out_shape=out_shape, **kwargs)


# --------------------------------------------------------------------------- block math
# Shared by both schedules. Row vectors are (bt, 1) in the grid schedule and (bt,) in the
# loop schedule; the helpers keep whichever shape they are given.


def _col(r: jax.Array) -> jax.Array:
    return r if r.ndim == 2 else r[:, None]


def _rowreduce(fn, x: jax.Array, like: jax.Array) -> jax.Array:
    return fn(x, axis=1, keepdims=like.ndim == 2)


def _online_update(logits, col_valid, onehot, m, s, a, tl):
    """Fold one [bt, bv] logits block into the running (max, sum, entropy term, target logit).

    ``a`` is ``sum_v exp(l_v - m) * (l_v - m)``, kept relative to the running max so that
    ``entropy = log(s) - a / s`` does not cancel catastrophically for large logits.
    """
    blk_max = _rowreduce(jnp.max, jnp.where(col_valid, logits, MASK_VALUE), m)
    m_new = jnp.maximum(m, blk_max)
    alpha = jnp.exp(m - m_new)
    z = jnp.where(col_valid, logits - _col(m_new), 0.0)
    p = jnp.where(col_valid, jnp.exp(z), 0.0)
    s_new = alpha * s + _rowreduce(jnp.sum, p, m)
    a_new = alpha * (a + s * (m - m_new)) + _rowreduce(jnp.sum, p * z, m)
    tl_new = tl + _rowreduce(jnp.sum, jnp.where(onehot, logits, 0.0), m)
    return m_new, s_new, a_new, tl_new


def _finish(m, s, a, tl):
    """(logp of the target, log-sum-exp, entropy) per row."""
    lse = m + jnp.log(s)
    return tl - lse, lse, jnp.log(s) - a / s


def _dlogits(logits, col_valid, onehot, lse, g, ge, ent, inv_temp):
    """d loss / d (hidden @ W) for one block, from the cotangents ``g`` of the target's
    log-prob and ``ge`` of the entropy ``H`` (the entropy bonus):
    ``(g * (onehot - p) - ge * p * (logits - lse + H)) / temperature``, as
    ``dH/dz_j = -p_j (log p_j + H)``."""
    z = jnp.where(col_valid, logits - _col(lse), 0.0)  # log p; 0 on padded columns
    p = jnp.where(col_valid, jnp.exp(z), 0.0)
    d = _col(g) * (onehot.astype(jnp.float32) - p) - _col(ge) * p * (z + _col(ent))
    return d * inv_temp


def _dot(a, b, contract: tuple[int, int], precision):
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )


def _precision(dtype) -> lax.Precision:
    # f32 inputs get full-precision passes (TPU's default f32 matmul is bf16 passes;
    # Triton's is TF32); bf16/f16 inputs use the native MXU/tensor-core path.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


# --------------------------------------------------------------------------- grid schedule


def _grid_fwd_kernel(h_ref, w_ref, tgt_ref, logp_ref, lse_ref, ent_ref, m_sc, s_sc, a_sc, tl_sc, *,
                     n_vocab, block_v, inv_temp, precision):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        s_sc[...] = jnp.zeros(s_sc.shape, jnp.float32)
        a_sc[...] = jnp.zeros(a_sc.shape, jnp.float32)
        tl_sc[...] = jnp.zeros(tl_sc.shape, jnp.float32)

    logits = _dot(h_ref[...], w_ref[...], (1, 0), precision) * inv_temp  # bt bv
    col = lax.broadcasted_iota(jnp.int32, logits.shape, 1) + j * block_v
    col_valid = col < n_vocab
    onehot = col == tgt_ref[...]
    m, s, a, tl = _online_update(logits, col_valid, onehot, m_sc[...], s_sc[...], a_sc[...], tl_sc[...])
    m_sc[...], s_sc[...], a_sc[...], tl_sc[...] = m, s, a, tl

    @pl.when(j == pl.num_programs(1) - 1)
    def _done():
        logp, lse, ent = _finish(m, s, a, tl)
        logp_ref[...] = logp
        lse_ref[...] = lse
        ent_ref[...] = ent


def _grid_dh_kernel(h_ref, w_ref, tgt_ref, lse_ref, g_ref, ge_ref, ent_ref, dh_ref, acc_sc, *,
                    n_vocab, block_v, inv_temp, precision):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    w = w_ref[...]
    logits = _dot(h_ref[...], w, (1, 0), precision) * inv_temp  # bt bv
    col = lax.broadcasted_iota(jnp.int32, logits.shape, 1) + j * block_v
    col_valid = col < n_vocab
    dl = _dlogits(logits, col_valid, col == tgt_ref[...], lse_ref[...], g_ref[...], ge_ref[...], ent_ref[...],
                  inv_temp)
    # The padded columns of the edge block of W hold unspecified values (NaN in interpret
    # mode) and 0 * NaN = NaN: zero them rather than rely on dl being 0 there.
    w_cols_valid = (lax.broadcasted_iota(jnp.int32, w.shape, 1) + j * block_v) < n_vocab
    w = jnp.where(w_cols_valid, w, jnp.zeros_like(w))
    acc_sc[...] += _dot(dl.astype(w.dtype), w, (1, 1), precision)  # bt D

    @pl.when(j == pl.num_programs(1) - 1)
    def _done():
        dh_ref[...] = acc_sc[...].astype(dh_ref.dtype)


def _grid_dw_kernel(h_ref, w_ref, tgt_ref, lse_ref, g_ref, ge_ref, ent_ref, dw_ref, acc_sc, *,
                    n_vocab, n_rows, block_v, block_t, inv_temp, precision):
    jv, it = pl.program_id(0), pl.program_id(1)

    @pl.when(it == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    h = h_ref[...]
    logits = _dot(h, w_ref[...], (1, 0), precision) * inv_temp  # bt bv
    col = lax.broadcasted_iota(jnp.int32, logits.shape, 1) + jv * block_v
    col_valid = col < n_vocab
    dl = _dlogits(logits, col_valid, col == tgt_ref[...], lse_ref[...], g_ref[...], ge_ref[...], ent_ref[...],
                  inv_temp)
    # Rows past N in the edge block are unspecified (NaN in interpret mode): zero both
    # factors so they add nothing to H^T @ dlogits.
    row_ok = (lax.broadcasted_iota(jnp.int32, dl.shape, 0) + it * block_t) < n_rows
    dl = jnp.where(row_ok, dl, 0.0)
    h_rows_ok = (lax.broadcasted_iota(jnp.int32, h.shape, 0) + it * block_t) < n_rows
    h = jnp.where(h_rows_ok, h, jnp.zeros_like(h))
    acc_sc[...] += _dot(h, dl.astype(h.dtype), (0, 0), precision)  # D bv

    @pl.when(it == pl.num_programs(1) - 1)
    def _done():
        dw_ref[...] = acc_sc[...].astype(dw_ref.dtype)


def _scratch(shape, dtype, cfg: KernelConfig):
    if cfg.backend == "tpu" or cfg.interpret:
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.VMEM(shape, dtype)
    raise ValueError(f"the grid schedule needs VMEM scratch, which backend {cfg.backend!r} lacks")


def _compiler_params(cfg: KernelConfig, semantics: tuple[str, ...]):
    # Also under interpretation: the generic interpreter ignores them, and the TPU
    # interpreter (pltpu.InterpretParams) uses the dimension semantics.
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=cfg.vmem_limit_bytes)


def _grid_forward(h, w, tgt, *, inv_temp, cfg: KernelConfig):
    n, d = h.shape
    v = w.shape[1]
    bt, bv = cfg.block_t, cfg.block_v
    grid = (pl.cdiv(n, bt), pl.cdiv(v, bv))
    row = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
    kernel = functools.partial(
        _grid_fwd_kernel, n_vocab=v, block_v=bv, inv_temp=inv_temp, precision=_precision(h.dtype)
    )
    out = jax.ShapeDtypeStruct((n, 1), jnp.float32)
    logp, lse, ent = _pallas_call(
        cfg,
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((bt, d), lambda i, j: (i, 0)), pl.BlockSpec((d, bv), lambda i, j: (0, j)), row],
        out_specs=[row, row, row],
        out_shape=[out, out, out],
        scratch_shapes=[_scratch((bt, 1), jnp.float32, cfg) for _ in range(4)],
        compiler_params=_compiler_params(cfg, ("parallel", "arbitrary")),
        interpret=cfg.interpret,
        name="grpo_fused_logprobs_fwd",
    )(h, w, tgt[:, None])
    return logp[:, 0], lse[:, 0], ent[:, 0]


def _grid_backward(h, w, tgt, lse, g, ge, ent, *, inv_temp, cfg: KernelConfig):
    n, d = h.shape
    v = w.shape[1]
    bt, bv = cfg.block_t, cfg.block_v
    precision = _precision(h.dtype)
    tgt2, lse2, g2, ge2, ent2 = (x[:, None] for x in (tgt, lse, g, ge, ent))  # N 1

    # dH: rows outer ("parallel"), vocab inner ("arbitrary").
    row = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
    dh = _pallas_call(
        cfg,
        functools.partial(_grid_dh_kernel, n_vocab=v, block_v=bv, inv_temp=inv_temp, precision=precision),
        grid=(pl.cdiv(n, bt), pl.cdiv(v, bv)),
        in_specs=[pl.BlockSpec((bt, d), lambda i, j: (i, 0)), pl.BlockSpec((d, bv), lambda i, j: (0, j)),
                  row, row, row, row, row],
        out_specs=pl.BlockSpec((bt, d), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((n, d), h.dtype),
        scratch_shapes=[_scratch((bt, d), jnp.float32, cfg)],
        compiler_params=_compiler_params(cfg, ("parallel", "arbitrary")),
        interpret=cfg.interpret,
        name="grpo_fused_logprobs_dh",
    )(h, w, tgt2, lse2, g2, ge2, ent2)

    # dW: vocab outer ("parallel"), rows inner ("arbitrary").
    row_t = pl.BlockSpec((bt, 1), lambda j, i: (i, 0))
    dw = _pallas_call(
        cfg,
        functools.partial(_grid_dw_kernel, n_vocab=v, n_rows=n, block_v=bv, block_t=bt,
                          inv_temp=inv_temp, precision=precision),
        grid=(pl.cdiv(v, bv), pl.cdiv(n, bt)),
        in_specs=[pl.BlockSpec((bt, d), lambda j, i: (i, 0)), pl.BlockSpec((d, bv), lambda j, i: (0, j)),
                  row_t, row_t, row_t, row_t, row_t],
        out_specs=pl.BlockSpec((d, bv), lambda j, i: (0, j)),
        out_shape=jax.ShapeDtypeStruct((d, v), w.dtype),
        scratch_shapes=[_scratch((d, bv), jnp.float32, cfg)],
        compiler_params=_compiler_params(cfg, ("parallel", "arbitrary")),
        interpret=cfg.interpret,
        name="grpo_fused_logprobs_dw",
    )(h, w, tgt2, lse2, g2, ge2, ent2)
    return dh, dw


# --------------------------------------------------------------------------- loop schedule


def _loop_load(ref, rows, cols, row_ok, col_ok):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.load(ref.at[rows, cols], mask=row_ok[:, None] & col_ok[None, :], other=0.0)


def _loop_store(ref, rows, cols, row_ok, col_ok, value):
    from jax.experimental.pallas import triton as plgpu

    plgpu.store(ref.at[rows, cols], value.astype(ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


def _loop_logits(h_ref, w_ref, t0, v0, row_ok, col_ok, *, bt, bv, bd, n_hidden, inv_temp, precision):
    """hidden[t0:t0+bt] @ W[:, v0:v0+bv] / temperature, over block_d chunks of the hidden size."""

    def body(k, acc):
        d0 = k * bd
        d_ok = d0 + jnp.arange(bd) < n_hidden
        h = _loop_load(h_ref, pl.ds(t0, bt), pl.ds(d0, bd), row_ok, d_ok)
        w = _loop_load(w_ref, pl.ds(d0, bd), pl.ds(v0, bv), d_ok, col_ok)
        return acc + _dot(h, w, (1, 0), precision)

    acc = lax.fori_loop(0, pl.cdiv(n_hidden, bd), body, jnp.zeros((bt, bv), jnp.float32))
    return acc * inv_temp


def _sync(barrier: bool) -> None:
    """Block-wide barrier between read-modify-write passes over an output.

    dH/dW accumulate in global memory, and the threads that store a tile need not be the
    ones that load it back on the next pass; ``bar.sync`` orders those accesses within
    the program. (The interpreter runs programs sequentially and has no barrier.)
    """
    if barrier:
        from jax.experimental.pallas import triton as plgpu

        plgpu.debug_barrier()


def _row_vec(ref, start, size, ok, other):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.load(ref.at[pl.ds(start, size)], mask=ok, other=other)


def _loop_fwd_kernel(h_ref, w_ref, tgt_ref, logp_ref, lse_ref, ent_ref, *, n_rows, n_vocab, n_hidden,
                     bt, bv, bd, inv_temp, precision, barrier):
    del barrier  # no read-modify-write here
    from jax.experimental.pallas import triton as plgpu

    t0 = pl.program_id(0) * bt
    row_ok = t0 + jnp.arange(bt) < n_rows
    tgt = _row_vec(tgt_ref, t0, bt, row_ok, 0)
    logits_of = functools.partial(_loop_logits, h_ref, w_ref, t0, bt=bt, bv=bv, bd=bd, n_hidden=n_hidden,
                                  inv_temp=inv_temp, precision=precision)

    def body(j, carry):
        v0 = j * bv
        cols = v0 + jnp.arange(bv)
        col_ok = cols < n_vocab
        logits = logits_of(v0, row_ok, col_ok)
        return _online_update(logits, col_ok[None, :], cols[None, :] == tgt[:, None], *carry)

    zeros = jnp.zeros((bt,), jnp.float32)
    carry = lax.fori_loop(0, pl.cdiv(n_vocab, bv), body, (zeros + MASK_VALUE, zeros, zeros, zeros))
    logp, lse, ent = _finish(*carry)
    for ref, val in ((logp_ref, logp), (lse_ref, lse), (ent_ref, ent)):
        plgpu.store(ref.at[pl.ds(t0, bt)], val, mask=row_ok)


def _loop_dh_kernel(h_ref, w_ref, tgt_ref, lse_ref, g_ref, ge_ref, ent_ref, dh_ref, *, n_rows, n_vocab, n_hidden,
                    bt, bv, bd, inv_temp, precision, barrier):
    t0 = pl.program_id(0) * bt
    row_ok = t0 + jnp.arange(bt) < n_rows
    tgt = _row_vec(tgt_ref, t0, bt, row_ok, 0)
    lse = _row_vec(lse_ref, t0, bt, row_ok, 0.0)
    g = _row_vec(g_ref, t0, bt, row_ok, 0.0)
    ge = _row_vec(ge_ref, t0, bt, row_ok, 0.0)
    ent = _row_vec(ent_ref, t0, bt, row_ok, 0.0)
    n_d = pl.cdiv(n_hidden, bd)

    def zero(k, _):
        d0 = k * bd
        _loop_store(dh_ref, pl.ds(t0, bt), pl.ds(d0, bd), row_ok, d0 + jnp.arange(bd) < n_hidden,
                    jnp.zeros((bt, bd), jnp.float32))
        return 0

    lax.fori_loop(0, n_d, zero, 0)
    _sync(barrier)

    def v_body(j, _):
        v0 = j * bv
        cols = v0 + jnp.arange(bv)
        col_ok = cols < n_vocab
        logits = _loop_logits(h_ref, w_ref, t0, v0, row_ok, col_ok, bt=bt, bv=bv, bd=bd, n_hidden=n_hidden,
                              inv_temp=inv_temp, precision=precision)
        dl = _dlogits(logits, col_ok[None, :], cols[None, :] == tgt[:, None], lse, g, ge, ent, inv_temp)

        def d_body(k, _):
            d0 = k * bd
            d_ok = d0 + jnp.arange(bd) < n_hidden
            w = _loop_load(w_ref, pl.ds(d0, bd), pl.ds(v0, bv), d_ok, col_ok)  # bd bv
            rows, dcols = pl.ds(t0, bt), pl.ds(d0, bd)
            acc = _loop_load(dh_ref, rows, dcols, row_ok, d_ok) + _dot(dl.astype(w.dtype), w, (1, 1), precision)
            _loop_store(dh_ref, rows, dcols, row_ok, d_ok, acc)
            return 0

        lax.fori_loop(0, n_d, d_body, 0)
        _sync(barrier)
        return 0

    lax.fori_loop(0, pl.cdiv(n_vocab, bv), v_body, 0)


def _loop_dw_kernel(base_ref, h_ref, w_ref, tgt_ref, lse_ref, g_ref, ge_ref, ent_ref, dw_ref, *, n_rows, n_cols, n_hidden,
                    bt, bv, bd, inv_temp, precision, barrier):
    """dW for ``n_cols`` vocab columns starting at ``base_ref[0]``, into an f32 [D, n_cols] output."""
    local = pl.program_id(0) * bv
    v0 = base_ref[0] + local
    cols = v0 + jnp.arange(bv)
    col_ok = local + jnp.arange(bv) < n_cols  # base + n_cols <= V, so this also bounds V
    n_d = pl.cdiv(n_hidden, bd)

    def zero(k, _):
        d0 = k * bd
        _loop_store(dw_ref, pl.ds(d0, bd), pl.ds(local, bv), d0 + jnp.arange(bd) < n_hidden, col_ok,
                    jnp.zeros((bd, bv), jnp.float32))
        return 0

    lax.fori_loop(0, n_d, zero, 0)
    _sync(barrier)

    def t_body(i, _):
        t0 = i * bt
        row_ok = t0 + jnp.arange(bt) < n_rows
        tgt = _row_vec(tgt_ref, t0, bt, row_ok, 0)
        lse = _row_vec(lse_ref, t0, bt, row_ok, 0.0)
        g = _row_vec(g_ref, t0, bt, row_ok, 0.0)  # 0 on rows past N: they add nothing
        ge = _row_vec(ge_ref, t0, bt, row_ok, 0.0)
        ent = _row_vec(ent_ref, t0, bt, row_ok, 0.0)
        logits = _loop_logits(h_ref, w_ref, t0, v0, row_ok, col_ok, bt=bt, bv=bv, bd=bd, n_hidden=n_hidden,
                              inv_temp=inv_temp, precision=precision)
        dl = _dlogits(logits, col_ok[None, :], cols[None, :] == tgt[:, None], lse, g, ge, ent, inv_temp)

        def d_body(k, _):
            d0 = k * bd
            d_ok = d0 + jnp.arange(bd) < n_hidden
            h = _loop_load(h_ref, pl.ds(t0, bt), pl.ds(d0, bd), row_ok, d_ok)  # bt bd
            rows, vcols = pl.ds(d0, bd), pl.ds(local, bv)
            acc = _loop_load(dw_ref, rows, vcols, d_ok, col_ok) + _dot(h, dl.astype(h.dtype), (0, 0), precision)
            _loop_store(dw_ref, rows, vcols, d_ok, col_ok, acc)
            return 0

        lax.fori_loop(0, n_d, d_body, 0)
        _sync(barrier)
        return 0

    lax.fori_loop(0, pl.cdiv(n_rows, bt), t_body, 0)


def _loop_compiler_params(cfg: KernelConfig):
    if cfg.interpret or cfg.backend != "gpu":
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _loop_kwargs(h, w, cfg: KernelConfig, inv_temp):
    n, d = h.shape
    return dict(n_rows=n, n_vocab=w.shape[1], n_hidden=d, bt=cfg.block_t, bv=cfg.block_v, bd=cfg.block_d,
                inv_temp=inv_temp, precision=_precision(h.dtype), barrier=not cfg.interpret)


def _loop_forward(h, w, tgt, *, inv_temp, cfg: KernelConfig):
    n = h.shape[0]
    out = jax.ShapeDtypeStruct((n,), jnp.float32)
    return tuple(_pallas_call(
        cfg,
        functools.partial(_loop_fwd_kernel, **_loop_kwargs(h, w, cfg, inv_temp)),
        grid=(pl.cdiv(n, cfg.block_t),),
        out_shape=[out, out, out],
        compiler_params=_loop_compiler_params(cfg),
        interpret=cfg.interpret,
        name="grpo_fused_logprobs_fwd_loop",
    )(h, w, tgt))


def _loop_backward(h, w, tgt, lse, g, ge, ent, *, inv_temp, cfg: KernelConfig):
    n, d = h.shape
    kw = _loop_kwargs(h, w, cfg, inv_temp)
    dh = _pallas_call(
        cfg,
        functools.partial(_loop_dh_kernel, **kw),
        grid=(pl.cdiv(n, cfg.block_t),),
        out_shape=jax.ShapeDtypeStruct((n, d), jnp.float32),
        compiler_params=_loop_compiler_params(cfg),
        interpret=cfg.interpret,
        name="grpo_fused_logprobs_dh_loop",
    )(h, w, tgt, lse, g, ge, ent)
    return dh.astype(h.dtype), _loop_dw(h, w, tgt, lse, g, ge, ent, kw=kw, cfg=cfg)


def _loop_dw(h, w, tgt, lse, g, ge, ent, *, kw, cfg: KernelConfig):
    """dW [D, V] in w's dtype, through an f32 buffer of at most ``cfg.dw_chunk`` columns.

    The loop schedule accumulates dW over row blocks in its (f32) output, read-modify-write;
    one f32 [D, V] buffer would be 1.2 GB at D=2048, V=151643. So the vocabulary goes in
    chunks: each kernel call fills an f32 [D, chunk] buffer, which is cast and written into
    the result. The last chunk starts at V - chunk (it overlaps the one before, whose
    columns it recomputes identically) so that every update lies inside the result.
    """
    d, v = w.shape
    bv = cfg.block_v
    chunk = min(v, max(bv, cfg.dw_chunk // bv * bv))
    kw = {k: x for k, x in kw.items() if k != "n_vocab"}
    call = _pallas_call(
        cfg,
        functools.partial(_loop_dw_kernel, n_cols=chunk, **kw),
        grid=(pl.cdiv(chunk, bv),),
        out_shape=jax.ShapeDtypeStruct((d, chunk), jnp.float32),
        compiler_params=_loop_compiler_params(cfg),
        interpret=cfg.interpret,
        name="grpo_fused_logprobs_dw_loop",
    )
    n_chunks = pl.cdiv(v, chunk)

    def one(c, dw):
        start = jnp.minimum(c * chunk, v - chunk).astype(jnp.int32)
        part = call(start[None], h, w, tgt, lse, g, ge, ent)  # D chunk, f32
        return lax.dynamic_update_slice(dw, part.astype(w.dtype), (jnp.int32(0), start))

    if n_chunks == 1:
        return call(jnp.zeros((1,), jnp.int32), h, w, tgt, lse, g, ge, ent).astype(w.dtype)
    return lax.fori_loop(0, n_chunks, one, jnp.zeros((d, v), w.dtype))


# --------------------------------------------------------------------------- custom VJP


def _forward(h, w, tgt, inv_temp, cfg):
    fn = _grid_forward if cfg.schedule == "grid" else _loop_forward
    return fn(h, w, tgt, inv_temp=inv_temp, cfg=cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused(h, w, tgt, inv_temp, cfg):
    logp, _, ent = _forward(h, w, tgt, inv_temp, cfg)
    return logp, ent


def _fused_fwd(h, w, tgt, inv_temp, cfg):
    logp, lse, ent = _forward(h, w, tgt, inv_temp, cfg)
    return (logp, ent), (h, w, tgt, lse, ent)


def _fused_bwd(inv_temp, cfg, res, cts):
    h, w, tgt, lse, ent = res
    g, ge = cts  # ge: the entropy's cotangent (zero unless the loss has an entropy bonus)
    fn = _grid_backward if cfg.schedule == "grid" else _loop_backward
    dh, dw = fn(h, w, tgt, lse, g.astype(jnp.float32), ge.astype(jnp.float32), ent, inv_temp=inv_temp, cfg=cfg)
    return dh, dw, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_token_logprobs(
    *,
    hidden: jax.Array,
    head_weight: jax.Array,
    targets: jax.Array,
    temperature: float,
    config: KernelConfig,
) -> tuple[jax.Array, jax.Array]:
    """``log_softmax(hidden @ head_weight / temperature)[targets]`` without the logits.

    hidden [B, T, D], head_weight [D, V], targets [B, T] -> (logp [B, T] f32 and entropy
    [B, T] f32, both with a custom VJP to hidden and head_weight).
    """
    b, t, d = hidden.shape
    h = hidden.reshape(b * t, d)  # N D
    tgt = targets.reshape(b * t).astype(jnp.int32)  # N
    if head_weight.dtype != h.dtype:
        head_weight = head_weight.astype(h.dtype)
    logp, ent = _fused(h, head_weight, tgt, 1.0 / float(temperature), config)
    return logp.reshape(b, t), ent.reshape(b, t)


__all__ = ["KernelConfig", "MASK_VALUE", "fused_token_logprobs"]
