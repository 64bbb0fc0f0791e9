"""``LossCall`` with packed batches (``segment_ids``): the per-shard (``shard_map``) path
splits the segment ids with the other per-token arrays and equals the global loss on the
padded rows; a loss written before packing never sees the new argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _packed import build, off_sequence, unpack

from grpo.core.contracts import LossPlugin, LossSettings, MeshLayout, MismatchCorrection
from grpo.core.plugins import load_plugins
from grpo.engine.parallel.mesh import build_mesh
from grpo.engine.training.update import LossCall

SETTINGS = LossSettings(epsilon_low=0.03, epsilon_high=0.04, beta=0.05, temperature=0.7, aggregation="sequence_mean",
                        max_completion_length=8, objective="gspo",
                        mismatch=MismatchCorrection(level="sequence", mode="truncate", cap=1.3))


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(MeshLayout(dp=2, fsdp=4, tp=1))


def _grad(call: LossCall, args: dict, normalizer):
    def loss(hidden, head):
        return call(dict(args, hidden=hidden, head_weight=head), normalizer)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(args["hidden"], args["head_weight"])


def test_per_shard_packed_equals_global_padded(mesh):
    """Pallas per device under shard_map over dp x fsdp, 8 bins (one per device, some
    empty), against the jax loss on the padded rows in one global call."""
    case = build(bin_length=16, bins=8)
    plugins = load_plugins(entry_points=False)
    pallas, jax_loss = plugins.get("loss", "pallas"), plugins.get("loss", "jax")
    fused = LossCall(pallas, pallas.parse_options({"interpret": True}), SETTINGS, mesh)
    assert fused._per_shard(8)
    reference = LossCall(jax_loss, jax_loss.parse_options({}), SETTINGS)
    padded = {k: jnp.asarray(v) for k, v in case.padded.items()}
    packed = {k: jnp.asarray(v) for k, v in case.packed.items()}
    normalizer = SETTINGS.normalizer(padded["mask"])

    (loss, metrics), (dh, dw) = _grad(reference, padded, normalizer)
    (p_loss, p_metrics), (p_dh, p_dw) = _grad(fused, packed, normalizer)
    tol = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(p_loss), float(loss), **tol)
    np.testing.assert_allclose(np.asarray(p_dw), np.asarray(dw), **tol)
    np.testing.assert_allclose(unpack(case, p_dh), np.asarray(dh), **tol)
    assert not np.any(off_sequence(case, p_dh))
    for k in ("num_tokens", "gspo/clip_frac", "gspo/seq_ratio/min", "gspo/seq_ratio/max", "mismatch/weight_mean",
              "kl", "ratio/mean"):
        np.testing.assert_allclose(float(p_metrics[k]), float(metrics[k]), **tol, err_msg=k)
    trained = case.padded["mask"] > 0
    np.testing.assert_allclose(unpack(case, p_metrics["logprobs"])[trained], np.asarray(metrics["logprobs"])[trained],
                               **tol)

    logp = jax.jit(fused.token_logprobs)({k: packed[k] for k in ("hidden", "head_weight", "targets", "segment_ids")})
    np.testing.assert_allclose(unpack(case, logp)[trained], np.asarray(metrics["logprobs"])[trained], **tol)


class _PrePacking(LossPlugin):
    """A third-party loss written before packing: no ``segment_ids`` parameter."""

    name = "pre_packing"
    per_shard = True

    def compute(self, *, hidden, head_weight, targets, mask, advantages, old_logprobs, ref_logprobs,  # noqa: ARG002
                settings, options, normalizer=None):
        logp = jnp.einsum("btd,dv->btv", hidden, head_weight)[..., 0]
        return jnp.sum(logp * mask), {"num_tokens": jnp.sum(mask), "logprobs": logp}


def test_loss_without_packing_support_never_sees_segment_ids(mesh):
    plugin = _PrePacking()
    assert not plugin.supports_packing
    rng = np.random.default_rng(0)
    args = dict(hidden=jnp.asarray(rng.normal(size=(8, 4, 3)), jnp.float32), head_weight=jnp.ones((3, 5)),
                targets=jnp.zeros((8, 4), jnp.int32), mask=jnp.ones((8, 4)), advantages=jnp.zeros((8,)),
                old_logprobs=None, ref_logprobs=None, segment_ids=None)
    want = float(jnp.sum(args["hidden"]))
    for m in (None, mesh):  # the global call and the per-shard one
        loss, _ = LossCall(plugin, plugin.parse_options({}), LossSettings(), m)(args)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    with pytest.raises(ValueError, match="pre_packing.*does not support packed"):
        LossCall(plugin, plugin.parse_options({}), LossSettings())(dict(args, segment_ids=jnp.ones((8, 4), jnp.int32)))
