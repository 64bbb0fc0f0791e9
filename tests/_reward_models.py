"""Tiny sequence-classification checkpoints for the reward-model tests (issue 55), written
by transformers itself with the tiny tokenizer beside them."""

from __future__ import annotations

import functools
from pathlib import Path

PAD = 306


@functools.cache
def classifier_checkpoint(family: str = "Qwen2", labels: int = 1) -> tuple[Path, object]:
    """A random tiny ``<family>ForSequenceClassification`` (odd sizes, GQA) and the
    transformers model it was saved from."""
    import torch
    import transformers

    from grpo.models.tiny import write_tiny_tokenizer
    from tests._model_fixtures import scratch_dir

    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=320, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=PAD, eos_token_id=308, pad_token_id=PAD, tie_word_embeddings=False,
        num_labels=labels, max_position_embeddings=512, rms_norm_eps=1e-5,
    )
    torch.manual_seed(7 + labels)
    model = getattr(transformers, f"{family}ForSequenceClassification")(cfg).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    out = scratch_dir(f"classifier-{family}-{labels}")
    model.save_pretrained(out)
    write_tiny_tokenizer(out)
    return out, model.eval()


@functools.cache
def preferring_checkpoint(text: str = "7") -> Path:
    """A reward model that prefers rows whose last token is ``text``'s (one token of the
    tiny tokenizer): its layers add nothing (output projections zero), so the last
    position's hidden state is its token's normed embedding, and the score head is the
    preferred token's: the score is the cosine-like match of the last token with it,
    highest (~sqrt(hidden)) for the preferred token, near 0 for the others."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from grpo.models.tiny import write_tiny_tokenizer
    from tests._model_fixtures import scratch_dir

    out = scratch_dir(f"preferring-{ord(text)}")
    write_tiny_tokenizer(out)
    ids = AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, ids
    cfg = transformers.Qwen2Config(
        vocab_size=320, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, bos_token_id=PAD, eos_token_id=308, pad_token_id=PAD, num_labels=1,
        max_position_embeddings=128, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForSequenceClassification(cfg).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn_like(param))
        emb = model.model.embed_tokens.weight[ids[0]]
        model.score.weight.copy_((emb / emb.norm())[None, :])
    model.save_pretrained(out)
    return out
