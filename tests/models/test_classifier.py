"""Reward models: a ``*ForSequenceClassification`` checkpoint in grpo's own decoder (issue 55,
reward model: parity with transformers)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from grpo.core.errors import UserError
from grpo.models.classifier import classifier_scores, load_classifier, pool_index
from tests._reward_models import PAD, classifier_checkpoint


def _batch():
    """[4, 11] right-padded rows: full, short, one ending in the pad token's id (scored
    before it, as transformers does), one of a single token."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 300, (4, 11)).astype(np.int32)
    mask = np.ones((4, 11), np.int32)
    mask[1, 6:] = 0
    mask[2, 8:] = 0
    tokens[2, 7] = PAD
    mask[3, 1:] = 0
    tokens[mask == 0] = PAD
    return tokens, mask


def _torch_scores(model, tokens, mask):
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long))
    return out.logits.float().numpy()


@pytest.mark.parametrize("family,labels", [("Qwen2", 1), ("Llama", 2)])
def test_scores_match_transformers(family, labels):
    """Issue 55's goal: a tiny sequence classifier scores within 1e-5 (f32) of transformers."""
    path, hf = classifier_checkpoint(family, labels)
    clf = load_classifier(path, dtype="float32")
    assert clf.num_labels == labels and clf.pad_token_id == PAD and clf.config.tie_word_embeddings
    tokens, mask = _batch()
    ours = np.asarray(jax.jit(classifier_scores, static_argnums=0, static_argnames="pad_token_id")(
        clf.graphdef, clf.state, clf.score, tokens, mask, pad_token_id=clf.pad_token_id))
    want = _torch_scores(hf, tokens, mask)
    assert ours.shape == (4, labels)
    np.testing.assert_allclose(ours, want, atol=1e-5, rtol=1e-5)


def test_pool_index_is_transformers_rule():
    tokens, mask = _batch()
    np.testing.assert_array_equal(np.asarray(pool_index(tokens, mask, PAD)), [10, 5, 6, 0])
    np.testing.assert_array_equal(np.asarray(pool_index(tokens, mask, None)), [10, 5, 7, 0])


def test_a_causal_lm_is_refused(tmp_path):
    from tests._model_fixtures import checkpoint

    with pytest.raises(UserError, match=r"model_rewards\[0\].*sequence-classification"):
        load_classifier(checkpoint("tied"), where="task.model_rewards[0].checkpoint")


def test_a_wrong_score_head_is_named(tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    path, _ = classifier_checkpoint("Qwen2", 1)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["score.weight"] = np.zeros((1, 40), np.float32)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(UserError, match=r"score.weight has shape \[1, 40\]"):
        load_classifier(bad)
    assert json.loads((bad / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
