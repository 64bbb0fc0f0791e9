"""A quantized page pool (issue 53, item 3): tokens written as int8/fp8 codes with a
scale per token and KV head, read back within the format's bound, and the reference
decode attention over quantized pages equal to it over their dequantized values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from grpo.kernels.paged_attention import paged_attention_reference
from grpo.models import rollout_quant as rq
from grpo.models.layers.paged import QuantizedPages, dequantize_kv, pool_layer, quantize_kv, write_token

L, KH, P, PS, E, B, H = 2, 2, 6, 4, 8, 3, 4


@pytest.mark.parametrize("fmt", rq.FORMATS)
def test_written_tokens_round_trip_per_token_and_head(fmt):
    rng = np.random.default_rng(0)
    pool = QuantizedPages(jnp.zeros((L, KH, P, PS, E), rq.CODE_DTYPES[fmt]), jnp.zeros((L, KH, P, PS), jnp.float32))
    new = rng.normal(size=(B, KH, E)).astype(np.float32)
    table = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    lengths = np.array([0, 5, 3], np.int32)
    live = np.array([True, True, False])
    out = write_token(pool=pool, layer=jnp.int32(1), new=jnp.asarray(new), page_table=jnp.asarray(table),
                      lengths=jnp.asarray(lengths), live=jnp.asarray(live))
    assert isinstance(out, QuantizedPages) and out.codes.dtype == rq.CODE_DTYPES[fmt]
    back = np.asarray(dequantize_kv(out.codes, out.scales))
    for b in range(2):  # the live rows: token lengths[b] at page table[b][len // PS], offset len % PS
        page, off = table[b][lengths[b] // PS], lengths[b] % PS
        absmax = np.abs(new[b]).max(-1)
        np.testing.assert_allclose(np.asarray(out.scales)[1, :, page, off], absmax / rq.QMAX[fmt], rtol=1e-6)
        err = np.abs(back[1, :, page, off] - new[b]).max(-1)
        assert np.all(err <= rq.max_error(fmt) * absmax + 1e-7)
    assert not np.asarray(out.codes)[1, :, 4:].any() and not np.asarray(out.codes)[0].any()  # dead row, other layer


def test_reference_attention_over_quantized_pages_is_over_their_values():
    rng = np.random.default_rng(1)
    k, v = (rng.normal(size=(KH, P, PS, E)).astype(np.float32) for _ in range(2))
    kq, vq = (QuantizedPages(*quantize_kv(jnp.asarray(x), "int8")) for x in (k, v))
    q = jnp.asarray(rng.normal(size=(B, H, E)), jnp.float32)
    table = jnp.asarray([[0, 1], [2, 3], [4, 5]], jnp.int32)
    lengths = jnp.asarray([3, 8, 5], jnp.int32)
    got = paged_attention_reference(q=q, k_pages=kq, v_pages=vq, lengths=lengths, page_table=table, scale=0.3)
    want = paged_attention_reference(q=q, k_pages=dequantize_kv(*kq), v_pages=dequantize_kv(*vq), lengths=lengths,
                                     page_table=table, scale=0.3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    full = paged_attention_reference(q=q, k_pages=jnp.asarray(k), v_pages=jnp.asarray(v), lengths=lengths,
                                     page_table=table, scale=0.3)
    assert 0 < np.abs(np.asarray(got) - np.asarray(full)).max() < 0.05
    layer = pool_layer(QuantizedPages(kq.codes[None], kq.scales[None]), jnp.int32(0))
    assert layer.codes.shape == (KH, P, PS, E) and layer.scales.shape == (KH, P, PS)
