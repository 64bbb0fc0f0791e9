"""The shared decoder's numerics for every built-in family (Qwen2, Qwen3, Llama 3):
parity with transformers, KV-cache decoding, dtypes, remat, configs and refusals.

Qwen2 checkpoints are written by grpo's own NumPy writer; Qwen3 and Llama ones by
transformers itself (``_model_fixtures.FAMILY_CHECKPOINTS``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _model_fixtures import FAMILY_CHECKPOINTS, checkpoint, hf_logits, logits_of, packed_vs_alone, padded_batch
from grpo.core.errors import UserError
from grpo.models.loading import load_hf
from grpo.models.decoder import KVCache, positions_from_mask, repeat_batch
from grpo.models.qwen2 import Qwen2Config


@functools.cache
def _model(name: str, **kwargs):
    return load_hf(checkpoint(name), **kwargs)


# --------------------------------------------------------------------------- parity


FAMILIES = list(FAMILY_CHECKPOINTS)  # qwen3 tied/untied, llama untied, llama tied with llama3 rope


@pytest.mark.parametrize("name", ["tied", "untied", "mqa", *FAMILIES])
def test_logits_match_transformers_on_padded_batch(name):
    tokens, mask = padded_batch()
    model = _model(name)
    assert model.config.family == (name.split("_")[0] if name in FAMILIES else "qwen2")
    ours = logits_of(model, tokens, mask)
    ref = hf_logits(checkpoint(name), tokens, mask)
    assert ours.shape == ref.shape == (4, 9, model.config.vocab_size)
    # Padding positions' outputs are never used (and differ by convention); real ones must match.
    diff = np.abs(ours - ref)[mask].max()
    assert diff <= 1e-4, diff
    assert np.abs(ref[mask]).max() > 1.0  # the comparison is not between near-zero logits


def test_packed_sequences_equal_each_sequence_alone(name="llama_tied_rope3"):
    # Segment ids keep attention inside a sequence; positions restart per sequence (RoPE).
    assert packed_vs_alone(_model(name)) <= 1e-5


def test_head_weight_is_transposed_embedding_when_tied():
    tied, untied = _model("tied"), _model("untied")
    D, V = 64, 320
    assert tied.head_weight().shape == (D, V)
    np.testing.assert_array_equal(np.asarray(tied.head_weight()), np.asarray(tied.embed[...]).T)
    assert tied.lm_head is None
    assert untied.head_weight().shape == (D, V)
    assert not np.allclose(np.asarray(untied.head_weight()), np.asarray(untied.embed[...]).T)


def test_padding_does_not_leak_into_real_tokens():
    model = _model("tied")
    tokens, mask = padded_batch()
    other = tokens.copy()
    other[~mask] = 7  # different pad ids
    a, b = logits_of(model, tokens, mask), logits_of(model, other, mask)
    np.testing.assert_allclose(a[mask], b[mask], atol=1e-6)


# --------------------------------------------------------------------------- cache


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("cache",))
def _step(graphdef, state, tokens, positions, kv_mask, cache, write_index):
    model = nnx.merge(graphdef, state)
    hidden, cache = model(tokens, positions, kv_mask, cache=cache, write_index=write_index)
    return model.logits(hidden), cache


@pytest.mark.parametrize("name", ["untied", *FAMILIES])
def test_prefill_then_decode_equals_full_forward(name):
    model = _model(name)
    c = model.config
    tokens, mask = padded_batch(seed=3)
    # Left-pad every row (the sampler's layout): move real tokens to the right.
    B, T = tokens.shape
    left = np.full_like(tokens, 306)
    lmask = np.zeros_like(mask)
    for b in range(B):
        real = tokens[b][mask[b]]
        left[b, T - len(real):] = real
        lmask[b, T - len(real):] = True
    full = logits_of(model, left, lmask)

    P = 5  # prompt slots; the rest is decoded one token at a time
    S = T + 3  # a cache longer than needed: unwritten slots must stay invisible
    graphdef, state = nnx.split(model)
    positions = positions_from_mask(jnp.asarray(lmask))
    kv_mask = jnp.concatenate([jnp.asarray(lmask[:, :P]), jnp.ones((B, S - P), bool)], axis=1)
    cache = model.init_cache(B, S)
    # layers, batch, slots, kv heads (not repeated), head_dim
    assert cache.k.shape == (c.num_hidden_layers, B, S, c.num_key_value_heads, c.head_dim)
    out, cache = _step(graphdef, state, jnp.asarray(left[:, :P]), positions[:, :P], kv_mask, cache, 0)
    steps = [np.asarray(out)]
    for t in range(P, T):
        previous = cache
        out, cache = _step(graphdef, state, jnp.asarray(left[:, t:t + 1]), positions[:, t:t + 1], kv_mask, cache, jnp.int32(t))
        assert previous.k.is_deleted()  # donated: updated in place, not copied
        steps.append(np.asarray(out))
    decoded = np.concatenate(steps, axis=1)
    diff = np.abs(decoded - full)[lmask].max()
    assert diff <= 1e-5, diff


def test_repeated_cache_decodes_each_copy_like_a_full_forward():
    model = _model("tied")
    B, K, P = 2, 3, 4
    rng = np.random.default_rng(5)
    prompts = rng.integers(0, 300, (B, P)).astype(np.int32)
    pmask = np.ones((B, P), bool)
    pmask[1, 0] = False  # left padding
    graphdef, state = nnx.split(model)
    S = P + 2
    kv_mask = jnp.concatenate([jnp.asarray(pmask), jnp.ones((B, S - P), bool)], axis=1)
    positions = positions_from_mask(jnp.asarray(pmask))
    _, cache = _step(graphdef, state, jnp.asarray(prompts), positions, kv_mask, model.init_cache(B, S), 0)

    cache = cache.repeat(K)
    assert isinstance(cache, KVCache) and cache.batch_size == B * K
    kv_mask = repeat_batch(kv_mask, K)
    nxt = rng.integers(0, 300, (B * K, 1)).astype(np.int32)  # a different token per copy
    next_pos = repeat_batch(positions[:, -1:] + 1, K)
    out, _ = _step(graphdef, state, jnp.asarray(nxt), next_pos, kv_mask, cache, P)

    seqs = np.concatenate([np.repeat(prompts, K, axis=0), nxt], axis=1)
    smask = np.concatenate([np.repeat(pmask, K, axis=0), np.ones((B * K, 1), bool)], axis=1)
    full = logits_of(model, seqs, smask)
    np.testing.assert_allclose(np.asarray(out)[:, 0], full[:, -1], atol=1e-5)


# --------------------------------------------------------------------------- dtypes, remat


@pytest.mark.parametrize("name", ["tied", "qwen3_untied"])
def test_bfloat16_compute_is_close_and_keeps_softmax_and_logits_in_float32(name):
    tokens, mask = padded_batch()
    ref = logits_of(_model(name), tokens, mask)
    for kwargs in ({"compute_dtype": "bfloat16"}, {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"}):
        model = _model(name, **kwargs)
        assert model.embed[...].dtype == jnp.dtype(kwargs["param_dtype"] if "param_dtype" in kwargs else "float32")
        hidden = nnx.eval_shape(
            lambda m: m(jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask))[0], model
        )
        assert hidden.dtype == jnp.bfloat16
        out = logits_of(model, tokens, mask)
        assert out.dtype == np.float32
        err = np.abs(out - ref)[mask].max() / np.abs(ref[mask]).max()
        assert err < 0.05, (kwargs, err)


def test_remat_policies_give_the_same_loss_and_gradients():
    tokens, mask = padded_batch()
    positions = positions_from_mask(jnp.asarray(mask))
    results = {}
    for remat in ("none", "full", "dots"):
        model = load_hf(checkpoint("tied"), remat=remat)

        def loss_fn(m):
            hidden, _ = m(jnp.asarray(tokens), positions, jnp.asarray(mask))
            logp = jax.nn.log_softmax(m.logits(hidden), axis=-1)
            return -(logp[..., 0] * mask).sum()

        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
        results[remat] = (float(loss), np.asarray(grads.layers.gate_proj[...]), np.asarray(grads.embed[...]))
    base = results["none"]
    assert np.abs(base[1]).max() > 0
    for remat in ("full", "dots"):
        assert results[remat][0] == pytest.approx(base[0], rel=1e-6)
        np.testing.assert_allclose(results[remat][1], base[1], atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(results[remat][2], base[2], atol=1e-5, rtol=1e-4)


def test_unknown_remat_policy_is_refused():
    with pytest.raises(UserError, match="remat"):
        load_hf(checkpoint("tied"), remat="sometimes")


# --------------------------------------------------------------------------- config


def test_config_round_trips_through_transformers():
    from transformers import Qwen2Config as HF

    cfg = Qwen2Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, rope_theta=5e5, rms_norm_eps=1e-5, tie_word_embeddings=True,
        eos_token_id=(3, 4),
    )
    hf = cfg.to_hf()
    assert isinstance(hf, HF)
    assert Qwen2Config.from_hf(hf) == cfg
    assert Qwen2Config.from_hf(hf.to_dict()) == cfg


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 0}, "sliding-window"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, "yarn"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"model_type": "llama"}, "Unexpected architecture"),
        ({"num_key_value_heads": 3}, "multiple of"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    from transformers import Qwen2Config as HF

    from grpo.models.presets import preset_hf_dict

    base = preset_hf_dict("tiny")
    if change.get("model_type"):
        with pytest.raises(UserError, match=message):
            Qwen2Config.from_hf({**base, **change})
        return
    # through transformers' own config class, as a checkpoint's config.json would come
    hf = HF(**{k: v for k, v in {**base, **change}.items() if k != "model_type"})
    with pytest.raises(UserError, match=message):
        Qwen2Config.from_hf(hf)


def test_positions_from_mask():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(
        np.asarray(positions_from_mask(mask)), [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 1, 2, 3, 4]]
    )
