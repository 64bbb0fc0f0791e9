"""The policy: model, tokenizer, stop tokens and decoding, from a run config's ``model``."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from grpo.core.config import ModelConfig
from grpo.core.errors import UserError


@dataclasses.dataclass
class Policy:
    model: Any
    tokenizer: Any
    tokenizer_dir: str | None
    eos_ids: tuple[int, ...]
    pad_id: int

    def decode(self, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
        """Completion texts: the masked-in tokens of each row, stop/special tokens dropped."""
        out = []
        for row, m in zip(np.asarray(tokens), np.asarray(mask)):
            ids = [int(t) for t, keep in zip(row, m) if keep and int(t) not in self.eos_ids]
            out.append(self.tokenizer.decode(ids, skip_special_tokens=True))
        return out


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def stop_token_ids(tokenizer: Any, model_dir: str | None, config_eos: Any) -> tuple[int, ...]:
    """Every id that ends a completion: the tokenizer's EOS, the model config's and the
    generation config's (Qwen2.5-Instruct stops on both <|im_end|> and <|endoftext|>)."""
    ids: list[int] = _as_list(tokenizer.eos_token_id) + _as_list(config_eos)
    if model_dir is not None:
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():
            ids += _as_list(json.loads(gen.read_text()).get("eos_token_id"))
    seen = tuple(dict.fromkeys(ids))  # unique, in order
    if not seen:
        raise UserError("The tokenizer and model define no EOS token; completions could never stop.")
    return seen


def load_tokenizer(cfg: ModelConfig) -> tuple[Any, str]:
    from transformers import AutoTokenizer

    if cfg.tokenizer or cfg.source == "hf":
        source = cfg.tokenizer or cfg.path
        from grpo.models.loading import resolve_checkpoint

        directory = str(resolve_checkpoint(source))
    else:
        from grpo.models.tiny import write_tiny_tokenizer

        # Per-process temp dir: several processes on one host must not race on one file.
        directory = str(write_tiny_tokenizer(tempfile.mkdtemp(prefix="grpo-tokenizer-"),
                                             tool_tokens=cfg.random.tool_tokens))
    try:
        tok = AutoTokenizer.from_pretrained(directory)
    except Exception as err:  # noqa: BLE001
        raise UserError(f"Could not load a tokenizer from {directory!r}: {err}") from None
    return tok, directory


def load_policy(cfg: ModelConfig, mesh: Any, *, seed: int) -> Policy:
    """The policy of ``cfg``: its tokenizer loaded on a second thread while the model is
    built (independent work: importing ``transformers`` and ``torch`` for the tokenizer is
    Python, holding the GIL, while XLA compiles the model's initialisation without it;
    measured on a 2-core CPU host, the tiny model: 2.1 s of CPU for the tokenizer, most of
    it overlapped). A failure of either is raised here, the tokenizer's first."""
    import concurrent.futures

    from grpo.models.loading import build_model

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpo-tokenizer") as pool:
        loading = pool.submit(load_tokenizer, cfg)
        try:
            model = build_model(cfg, mesh, seed=seed)
        except BaseException:
            loading.result()  # the tokenizer's error first, as when it loaded first
            raise
        tokenizer, tok_dir = loading.result()
    vocab = model.config.vocab_size
    if len(tokenizer) > vocab:
        raise UserError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab}: "
            "model.tokenizer does not belong to this model."
        )
    model_dir = cfg.path if cfg.source == "hf" else None
    if model_dir is not None:
        from grpo.models.loading import resolve_checkpoint

        model_dir = str(resolve_checkpoint(model_dir))
    eos = stop_token_ids(tokenizer, model_dir, model.config.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return Policy(model=model, tokenizer=tokenizer, tokenizer_dir=tok_dir, eos_ids=eos, pad_id=int(pad))
