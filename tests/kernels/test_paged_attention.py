"""Paged decode attention against dense attention over the same tokens (each backend that
runs on CPU), the token write, and the TPU kernel compiled for a TPU topology."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo.kernels.paged_attention import (
    paged_attention, paged_attention_gpu, paged_attention_reference, paged_attention_tpu, resolve_backend,
)
from grpo.models.layers.paged import write_token

B, H, KH, E, PS, MAXP, POOL = 3, 4, 2, 16, 4, 4, 16


def _case(seed=0):
    """Rows of lengths 5, 1, 13 in scattered, disjoint pages of one pool; returns the
    paged inputs and each row's dense keys/values [len, KH, E]."""
    rng = np.random.default_rng(seed)
    lengths = np.array([5, 1, 13], np.int32)
    perm = rng.permutation(POOL)
    table = np.zeros((B, MAXP), np.int32)
    k_pages = rng.normal(size=(KH, POOL, PS, E)).astype(np.float32)  # unheld pages: noise attention must ignore
    v_pages = rng.normal(size=(KH, POOL, PS, E)).astype(np.float32)
    dense_k, dense_v, used = [], [], 0
    for b, n in enumerate(lengths):
        pages = perm[used: used + math.ceil(n / PS)]
        used += len(pages)
        table[b, : len(pages)] = pages
        idx_p, idx_o = pages[np.arange(n) // PS], np.arange(n) % PS
        dense_k.append(k_pages[:, idx_p, idx_o].transpose(1, 0, 2))  # n KH E
        dense_v.append(v_pages[:, idx_p, idx_o].transpose(1, 0, 2))
    q = rng.normal(size=(B, H, E)).astype(np.float32)
    return q, k_pages, v_pages, lengths, table, dense_k, dense_v


def _dense(q, dense_k, dense_v, scale):
    """Independent reference: per row, jax.nn.dot_product_attention over its n tokens."""
    out = []
    for b in range(B):
        o = jax.nn.dot_product_attention(q[b][None, None], dense_k[b][None], dense_v[b][None], scale=scale)
        out.append(np.asarray(o)[0, 0])
    return np.stack(out)


@pytest.fixture(scope="module")
def case():
    return _case()


def test_reference_matches_dense_attention(case):
    q, kp, vp, lengths, table, dk, dv = case
    scale = 1 / math.sqrt(E)
    got = paged_attention_reference(q=q, k_pages=kp, v_pages=vp, lengths=lengths, page_table=table, scale=scale)
    np.testing.assert_allclose(np.asarray(got), _dense(q, dk, dv, scale), rtol=1e-5, atol=1e-5)
    assert resolve_backend("auto") == "reference"  # on CPU
    via = paged_attention(q=q, k_pages=kp, v_pages=vp, lengths=lengths, page_table=table, scale=scale, backend="auto")
    np.testing.assert_array_equal(np.asarray(via), np.asarray(got))


@pytest.mark.slow
def test_gpu_kernel_interpreted_matches_dense(case):
    q, kp, vp, lengths, table, dk, dv = case
    scale = 1 / math.sqrt(E)
    got = paged_attention_gpu(q=q, k_pages=kp, v_pages=vp, lengths=lengths, page_table=table, scale=scale,
                              pages_per_compute_block=2, interpret=True)
    np.testing.assert_allclose(np.asarray(got), _dense(q, dk, dv, scale), rtol=1e-5, atol=1e-5)


def test_write_token_writes_live_rows_only():
    pool = jnp.zeros((2, KH, POOL, PS, E))
    table = jnp.asarray([[3, 7, 0, 0], [5, 0, 0, 0], [9, 0, 0, 0]], jnp.int32)
    lengths = jnp.asarray([5, 2, 0], jnp.int32)
    new = jnp.arange(B * KH * E, dtype=jnp.float32).reshape(B, KH, E) + 1
    out = np.asarray(write_token(pool=pool, layer=jnp.int32(1), new=new, page_table=table, lengths=lengths,
                                 live=jnp.asarray([True, True, False])))
    expect = np.zeros(pool.shape, np.float32)
    expect[1, :, 7, 1] = new[0]  # token 5 -> page table[0, 1] = 7, offset 1
    expect[1, :, 5, 2] = new[1]
    np.testing.assert_array_equal(out, expect)


def test_bf16_write_through_its_bits_equals_the_plain_write():
    """The bit-pattern write (XLA:CPU) leaves the very bits the plain bf16 scatter leaves."""
    from grpo.models.layers.paged import bitwise_scatter

    rng = np.random.default_rng(1)
    pool = jnp.asarray(rng.normal(size=(2, KH, POOL, PS, E)), jnp.bfloat16)
    table = jnp.asarray([[3, 7, 0, 0], [5, 0, 0, 0], [9, 0, 0, 0]], jnp.int32)
    args = dict(pool=pool, layer=jnp.int32(1), new=jnp.asarray(rng.normal(size=(B, KH, E)), jnp.float32),
                page_table=table, lengths=jnp.asarray([5, 2, 0], jnp.int32), live=jnp.asarray([True, True, False]))
    plain, bits = write_token(**args), write_token(**args, bits=True)
    assert bits.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bits).view(np.uint16), np.asarray(plain).view(np.uint16))
    assert bitwise_scatter("cpu") and not bitwise_scatter("tpu") and not bitwise_scatter("gpu")


def test_bf16_decode_step_on_cpu_never_widens_the_pool():
    """Issue 49 item 7: XLA:CPU has no bf16 scatter, so a decode step's token write
    converted the whole pool to f32 and back (three passes over every page, per layer and
    step: a 16-step chunk of 2 slots cost as much as one of 32). The compiled step holds no
    f32 buffer of the pool's shape outside the attention's fused read."""
    from grpo.models.layers.paged import PagedSpec, paged_decode

    pool_shape = (2, KH, 64, PS, E)
    pool = jax.ShapeDtypeStruct(pool_shape, jnp.bfloat16)
    act = jax.ShapeDtypeStruct((B, KH, E), jnp.bfloat16)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731

    def step(q, k, v, pk, pv, table, lengths):
        return paged_decode(q=q, k_new=k, v_new=v, pool_k=pk, pool_v=pv, layer=jnp.int32(1), page_table=table,
                            lengths=lengths, live=lengths >= 0, scale=0.25, spec=PagedSpec(), mesh=None)

    hlo = jax.jit(step, donate_argnums=(3, 4)).lower(
        jax.ShapeDtypeStruct((B, H, E), jnp.bfloat16), act, act, pool, pool, i32(B, MAXP), i32(B)).compile().as_text()
    f32_pool = "f32[" + ",".join(map(str, pool_shape)) + "]"
    # The attention's read is one fusion (convert + gather of the live pages); anything
    # else producing an f32 pool is a whole-pool pass.
    widened = [ln for ln in hlo.splitlines() if f"= {f32_pool}" in ln and " fusion(" in ln
               and not ln.lstrip().startswith("ROOT")]
    assert not [ln for ln in widened if "scatter" in ln or "convert" in ln.split("calls=")[-1]], widened


@pytest.mark.slow
def test_tpu_kernel_compiles_for_tpu():
    """The Pallas TPU kernel as the decoder calls it, lowered and compiled for a v6e
    topology through libtpu (no TPU needed)."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x4")
    except Exception as e:  # no libtpu in this environment
        pytest.skip(f"no TPU compiler: {e}")
    dev = topo.devices[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    Bt, Ht, KHt, Et, pages, ps, maxp = 8, 16, 2, 128, 64, 16, 8
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    fn = jax.jit(lambda q, k, v, n, t: paged_attention_tpu(q=q, k_pages=k, v_pages=v, lengths=n, page_table=t,
                                                           scale=0.1))
    lowered = fn.lower(sds((Bt, Ht, Et), jnp.bfloat16), sds((KHt, pages, ps, Et), jnp.bfloat16),
                       sds((KHt, pages, ps, Et), jnp.bfloat16), sds((Bt,), jnp.int32), sds((Bt, maxp), jnp.int32))
    assert lowered.compile() is not None


@pytest.mark.slow
def test_tpu_kernel_interpreted_matches_dense(case):
    """The Pallas TPU kernel run by Pallas' TPU interpreter on CPU. The kernel reads
    keys and values as bfloat16 (whatever the pool's dtype), so the dense reference gets
    them rounded the same way."""
    from jax.experimental.pallas import tpu as pltpu

    q, kp, vp, lengths, table, dk, dv = case
    scale = 1 / math.sqrt(E)
    with pltpu.force_tpu_interpret_mode():
        got = paged_attention_tpu(q=q, k_pages=kp, v_pages=vp, lengths=lengths, page_table=table, scale=scale,
                                  pages_per_compute_block=2)
    bf16 = lambda xs: [np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)) for x in xs]  # noqa: E731
    np.testing.assert_allclose(np.asarray(got), _dense(q, bf16(dk), bf16(dv), scale), rtol=1e-4, atol=1e-4)
