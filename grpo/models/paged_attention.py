"""Decode attention over a paged KV cache: one query token per row, reading only the
pages the row holds.

The pool keeps every layer's keys and values as ``[layers, kv_heads, pages, page_size,
head_dim]``: the layout both of JAX's Pallas decode kernels take per layer
(``jax.experimental.pallas.ops.tpu.paged_attention`` and
``jax.experimental.pallas.ops.gpu.paged_attention``: ``[kv_heads, pages, page_size,
head_dim]``), so a layer's slice goes to a kernel without a transpose (a transpose would
copy the whole pool every step); KV heads lead, so the serving layout shards them over
``tp`` like the dense cache. A row's page table ``[max_pages]`` int32 lists its pages in
token order: token ``i`` is at page ``table[i // page_size]``, offset ``i % page_size``.

Backends (``paged_attention(..., backend=)``), all ``[B, H, E]`` in, ``[B, H, E]`` out:

- ``reference``: plain JAX: gather the row's pages by its table, mask by its length,
  float32 softmax. Runs everywhere; the CPU path and the tests' reference.
- ``tpu``: the Pallas TPU decode kernel (Mosaic; compiled for TPU only).
- ``gpu``: the Pallas GPU decode kernel (Triton); ``interpret=True`` runs it on CPU.
- ``auto``: ``tpu`` on a TPU backend, ``gpu`` on a GPU backend, else ``reference``.

Neither kernel takes a softmax scale, so the query is scaled before the call (as the
dense path's ``scale``). Lengths count the valid tokens including the one just written;
a length of 0 (an empty decode slot) is raised to 1: the slot reads page 0's first token,
a finite value nobody uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

BACKENDS: tuple[str, ...] = ("auto", "reference", "tpu", "gpu")


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


def write_token(*, pool: jax.Array, layer: jax.Array, new: jax.Array, page_table: jax.Array, lengths: jax.Array,
                live: jax.Array) -> jax.Array:
    """``pool`` [L, KH, P, ps, E] with ``new`` [B, KH, E] written at token ``lengths[b]`` of
    each live row of ``layer`` (other rows' writes are dropped: an out-of-range page)."""
    P, ps = pool.shape[2], pool.shape[3]
    idx = jnp.minimum(lengths // ps, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, idx[:, None], axis=1)[:, 0]  # B
    page = jnp.where(live, page, P)  # out of range: dropped
    offset = lengths % ps
    # Advanced indices (layer, page, offset) around a slice: the indexed dims are [B, KH, E].
    return pool.at[layer, :, page, offset].set(new.astype(pool.dtype), mode="drop")


def paged_attention_reference(*, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                              page_table: jax.Array, scale: float) -> jax.Array:
    """Plain-JAX paged decode attention.

    q [B, H, E]; k_pages, v_pages [KH, P, ps, E] (one layer); lengths [B] valid tokens
    (the query's own included); page_table [B, max_pages]. Returns [B, H, E] in q's dtype;
    logits and softmax in float32."""
    B, H, E = q.shape
    KH, _, ps, _ = k_pages.shape
    G = H // KH
    k = k_pages[:, page_table].reshape(KH, B, -1, E)  # KH B S E, S = max_pages * ps
    v = v_pages[:, page_table].reshape(KH, B, -1, E)
    qg = q.reshape(B, KH, G, E).astype(jnp.float32) * jnp.float32(scale)
    logits = jnp.einsum("bkge,kbse->bkgs", qg, k.astype(jnp.float32))  # B KH G S
    visible = jnp.arange(k.shape[2])[None, :] < jnp.maximum(lengths, 1)[:, None]  # B S
    logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgs,kbse->bkge", probs, v.astype(jnp.float32))
    return out.reshape(B, H, E).astype(q.dtype)


def _compute_block(max_pages: int, want: int) -> int:
    """The largest divisor of ``max_pages`` not above ``want`` (the kernels need one)."""
    return max(d for d in range(1, min(want, max_pages) + 1) if max_pages % d == 0)


def paged_attention_tpu(*, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                        page_table: jax.Array, scale: float, pages_per_compute_block: int = 8) -> jax.Array:
    """The Pallas TPU decode kernel (same contract as :func:`paged_attention_reference`)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

    block = _compute_block(page_table.shape[1], pages_per_compute_block)
    qs = (q.astype(jnp.float32) * jnp.float32(scale)).astype(q.dtype)
    return kernel(qs, k_pages.astype(q.dtype), v_pages.astype(q.dtype), jnp.maximum(lengths, 1).astype(jnp.int32),
                  page_table.astype(jnp.int32), pages_per_compute_block=block)


def paged_attention_gpu(*, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                        page_table: jax.Array, scale: float, pages_per_compute_block: int = 8,
                        interpret: bool = False) -> jax.Array:
    """The Pallas GPU decode kernel (same contract; ``interpret`` runs it on CPU)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as kernel

    block = _compute_block(page_table.shape[1], pages_per_compute_block)
    qs = (q.astype(jnp.float32) * jnp.float32(scale)).astype(q.dtype)
    return kernel(qs, k_pages.astype(q.dtype), v_pages.astype(q.dtype), page_table.astype(jnp.int32),
                  jnp.maximum(lengths, 1).astype(jnp.int32), pages_per_compute_block=block,
                  k_splits=1, interpret=interpret)


def resolve_backend(backend: str, platform: str | None = None, head_dim: int | None = None) -> str:
    """``auto`` -> the kernel of ``platform`` (the devices the call runs on; default: JAX's
    default backend): ``tpu``, ``gpu``, else ``reference``. ``grpo plan`` lowers on a
    host for TPU devices, so it passes the mesh's platform to compile what a TPU runs.
    The TPU kernel's blocks need ``head_dim`` a multiple of 128 (Mosaic's lane width);
    ``auto`` takes the reference for other head sizes (e.g. the tiny test model)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown paged attention backend {backend!r}; choose one of {list(BACKENDS)}")
    if backend != "auto":
        return backend
    platform = platform or jax.default_backend()
    chosen = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu"}.get(platform, "reference")
    if chosen == "tpu" and head_dim is not None and head_dim % 128:
        return "reference"
    return chosen


def paged_attention(*, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                    page_table: jax.Array, scale: float, backend: str = "reference") -> jax.Array:
    """Decode attention of q [B, H, E] over each row's pages with ``backend``."""
    fn: Any = {"reference": paged_attention_reference, "tpu": paged_attention_tpu,
               "gpu": paged_attention_gpu}[resolve_backend(backend)]
    return fn(q=q, k_pages=k_pages, v_pages=v_pages, lengths=lengths, page_table=page_table, scale=scale)


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """How a paged decode step runs (static): the attention ``backend`` and the pool's
    layout on the mesh: rows (decode slots) and the pool's pages over ``slot_axes`` (a
    device's rows hold pages of its own part of the pool only), KV heads over ``kv_axes``
    (disjoint from ``slot_axes``). Page tables hold global page indices."""

    backend: str = "auto"
    slot_axes: tuple[str, ...] = ()
    kv_axes: tuple[str, ...] = ()

    def pool_spec(self) -> PartitionSpec:
        """The pool's [layers, kv_heads, pages, page_size, head_dim] partition."""
        return PartitionSpec(None, self.kv_axes or None, self.slot_axes or None, None, None)


def _decode_local(q, k_new, v_new, pool_k, pool_v, layer, page_table, lengths, live, first_page, *, scale, backend):
    """Write and attend on one device's part: global pages -> local (``first_page`` of its
    part subtracted, clipped into it for rows that write nothing)."""
    local = jnp.clip(page_table - first_page, 0, pool_k.shape[2] - 1)
    pool_k = write_token(pool=pool_k, layer=layer, new=k_new, page_table=local, lengths=lengths, live=live)
    pool_v = write_token(pool=pool_v, layer=layer, new=v_new, page_table=local, lengths=lengths, live=live)
    k_layer = jax.lax.dynamic_index_in_dim(pool_k, layer, axis=0, keepdims=False)  # KH P ps E
    v_layer = jax.lax.dynamic_index_in_dim(pool_v, layer, axis=0, keepdims=False)
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
    if mesh is None or mesh.size == 1:
        return _decode_local(q, k_new, v_new, pool_k, pool_v, layer, page_table, lengths, live, 0, scale=scale,
                             backend=backend)
    rows, heads = spec.slot_axes or None, spec.kv_axes or None

    def body(qb, kb, vb, pk, pv, lb, tb, nb, live_b):
        first = (jax.lax.axis_index(spec.slot_axes) if spec.slot_axes else 0) * pk.shape[2]
        return _decode_local(qb, kb, vb, pk, pv, lb, tb, nb, live_b, first, scale=scale, backend=backend)

    act, pool = PartitionSpec(rows, heads, None), spec.pool_spec()
    return jax.shard_map(
        body, mesh=mesh, check_vma=False,
        in_specs=(act, act, act, pool, pool, PartitionSpec(), PartitionSpec(rows, None), PartitionSpec(rows),
                  PartitionSpec(rows)),
        out_specs=(act, pool, pool),
    )(q, k_new, v_new, pool_k, pool_v, layer, page_table, lengths, live)


__all__ = [
    "BACKENDS", "PagedKVCache", "PagedSpec", "paged_attention", "paged_attention_gpu", "paged_attention_reference",
    "paged_attention_tpu", "paged_decode", "resolve_backend", "write_token",
]
