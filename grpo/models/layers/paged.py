"""The paged KV cache on the device: the pool, each row's page table, and one decode
step's write and attention, per device on a mesh.

The pool keeps every layer's keys and values as ``[layers, kv_heads, pages, page_size,
head_dim]``: the layout both of JAX's Pallas decode kernels take per layer
(:mod:`grpo.kernels.paged_attention`: ``[kv_heads, pages, page_size, head_dim]``), so a
layer's slice goes to a kernel without a transpose (a transpose would copy the whole pool
every step); KV heads lead, so the serving layout shards them over ``tp`` like the dense
cache. A row's page table ``[max_pages]`` int32 lists its pages in token order: token
``i`` is at page ``table[i // page_size]``, offset ``i % page_size``. Which pages a row
holds is the engine's (:class:`grpo.engine.rollout.paged.PageAllocator`).

A quantized pool (``rollout.quantization.kv_cache``: int8 or fp8) is a
:class:`QuantizedPages`: the codes in the same layout and one float32 scale per token and
KV head ``[layers, kv_heads, pages, page_size]`` beside them (``scale = absmax / qmax``
of the token's head vector, fixed when the token is written: a page fills token by token,
so a scale per whole page would have to be known before its tokens are). It is the
layout JAX's Pallas TPU decode kernel reads (``QuantizedTensor``); the other backends
dequantize the pages they gather. :func:`pool_set`, :func:`pool_layer` and
:func:`pool_gather` read and write either form.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from grpo.kernels.paged_attention import BACKENDS, paged_attention, resolve_backend


class QuantizedPages(NamedTuple):
    """A quantized page pool: ``codes`` [..., page_size, head_dim] (int8 / float8_e4m3fn)
    and ``scales`` [..., page_size] float32, a token's head vector being ``codes * scale``."""

    codes: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def fmt(self) -> str:
        return "int8" if self.codes.dtype == jnp.int8 else "fp8"


def quantize_kv(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """``(codes, scales)`` of key/value vectors ``x`` [..., E]: one scale per vector
    (absmax / qmax, float32; 1 for an all-zero vector)."""
    from grpo.models.rollout_quant import CODE_DTYPES, QMAX

    xf = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(absmax > 0, absmax / QMAX[fmt], 1.0)
    y = xf / scale[..., None]
    if fmt == "int8":
        return jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8), scale
    return jnp.clip(y, -448.0, 448.0).astype(CODE_DTYPES[fmt]), scale


def dequantize_kv(codes: jax.Array, scales: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """``codes * scales`` [..., E] in ``dtype``."""
    return (codes.astype(jnp.float32) * scales[..., None]).astype(dtype)


def pool_set(pool: Any, index: tuple, values: jax.Array, *, mode: str | None = None, bits: bool = False) -> Any:
    """``pool.at[index].set(values)`` for a plain or a :class:`QuantizedPages` pool
    (``values`` [..., E] quantized per vector; ``index`` selects whole head vectors);
    ``bits``: a plain 16-bit float pool through :func:`scatter_set`'s bit pattern (XLA:CPU;
    a quantized pool's codes and scales scatter natively)."""
    if not isinstance(pool, QuantizedPages):
        return scatter_set(pool, index, values, bits=bits, mode=mode)
    codes, scales = quantize_kv(values, pool.fmt)
    return QuantizedPages(pool.codes.at[index].set(codes, mode=mode), pool.scales.at[index].set(scales, mode=mode))


def pool_layer(pool: Any, layer: jax.Array) -> Any:
    """One layer's pages [KH, P, ps, E] (a :class:`QuantizedPages` of them when quantized)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, axis=0, keepdims=False), pool)


def pool_gather(pool: Any, index: Any, dtype: Any) -> jax.Array:
    """``pool[:, :, index]`` in ``dtype`` (dequantized when quantized)."""
    if not isinstance(pool, QuantizedPages):
        return pool[:, :, index].astype(dtype)
    return dequantize_kv(pool.codes[:, :, index], pool.scales[:, :, index], dtype)


def dense_dtype(pool: Any, compute_dtype: Any) -> Any:
    """The dtype a dense cache written into ``pool`` is computed in (the pool's own, or the
    compute dtype for a quantized pool)."""
    return compute_dtype if isinstance(pool, QuantizedPages) else pool.dtype


class PagedKVCache(NamedTuple):
    """Decode state of the paged cache for one model call (a plain pytree).

    ``k``/``v``: the pool [layers, kv_heads, pages, page_size, head_dim];
    ``page_table``: [B, max_pages] int32; ``lengths``: [B] int32 tokens already cached per
    row (the new token is written at index ``lengths`` and attended to with them);
    ``live``: [B] bool, rows whose token is written (others write nothing)."""

    k: jax.Array
    v: jax.Array
    page_table: jax.Array
    lengths: jax.Array
    live: jax.Array

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def pages(self) -> int:
        return self.k.shape[2]


def scatter_set(pool: jax.Array, index: tuple[Any, ...], values: jax.Array, *, bits: bool = False,
                mode: str | None = "drop") -> jax.Array:
    """``pool.at[index].set(values, mode=mode)``; with ``bits``, a 16-bit float pool is
    written through its bit pattern (bit-identical).

    XLA:CPU has no bf16/f16 scatter: it converts the whole operand to f32, scatters and
    converts it back, three passes over the pool for a write of a few tokens (measured:
    a 16-step chunk of 2 slots took as long as one of 32, about 1.3 s, on a 2,560-page
    pool of the tiny model). An integer scatter of the same bits runs in place."""
    values = values.astype(pool.dtype)
    if not (bits and pool.dtype.itemsize == 2 and jnp.issubdtype(pool.dtype, jnp.floating)):
        return pool.at[index].set(values, mode=mode)
    as_int = jax.lax.bitcast_convert_type(pool, jnp.uint16)
    out = as_int.at[index].set(jax.lax.bitcast_convert_type(values, jnp.uint16), mode=mode)
    return jax.lax.bitcast_convert_type(out, pool.dtype)


def bitwise_scatter(platform: str | None) -> bool:
    """Whether a pool write on ``platform`` (None: JAX's default backend) goes through
    :func:`scatter_set`'s bit pattern: on CPU only, where a 16-bit float scatter is not
    native; accelerators scatter bf16 in place."""
    return (platform or jax.default_backend()) == "cpu"


def write_token(*, pool: jax.Array, layer: jax.Array, new: jax.Array, page_table: jax.Array, lengths: jax.Array,
                live: jax.Array, bits: bool = False) -> jax.Array:
    """``pool`` [L, KH, P, ps, E] with ``new`` [B, KH, E] written at token ``lengths[b]`` of
    each live row of ``layer`` (other rows' writes are dropped: an out-of-range page);
    ``bits``: through :func:`scatter_set`'s bit pattern (XLA:CPU)."""
    P, ps = pool.shape[2], pool.shape[3]
    idx = jnp.minimum(lengths // ps, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, idx[:, None], axis=1)[:, 0]  # B
    page = jnp.where(live, page, P)  # out of range: dropped
    offset = lengths % ps
    # Advanced indices (layer, page, offset) around a slice: the indexed dims are [B, KH, E].
    return pool_set(pool, (layer, slice(None), page, offset), new, mode="drop", bits=bits)


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """How a paged decode step runs (static): the attention ``backend`` and the pool's
    layout on the mesh: rows (decode slots) and the pool's pages over ``slot_axes`` (a
    device's rows hold pages of its own part of the pool only), KV heads over ``kv_axes``
    (disjoint from ``slot_axes``). Page tables hold global page indices."""

    backend: str = "auto"
    slot_axes: tuple[str, ...] = ()
    kv_axes: tuple[str, ...] = ()

    def pool_spec(self, pool: Any = None) -> Any:
        """The pool's [layers, kv_heads, pages, page_size, head_dim] partition (for a
        :class:`QuantizedPages` ``pool``, its codes' and its scales')."""
        spec = PartitionSpec(None, self.kv_axes or None, self.slot_axes or None, None, None)
        if isinstance(pool, QuantizedPages):
            return QuantizedPages(spec, PartitionSpec(*spec[:4]))
        return spec


def _decode_local(q, k_new, v_new, pool_k, pool_v, layer, page_table, lengths, live, first_page, *, scale, backend,
                  bits=False):
    """Write and attend on one device's part: global pages -> local (``first_page`` of its
    part subtracted, clipped into it for rows that write nothing)."""
    local = jnp.clip(page_table - first_page, 0, pool_k.shape[2] - 1)
    pool_k = write_token(pool=pool_k, layer=layer, new=k_new, page_table=local, lengths=lengths, live=live, bits=bits)
    pool_v = write_token(pool=pool_v, layer=layer, new=v_new, page_table=local, lengths=lengths, live=live, bits=bits)
    k_layer = pool_layer(pool_k, layer)  # KH P ps E
    v_layer = pool_layer(pool_v, layer)
    out = paged_attention(q=q, k_pages=k_layer, v_pages=v_layer, lengths=lengths + 1, page_table=local, scale=scale,
                          backend=backend)
    return out, pool_k, pool_v


def paged_decode(*, q: jax.Array, k_new: jax.Array, v_new: jax.Array, pool_k: jax.Array, pool_v: jax.Array,
                 layer: jax.Array, page_table: jax.Array, lengths: jax.Array, live: jax.Array, scale: float,
                 spec: PagedSpec, mesh: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode token per row over a paged pool: ``k_new``/``v_new`` [B, KH, E] written at
    token ``lengths`` of each live row's pages of ``layer``, then q [B, H, E] attends over
    the row's ``lengths + 1`` tokens. Returns (out [B, H, E], pool_k, pool_v).

    On a mesh it runs per device under ``shard_map`` (rows and pages over ``spec.slot_axes``,
    KV heads and their query heads over ``spec.kv_axes``), so each device reads and writes
    its own part of the pool whatever the backend (a Pallas call is opaque to XLA's
    partitioner, and a gather by a data-dependent page table would be all-gathered)."""
    platform = None if mesh is None else mesh.devices.flat[0].platform
    backend = resolve_backend(spec.backend, platform, q.shape[-1])
    bits = bitwise_scatter(platform)
    if mesh is None or mesh.size == 1:
        return _decode_local(q, k_new, v_new, pool_k, pool_v, layer, page_table, lengths, live, 0, scale=scale,
                             backend=backend, bits=bits)
    rows, heads = spec.slot_axes or None, spec.kv_axes or None

    def body(qb, kb, vb, pk, pv, lb, tb, nb, live_b):
        first = (jax.lax.axis_index(spec.slot_axes) if spec.slot_axes else 0) * pk.shape[2]  # pages of a part
        return _decode_local(qb, kb, vb, pk, pv, lb, tb, nb, live_b, first, scale=scale, backend=backend, bits=bits)

    act, pool = PartitionSpec(rows, heads, None), spec.pool_spec(pool_k)
    return jax.shard_map(
        body, mesh=mesh, check_vma=False,
        in_specs=(act, act, act, pool, pool, PartitionSpec(), PartitionSpec(rows, None), PartitionSpec(rows),
                  PartitionSpec(rows)),
        out_specs=(act, pool, pool),
    )(q, k_new, v_new, pool_k, pool_v, layer, page_table, lengths, live)


__all__ = ["BACKENDS", "PagedKVCache", "PagedSpec", "QuantizedPages", "bitwise_scatter", "dense_dtype", "dequantize_kv",
           "paged_decode", "pool_gather", "pool_layer", "pool_set", "quantize_kv", "scatter_set", "write_token"]
