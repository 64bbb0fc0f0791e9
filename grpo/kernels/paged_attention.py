"""Decode attention over a paged KV cache, by backend: one query token per row, reading
only the pages the row holds (the pool's layout: :mod:`grpo.models.layers.paged`).

One layer's pool is ``[kv_heads, pages, page_size, head_dim]`` and a row's page table
``[max_pages]`` int32 lists its pages in token order. Backends
(``paged_attention(..., backend=)``), all ``[B, H, E]`` in, ``[B, H, E]`` out:

- ``reference``: plain JAX: gather the row's pages by its table, mask by its length,
  float32 softmax. Runs everywhere; the CPU path and the tests' reference.
- ``tpu``: the Pallas TPU decode kernel (``jax.experimental.pallas.ops.tpu.paged_attention``;
  Mosaic, compiled for TPU only).
- ``gpu``: the Pallas GPU decode kernel (``jax.experimental.pallas.ops.gpu.paged_attention``;
  Triton); ``interpret=True`` runs it on CPU.
- ``auto``: ``tpu`` on a TPU backend, ``gpu`` on a GPU backend, else ``reference``.

A quantized pool's layer (``k_pages``/``v_pages`` a
:class:`grpo.models.layers.paged.QuantizedPages`: int8/fp8 codes and a float32 scale per
token and head) goes to the TPU kernel as its ``QuantizedTensor`` (it reads the codes and
dequantizes in VMEM); the reference dequantizes the pages it gathers (XLA fuses it into
the gather); the GPU kernel takes no codes, so the layer is dequantized before the call
(the pool holds twice the rows, but the step reads no fewer bytes).

Neither kernel takes a softmax scale, so the query is scaled before the call (as the
dense path's ``scale``). Lengths count the valid tokens including the one just written;
a length of 0 (an empty decode slot) is raised to 1: the slot reads page 0's first token,
a finite value nobody uses.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

BACKENDS: tuple[str, ...] = ("auto", "reference", "tpu", "gpu")


def paged_attention_reference(*, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                              page_table: jax.Array, scale: float) -> jax.Array:
    """Plain-JAX paged decode attention.

    q [B, H, E]; k_pages, v_pages [KH, P, ps, E] (one layer); lengths [B] valid tokens
    (the query's own included); page_table [B, max_pages]. Returns [B, H, E] in q's dtype;
    logits and softmax in float32."""
    B, H, E = q.shape
    KH, _, ps, _ = k_pages.shape
    G = H // KH
    k = _gather(k_pages, page_table).reshape(KH, B, -1, E)  # KH B S E, S = max_pages * ps
    v = _gather(v_pages, page_table).reshape(KH, B, -1, E)
    qg = q.reshape(B, KH, G, E).astype(jnp.float32) * jnp.float32(scale)
    logits = jnp.einsum("bkge,kbse->bkgs", qg, k.astype(jnp.float32))  # B KH G S
    visible = jnp.arange(k.shape[2])[None, :] < jnp.maximum(lengths, 1)[:, None]  # B S
    logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgs,kbse->bkge", probs, v.astype(jnp.float32))
    return out.reshape(B, H, E).astype(q.dtype)


def _gather(pages: Any, page_table: jax.Array) -> jax.Array:
    """``pages[:, page_table]`` [KH, B, W, ps, E] in float32 (dequantized when quantized)."""
    if hasattr(pages, "codes"):
        return pages.codes[:, page_table].astype(jnp.float32) * pages.scales[:, page_table][..., None]
    return pages[:, page_table].astype(jnp.float32)


def _dense(pages: Any, dtype: Any) -> jax.Array:
    """A layer's pages in ``dtype`` (a quantized layer dequantized)."""
    if hasattr(pages, "codes"):
        return (pages.codes.astype(jnp.float32) * pages.scales[..., None]).astype(dtype)
    return pages.astype(dtype)


def _compute_block(max_pages: int, want: int) -> int:
    """The largest divisor of ``max_pages`` not above ``want`` (the kernels need one)."""
    return max(d for d in range(1, min(want, max_pages) + 1) if max_pages % d == 0)


def paged_attention_tpu(*, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                        page_table: jax.Array, scale: float, pages_per_compute_block: int = 8) -> jax.Array:
    """The Pallas TPU decode kernel (same contract as :func:`paged_attention_reference`)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

    block = _compute_block(page_table.shape[1], pages_per_compute_block)
    qs = (q.astype(jnp.float32) * jnp.float32(scale)).astype(q.dtype)
    k, v = _tpu_pages(k_pages, q.dtype), _tpu_pages(v_pages, q.dtype)
    return kernel(qs, k, v, jnp.maximum(lengths, 1).astype(jnp.int32), page_table.astype(jnp.int32),
                  pages_per_compute_block=block)


def _tpu_pages(pages: Any, dtype: Any) -> Any:
    """A layer's pages as the TPU kernel takes them: a plain array in ``dtype``, or its
    ``QuantizedTensor`` (codes, and scales [KH, P, ps, 1] as the kernel's ``h``: it
    computes ``code * h / 127.5``, so ``h = scale * 127.5``)."""
    if not hasattr(pages, "codes"):
        return pages.astype(dtype)
    from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import MAX_INT8, QuantizedTensor

    return QuantizedTensor(weight=pages.codes, scales=(pages.scales * MAX_INT8)[..., None])


def paged_attention_gpu(*, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                        page_table: jax.Array, scale: float, pages_per_compute_block: int = 8,
                        interpret: bool = False) -> jax.Array:
    """The Pallas GPU decode kernel (same contract; ``interpret`` runs it on CPU)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as kernel

    block = _compute_block(page_table.shape[1], pages_per_compute_block)
    qs = (q.astype(jnp.float32) * jnp.float32(scale)).astype(q.dtype)
    return kernel(qs, _dense(k_pages, q.dtype), _dense(v_pages, q.dtype), page_table.astype(jnp.int32),
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


__all__ = [
    "BACKENDS", "paged_attention", "paged_attention_gpu", "paged_attention_reference", "paged_attention_tpu",
    "resolve_backend",
]
