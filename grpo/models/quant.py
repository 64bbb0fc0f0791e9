"""Block-wise weight quantization of the frozen base of a QLoRA run (``nf4``, ``int8``).

A projection ``W`` of shape ``[L, N, ...]`` (layers first, then its input dimension) is
cut into blocks of ``block`` consecutive entries along ``N``; each block stores its
absolute maximum (float32) and its entries as codes:

- ``nf4``: 4-bit NormalFloat (QLoRA, Dettmers et al. 2023): the index of the nearest of
  the 16 values of :data:`NF4_VALUES` to ``w / absmax``, stored as ``uint4``;
- ``int8``: symmetric absmax int8, ``round(127 * w / absmax)``.

Dequantization is ``values[code] * absmax`` (nf4) or ``code * absmax / 127`` (int8), done
per layer inside the decoder's scan, so only one layer's weight exists in the compute
dtype at a time. The error bound of each format is :func:`max_error`. The scales are not
quantized again (QLoRA's "double quantization" would save another ~0.4 bit per weight).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The NF4 code book: quantiles of N(0, 1) normalised to [-1, 1], with an exact zero
# (the table bitsandbytes and the QLoRA paper use).
NF4_VALUES = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171447754,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    np.float32,
)
KINDS = ("nf4", "int8")
CODE_DTYPES = {"nf4": jnp.uint4, "int8": jnp.int8}


def block_size(n: int, block: int) -> int:
    """The block actually used along a dimension of size ``n``: ``block`` when it divides
    ``n``, otherwise their greatest common divisor (smaller blocks, never a ragged one)."""
    return block if n % block == 0 else math.gcd(n, block)


def scale_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """Shape of the per-block scales of a weight of ``shape`` (blocks along dim 1)."""
    b = block_size(shape[1], block)
    return (shape[0], shape[1] // b) + tuple(shape[2:])


def _blocked(w: jax.Array, b: int) -> jax.Array:
    return w.reshape((w.shape[0], w.shape[1] // b, b) + tuple(w.shape[2:]))


def quantize(w: jax.Array, kind: str, block: int = 64) -> tuple[jax.Array, jax.Array]:
    """``(codes, scales)`` of ``w`` [L, N, ...]: codes like ``w`` (uint4 / int8), scales
    [L, N / b, ...] float32."""
    if kind not in KINDS:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {KINDS}")
    b = block_size(w.shape[1], block)
    x = _blocked(w.astype(jnp.float32), b)
    absmax = jnp.max(jnp.abs(x), axis=2, keepdims=True)
    safe = jnp.where(absmax > 0, absmax, 1.0)
    x = x / safe
    if kind == "int8":
        codes = jnp.clip(jnp.round(x * 127.0), -127, 127).astype(jnp.int8)
    else:
        # Nearest code book entry: count the midpoints below x.
        mids = jnp.asarray((NF4_VALUES[1:] + NF4_VALUES[:-1]) / 2)
        codes = jnp.sum(x[..., None] > mids, axis=-1).astype(jnp.uint4)
    return codes.reshape(w.shape), jnp.squeeze(absmax, axis=2)


def dequantize(codes: jax.Array, scales: jax.Array, kind: str, dtype: Any = jnp.float32, *, axis: int = 1) -> jax.Array:
    """The weight in ``dtype`` from :func:`quantize`'s output. ``axis`` is the blocked
    (input) dimension: 1 for the stacked ``[L, N, ...]`` arrays, 0 for one layer's slice
    (``codes`` [N, ...], ``scales`` [N / b, ...]) as the decoder's scan sees it."""
    n, nb = codes.shape[axis], scales.shape[axis]
    shape = codes.shape[:axis] + (nb, n // nb) + codes.shape[axis + 1:]
    if kind == "int8":
        values = codes.astype(jnp.float32) * (1.0 / 127.0)
    elif kind == "nf4":
        values = jnp.take(jnp.asarray(NF4_VALUES), codes.astype(jnp.int32), axis=0)
    else:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {KINDS}")
    w = values.reshape(shape) * jnp.expand_dims(scales.astype(jnp.float32), axis + 1)
    return w.reshape(codes.shape).astype(dtype)


def max_error(kind: str) -> float:
    """Largest ``|dequantize(quantize(w)) - w| / absmax(block)`` of the format (rounding
    to the nearest code: half the widest gap between neighbouring codes)."""
    if kind == "int8":
        return 0.5 / 127.0
    return float(np.max(np.diff(NF4_VALUES)) / 2)


def bits_per_element(dtype: Any) -> int:
    """Storage bits of one element: 4 for the uint4 codes of an nf4 base (TPUs and GPUs
    store them packed, two per byte; libtpu's memory analysis agrees), else the itemsize."""
    try:
        return int(jnp.iinfo(dtype).bits)  # integer dtypes, ml_dtypes' int4/uint4 included
    except ValueError:
        return jnp.dtype(dtype).itemsize * 8


__all__ = ["KINDS", "NF4_VALUES", "bits_per_element", "block_size", "dequantize", "max_error", "quantize", "scale_shape"]
