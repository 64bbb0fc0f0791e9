"""Sequence classifiers (reward models): a built-in family's decoder with a score head.

A Hugging Face ``*ForSequenceClassification`` checkpoint (``Qwen2ForSequenceClassification``,
``LlamaForSequenceClassification``, ``Qwen3ForSequenceClassification``) is the family's
decoder (``model.*`` tensors, exactly the causal LM's) and one linear head ``score.weight``
[num_labels, hidden] without a bias. It loads into grpo's own
:class:`~grpo.models.decoder.Decoder` (no output head: the config is read as tied, so
no vocabulary-sized matrix is allocated) plus the score matrix, and scores a batch the way
transformers does:

- the head is applied to the final-normed hidden state of one token per row, the
  **last non-pad token**: the rightmost position whose token is not the config's
  ``pad_token_id`` (transformers' ``(arange(T) * (ids != pad)).argmax(-1)``; without a
  ``pad_token_id``, the row's last real token);
- the matmul runs in the compute dtype with float32 accumulation, and the scores come
  back float32 [B, num_labels].

Rows are right-padded (``mask`` marks the real tokens; positions count from 0), which is
what transformers sees for a batch padded on the right.

``classifier = load_classifier(path, mesh, dtype="float32")``;
``scores = classifier_scores(classifier.graphdef, classifier.state, classifier.score,
tokens, mask, pad_token_id=classifier.pad_token_id)`` (pure: jit it with the graphdef
static).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from grpo.models.decoder import DTYPES, _dtype_name
from grpo.models.families import AUTO, resolve_family
from grpo.models.hf import check_tensors
from grpo.models.loading import (
    CheckpointError,
    SafetensorsCheckpoint,
    _abstract,
    _dotted,
    _load_param,
    _model_kwargs,
    default_mesh,
    resolve_checkpoint,
)
from grpo.sharding import PARAM_RULES, fit_sharding

SCORE = "score.weight"
"""The score head's tensor in a ``*ForSequenceClassification`` checkpoint."""

SUFFIX = "ForSequenceClassification"


@dataclasses.dataclass
class Classifier:
    """A loaded sequence classifier: the decoder (``graphdef``/``state``, split from the
    NNX module), the score head ``score`` [D, num_labels] (replicated), and what pooling
    needs."""

    config: Any  # the family's DecoderConfig (tied: the decoder has no output head)
    graphdef: Any
    state: Any
    score: jax.Array
    pad_token_id: int | None
    num_labels: int
    directory: Path

    @property
    def num_params(self) -> int:
        """Parameters of the decoder without its (unused) output head, and of the score head."""
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state)) + int(np.prod(self.score.shape))


def read_classifier_config(directory: str | os.PathLike, *, where: str = "the checkpoint") -> tuple[Any, Any, dict]:
    """``(model plugin, family config read as tied, raw config.json)`` of a sequence-
    classification directory. :class:`CheckpointError` (naming ``where``) for a directory
    without ``config.json``, a head other than ``*ForSequenceClassification``, or a family
    no model plugin handles."""
    d = Path(directory)
    path = d / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{where}: {str(d)!r} has no config.json; is it a Hugging Face model directory?")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{where}: {str(path)!r} could not be read as JSON: {err}") from None
    archs = [str(a) for a in (raw.get("architectures") or [])]
    if not archs or not all(a.endswith(SUFFIX) for a in archs):
        raise CheckpointError(
            f"{where}: {str(path)!r} has architectures={archs}; a reward model is a sequence-classification "
            f"checkpoint (e.g. Qwen2{SUFFIX}: the decoder and a score head)."
        )
    causal = [a[: -len(SUFFIX)] + "ForCausalLM" for a in archs]
    try:
        plugin = resolve_family({**raw, "architectures": causal}, architecture=AUTO, where=repr(str(path)))
        from transformers import CONFIG_MAPPING, AutoConfig

        hf: Any = AutoConfig.from_pretrained(str(d)) if raw.get("model_type") in CONFIG_MAPPING else dict(raw)
        if isinstance(hf, dict):
            hf["architectures"] = causal
        else:
            hf.architectures = causal
        config = plugin.config_from_hf(hf)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - the plugin's refusal, or transformers': the user's file
        raise CheckpointError(f"{where}: {err}") from None
    # No output head: the decoder's hidden states go to the score head only.
    return plugin, dataclasses.replace(config, tie_word_embeddings=True), raw


def load_classifier(
    path_or_id: str | os.PathLike,
    mesh: Mesh | None = None,
    *,
    dtype: Any = "float32",
    where: str = "the reward model",
) -> Classifier:
    """Load a ``*ForSequenceClassification`` checkpoint (a directory or hub id) into
    ``mesh``'s parameter shardings (the decoder's rules; the score head replicated), in
    ``dtype`` (parameters and compute alike). Every tensor is checked before any is read."""
    mesh = mesh if mesh is not None else default_mesh()
    directory = resolve_checkpoint(path_or_id)
    plugin, config, raw = read_classifier_config(directory, where=where)
    np_dtype = np.dtype(DTYPES[_dtype_name(dtype)])
    with SafetensorsCheckpoint(directory) as ckpt:
        if SCORE not in ckpt.tensors:
            raise CheckpointError(f"{where}: {str(directory)!r} has no {SCORE} (the score head).")
        labels, hidden = ckpt.tensors[SCORE][0]
        problems = [] if hidden == config.hidden_size else [
            f"tensor {SCORE} has shape {[labels, hidden]}, expected [num_labels, {config.hidden_size}]"]
        tmaps = plugin.tensor_maps(config)
        body = {k: v for k, v in ckpt.tensors.items() if k != SCORE}
        problems += check_tensors(config, body, tmaps)
        if problems:
            raise CheckpointError(f"{where}: checkpoint {str(directory)!r} does not match its config.json:",
                                  problems=problems)
        maps = {tm.param: tm for tm in tmaps}
        specs = plugin.param_specs(config)
        graphdef, flat = _abstract(config, **_model_kwargs(mesh, dtype, dtype, "none", "xla", None))
        loaded = []
        for p, var in flat:
            key = _dotted(p)
            shape, names = specs[key]
            array = _load_param(ckpt, maps[key], shape, fit_sharding(shape, names, mesh, PARAM_RULES), np_dtype)
            loaded.append((p, var.replace(array)))
        head = np.ascontiguousarray(ckpt.get(SCORE).astype(np_dtype).T)  # D L
    model = nnx.merge(graphdef, nnx.from_flat_state(loaded))
    graphdef, state = nnx.split(model)
    score = jax.device_put(head, NamedSharding(mesh, P()))
    pad = raw.get("pad_token_id")
    return Classifier(config=config, graphdef=graphdef, state=state, score=score,
                      pad_token_id=None if pad is None else int(pad), num_labels=int(labels), directory=directory)


def pool_index(tokens: jax.Array, mask: jax.Array, pad_token_id: int | None) -> jax.Array:
    """The token each row is scored at [B] int32 (transformers' rule, see the module
    docstring): the rightmost real token that is not ``pad_token_id``; 0 when none is."""
    keep = mask.astype(bool)
    if pad_token_id is not None:
        keep = keep & (tokens != pad_token_id)
    index = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]  # 1 T
    return jnp.argmax(index * keep.astype(jnp.int32), axis=1).astype(jnp.int32)


def classifier_scores(graphdef: Any, state: Any, score: jax.Array, tokens: jax.Array, mask: jax.Array, *,
                      pad_token_id: int | None) -> jax.Array:
    """Scores [B, num_labels] float32 of right-padded rows ``tokens``/``mask`` [B, T]."""
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden, _ = model(tokens, positions, mask.astype(bool))  # B T D
    at = pool_index(tokens, mask, pad_token_id)
    pooled = jnp.take_along_axis(hidden, at[:, None, None], axis=1)[:, 0]  # B D
    dt = model.dtype
    return jnp.einsum("bd,dl->bl", pooled.astype(dt), score.astype(dt), preferred_element_type=jnp.float32)


__all__ = ["Classifier", "SCORE", "classifier_scores", "load_classifier", "pool_index", "read_classifier_config"]
