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

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

BACKENDS: tuple[str, ...] = ("auto", "reference", "tpu", "gpu")
POOL_AXES: tuple[str | None, ...] = ("layers", "kv_heads", None, None, "head_dim")


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


def sharded_paged_attention(*, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                            page_table: jax.Array, scale: float, backend: str, mesh: Any,
                            rules: Mapping[str, Any]) -> jax.Array:
    """:func:`paged_attention` with a kernel backend run per device under ``shard_map``
    (a Pallas call is opaque to XLA's partitioner): rows over their batch axes, KV heads
    over theirs, each device holding the pages of the whole pool for its KV heads (a
    device's rows may sit in any page). The reference runs as is (XLA partitions it)."""
    backend = resolve_backend(backend, None if mesh is None else mesh.devices.flat[0].platform, q.shape[-1])
    if backend == "reference" or mesh is None or mesh.size == 1:
        return paged_attention(q=q, k_pages=k_pages, v_pages=v_pages, lengths=lengths, page_table=page_table,
                               scale=scale, backend=backend)
    from grpo.models.attention import head_specs

    B, H, E = q.shape
    KH = k_pages.shape[0]
    qspec, kspec, rest = head_specs((B, 1, H, E), (B, 1, KH, E), mesh, rules)
    group = H // KH
    pool_spec = PartitionSpec(kspec[2], None, None, None)

    def body(qb, kb, vb, nb, tb):
        if rest:  # this device's query heads read a slice of its KV shard
            local = qb.shape[1]
            start = (jax.lax.axis_index(rest) * local) // group
            size = max(1, local // group)
            kb = jax.lax.dynamic_slice_in_dim(kb, start, size, axis=0)
            vb = jax.lax.dynamic_slice_in_dim(vb, start, size, axis=0)
        return paged_attention(q=qb, k_pages=kb, v_pages=vb, lengths=nb, page_table=tb, scale=scale,
                               backend=backend)

    q3 = PartitionSpec(qspec[0], qspec[2], None)
    return jax.shard_map(
        body, mesh=mesh, in_specs=(q3, pool_spec, pool_spec, PartitionSpec(qspec[0]), PartitionSpec(qspec[0], None)),
        out_specs=q3, check_vma=False,
    )(q, k_pages, v_pages, lengths, page_table)


__all__ = [
    "BACKENDS", "sharded_paged_attention", "POOL_AXES", "PagedKVCache", "paged_attention", "paged_attention_gpu", "paged_attention_reference",
    "paged_attention_tpu", "resolve_backend", "write_token",
]
