"""Random loss inputs and a jitted value-and-grad of a loss plugin, shared by the loss and
objective tests (tests/plugins/losses/, tests/plugins/objectives/)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit(static_argnames=("shape", "dtype"))
def _random_inputs(key, lengths, temperature, *, shape, dtype):
    b, t, d, v = shape
    k = jax.random.split(key, 7)
    hidden = jax.random.normal(k[0], (b, t, d), jnp.float32)
    head = jax.random.normal(k[1], (d, v), jnp.float32) * (2.0 / math.sqrt(d))
    targets = jax.random.randint(k[2], (b, t), 0, v)
    mask = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)
    adv = jax.random.normal(k[4], (b,), jnp.float32)
    logits = jnp.einsum("btd,dv->btv", hidden, head) / temperature
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    # Old and reference log-probs near the current ones, far enough that clipping happens.
    old = logp + 0.4 * jax.random.normal(k[5], (b, t))
    ref = logp + 0.4 * jax.random.normal(k[6], (b, t))
    return dict(hidden=hidden.astype(dtype), head_weight=head.astype(dtype), targets=targets, mask=mask,
                advantages=adv, old_logprobs=old, ref_logprobs=ref)


def _inputs(b, t, d, v, *, seed, dtype=jnp.float32, lengths=None, temperature=1.0):
    """Random loss inputs; ``lengths`` [B] valid tokens per row (default: random in 1..T);
    old/ref log-probs are near the current ones at ``temperature``."""
    if lengths is None:
        lengths = np.random.default_rng(seed).integers(1, t + 1, size=b)
    return _random_inputs(jax.random.PRNGKey(seed), jnp.asarray(lengths, jnp.int32), jnp.float32(temperature),
                          shape=(b, t, d, v),
                          dtype=jnp.dtype(dtype))


_STEPS: dict = {}


def _step(plugin, settings, opts, off_policy, ref):
    """A jitted value-and-grad of ``plugin.compute``, compiled once per configuration."""
    key = (plugin.name, settings, opts, off_policy, ref)
    if key not in _STEPS:
        def f(h, w, targets, mask, adv, old, ref_lp, normalizer):
            return plugin.compute(hidden=h, head_weight=w, targets=targets, mask=mask, advantages=adv,
                                  old_logprobs=old if off_policy else None, ref_logprobs=ref_lp if ref else None,
                                  settings=settings, options=opts, normalizer=normalizer)

        _STEPS[key] = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    return _STEPS[key]


def _run_plugin(plugin, inputs, settings, *, options=None, off_policy=True, ref=True, normalizer=None, rows=None):
    opts = plugin.parse_options(options or {})
    x = dict(inputs)
    if rows is not None:
        x = {k: val[rows] if k != "head_weight" else val for k, val in x.items()}
    step = _step(plugin, settings, opts, off_policy, ref)
    (loss, metrics), grads = step(x["hidden"], x["head_weight"], x["targets"], x["mask"], x["advantages"],
                                  x["old_logprobs"], x["ref_logprobs"], normalizer)
    return loss, metrics, grads
