"""Hugging Face checkpoints in and out, and random initialisation, straight into shardings.

- :func:`load_hf` — a local HF directory (``config.json`` + ``model.safetensors`` or a
  sharded ``model.safetensors.index.json``) or a hub id into a ``jax.sharding.Mesh``.
  Every parameter is built with ``jax.make_array_from_callback``: each device's shard
  is read from the safetensors file(s) as a slice (safetensors ``get_slice``), converted
  to ``param_dtype`` and placed, so no host or device ever holds the whole model, and a
  host holds at most one parameter's distinct shards at a time.
- :func:`random_init` — a preset or a family config (:class:`~grpo.models.decoder.DecoderConfig`) initialised
  under ``jax.jit`` with ``out_shardings``, so parameters are born sharded.
- :func:`save_hf` — back to an HF directory (safetensors shards + index, ``config.json``,
  tokenizer files) that ``transformers`` loads; gathers one layer of one parameter at a
  time.
- :func:`build_model` — the above from a run config's ``model`` section.

Every function works through the checkpoint's model plugin (:class:`grpo.ModelPlugin`,
chosen by :func:`grpo.models.families.resolve_family` from ``config.json``'s
``model_type`` or by ``model.architecture``): the plugin reads the config, names the
parameters' logical axes, maps HF tensor names both ways and builds the module.

Sharding: parameters' logical axis names map to mesh axes through ``rules`` (default
:data:`grpo.sharding.PARAM_RULES`: FSDP over ``embed``, tp over heads, KV heads,
mlp and vocab). With tp > 1 every layout is numerically correct — the model runs under
XLA's SPMD partitioner — and a dimension that does not divide over its mesh axes (e.g.
2 KV heads on tp=4) is replicated rather than split (logged once).

Errors about the checkpoint raise :class:`CheckpointError` (a :class:`UserError`) that
names the tensor: missing tensors, shape mismatches, unexpected tensors, wrong
architecture or unsupported features.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from grpo.core.contracts import MESH_AXES
from grpo.core.errors import UserError
from grpo.models.hf import (
    TensorMap,
    check_tensors,
    read_hf_slice,
    to_hf,
    write_json,
)
from grpo.models._host import take_layer, to_host
from grpo.models.decoder import DTYPES, _dtype_name
from grpo.models.families import AUTO, family_of, resolve_family
from grpo.sharding import PARAM_RULES, fit_sharding

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"]


class CheckpointError(UserError):
    """A checkpoint cannot be used: missing or mismatched tensors, wrong architecture..."""


# --------------------------------------------------------------------------- locating


def resolve_checkpoint(path_or_id: str | os.PathLike, *, revision: str | None = None) -> Path:
    """A local directory for ``path_or_id``: the directory itself, or a hub id
    (``Qwen/Qwen2.5-3B-Instruct``) fetched with ``huggingface_hub`` (or found in its
    cache when offline). Raises :class:`CheckpointError` with what to do otherwise."""
    text = os.fspath(path_or_id)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{text!r} is a file; expected a Hugging Face model directory or hub id.")
    if not _HUB_ID.match(text):
        raise CheckpointError(f"No model directory {text!r} (and it does not look like a hub id such as Qwen/Qwen2.5-3B-Instruct).")
    try:
        import huggingface_hub
        from huggingface_hub import constants

        offline = bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover - a hard dependency
        raise CheckpointError(f"{text!r} is not a local directory and huggingface_hub is not installed.") from None
    try:
        local = huggingface_hub.snapshot_download(text, revision=revision, allow_patterns=_DOWNLOAD_PATTERNS)
    except Exception as err:  # network, auth, offline, missing repo: all the user's to fix
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")
        if offline:
            raise CheckpointError(
                f"{text!r} is not a local directory, and the Hugging Face hub is offline (HF_HUB_OFFLINE=1) "
                f"with no cached copy. Download it while online (`huggingface-cli download {text}`) or pass "
                f"a local directory. ({why})"
            ) from None
        raise CheckpointError(
            f"Could not fetch {text!r} from the Hugging Face hub ({why}). Check the id, your network and "
            f"token, or pass a local directory."
        ) from None
    return Path(local)


def read_config(directory: str | os.PathLike, *, architecture: str = AUTO) -> Any:
    """The family config of an HF directory, after the architecture checks."""
    return read_family(directory, architecture=architecture)[1]


def read_family(directory: str | os.PathLike, *, architecture: str = AUTO) -> tuple[Any, Any]:
    """``(model plugin, family config)`` of an HF directory.

    ``architecture``: ``auto`` (from ``config.json``'s ``model_type``) or a model plugin
    name. Raises :class:`CheckpointError` naming the file when no plugin handles the
    checkpoint, when the named plugin does not, or when the plugin refuses its config.
    """
    d = Path(directory)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{str(d)!r} has no config.json; is it a Hugging Face model directory?")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{str(cfg_path)!r} could not be read as JSON: {err}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{str(cfg_path)!r} holds a JSON {type(raw).__name__}, not an object of config fields.")
    try:
        plugin = resolve_family(raw, architecture=architecture, where=repr(str(cfg_path)))
    except UserError as err:
        raise CheckpointError(str(err)) from None
    try:
        from transformers import CONFIG_MAPPING, AutoConfig

        known = raw.get("model_type") in CONFIG_MAPPING
        # transformers fills defaults the file leaves out (Qwen3's head_dim=128, ...);
        # a family transformers does not know gets the plain mapping.
        hf: Any = AutoConfig.from_pretrained(str(d)) if known else raw
    except Exception as err:
        raise CheckpointError(f"transformers could not read {str(cfg_path)!r}: {type(err).__name__}: {err}") from None
    try:
        return plugin, plugin.config_from_hf(hf)
    except CheckpointError:
        raise
    except UserError as err:
        raise CheckpointError(f"{str(cfg_path)!r}: {err}") from None


class SafetensorsCheckpoint:
    """The tensors of an HF directory, read lazily by name and slice."""

    def __init__(self, directory: str | os.PathLike):
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(f"{str(index)!r} is not a valid safetensors index: {err!r}") from None
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            weight_map = None
            files = [SINGLE_FILE]
        else:
            found = sorted(p.name for p in self.directory.iterdir())[:20]
            raise CheckpointError(
                f"{str(self.directory)!r} has neither {SINGLE_FILE} nor {INDEX_FILE} (found: {', '.join(found) or 'nothing'}). "
                "Only safetensors checkpoints are supported; convert .bin weights with transformers' save_pretrained."
            )
        self._handles: dict[str, Any] = {}
        self.file_of: dict[str, str] = {}
        self.tensors: dict[str, tuple[tuple[int, ...], str]] = {}
        for fname in files:
            path = self.directory / fname
            if not path.is_file():
                raise CheckpointError(f"{str(index)!r} lists {fname}, which does not exist in {str(self.directory)!r}.")
            try:
                handle = safe_open(str(path), framework="numpy")
            except Exception as err:
                raise CheckpointError(f"{str(path)!r} is not a readable safetensors file: {err}") from None
            self._handles[fname] = handle
            for name in handle.keys():
                if weight_map is not None and weight_map.get(name) != fname:
                    continue
                sl = handle.get_slice(name)
                self.tensors[name] = (tuple(sl.get_shape()), sl.get_dtype())
                self.file_of[name] = fname
        if weight_map is not None:
            absent = sorted(n for n in weight_map if n not in self.file_of)
            if absent:
                raise CheckpointError(
                    f"{str(index)!r} maps tensors that are not in their files: "
                    + ", ".join(f"{n} (in {weight_map[n]})" for n in absent[:10])
                    + (" ..." if len(absent) > 10 else "")
                )

    def get(self, name: str, slices: tuple[slice, ...] | None = None) -> np.ndarray:
        sl = self._handles[self.file_of[name]].get_slice(name)
        return sl[slices] if slices is not None else sl[:]

    def nbytes_by_dtype(self) -> dict[str, int]:
        sizes = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
        out: dict[str, int] = {}
        for shape, dtype in self.tensors.values():
            out[dtype] = out.get(dtype, 0) + math.prod(shape) * sizes.get(dtype, 0)
        return out

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_checkpoint(directory: str | os.PathLike, *, architecture: str = AUTO) -> tuple[Any, list[str]]:
    """The config of an HF directory and every problem of its tensors (empty: loadable)."""
    plugin, cfg = read_family(directory, architecture=architecture)
    with SafetensorsCheckpoint(directory) as ckpt:
        return cfg, check_tensors(cfg, ckpt.tensors, plugin.tensor_maps(cfg))


# --------------------------------------------------------------------------- sharding


def default_mesh() -> Mesh:
    """A (1, 1, 1) mesh on the first device: the unsharded case."""
    return Mesh(np.array(jax.devices()[:1], dtype=object).reshape(1, 1, 1), MESH_AXES)


def param_shardings(
    config: Any, mesh: Mesh, rules: Mapping[str, Any] = PARAM_RULES
) -> dict[str, jax.sharding.NamedSharding]:
    """``path -> NamedSharding`` of every parameter of the model of ``config``."""
    specs = family_of(config).param_specs(config)
    return {path: fit_sharding(shape, names, mesh, rules) for path, (shape, names) in specs.items()}


def _abstract(config: Any, **model_kwargs: Any) -> tuple[Any, list[tuple[tuple, Any]]]:
    plugin = family_of(config)
    abstract = nnx.eval_shape(lambda: plugin.build(config, rngs=nnx.Rngs(0), **model_kwargs))
    graphdef, state = nnx.split(abstract)
    return graphdef, list(nnx.to_flat_state(state))


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _model_kwargs(
    mesh: Mesh, param_dtype: Any, compute_dtype: Any, remat: str, attention_impl: Any,
    activation_rules: Mapping[str, Any] | None,
) -> dict[str, Any]:
    return dict(
        param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat, attention_impl=attention_impl,
        mesh=mesh, activation_rules=activation_rules,
    )


# --------------------------------------------------------------------------- load


def load_hf(
    path_or_id: str | os.PathLike,
    mesh: Mesh | None = None,
    *,
    param_dtype: Any = "float32",
    compute_dtype: Any = "float32",
    remat: str = "none",
    attention_impl: Any = "xla",
    rules: Mapping[str, Any] = PARAM_RULES,
    activation_rules: Mapping[str, Any] | None = None,
    revision: str | None = None,
    architecture: str = AUTO,
) -> Any:
    """Load an HF checkpoint (local directory or hub id) into ``mesh``'s shardings.

    ``architecture``: ``auto`` (the model plugin for ``config.json``'s ``model_type``)
    or a model plugin name. Every tensor is checked (names, shapes, dtypes) before any
    is read; problems raise :class:`CheckpointError` listing each tensor.
    """
    mesh = mesh if mesh is not None else default_mesh()
    directory = resolve_checkpoint(path_or_id, revision=revision)
    plugin, config = read_family(directory, architecture=architecture)
    np_dtype = np.dtype(DTYPES[_dtype_name(param_dtype)])
    with SafetensorsCheckpoint(directory) as ckpt:
        tmaps = plugin.tensor_maps(config)
        problems = check_tensors(config, ckpt.tensors, tmaps)
        if problems:
            raise CheckpointError(
                f"Checkpoint {str(directory)!r} does not match its config.json "
                f"({config.num_hidden_layers} layers, hidden {config.hidden_size}):",
                problems=problems,
            )
        maps = {tm.param: tm for tm in tmaps}
        specs = plugin.param_specs(config)
        graphdef, flat = _abstract(
            config, **_model_kwargs(mesh, param_dtype, compute_dtype, remat, attention_impl, activation_rules)
        )
        loaded = []
        for path, var in flat:
            key = _dotted(path)
            shape, names = specs[key]
            sharding = fit_sharding(shape, names, mesh, rules)
            array = _load_param(ckpt, maps[key], shape, sharding, np_dtype)
            loaded.append((path, var.replace(array)))
    log.info("loaded %d parameters from %s", config.num_params(), directory)
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _load_param(
    ckpt: SafetensorsCheckpoint, tm: TensorMap, shape: tuple[int, ...], sharding: Any, np_dtype: np.dtype
) -> jax.Array:
    # Devices that hold the same shard (replicated dims, dp) share one read.
    memo: dict[tuple, np.ndarray] = {}

    def read(index: tuple[slice, ...] | None) -> np.ndarray:
        index = tuple(index) if index is not None else ()
        index = index + (slice(None),) * (len(shape) - len(index))
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if key in memo:
            return memo[key]
        if tm.experts:  # [layers, experts, ...]: one HF tensor per (layer, expert)
            (lo, hi), (elo, ehi) = key[0], key[1]
            rest = index[2:]
            part = np.stack([
                np.stack([read_hf_slice(tm, lambda sl, i=i, j=j: ckpt.get(tm.hf_name(i, j), sl), rest)
                          for j in range(elo, ehi)])
                for i in range(lo, hi)
            ])
        elif tm.layered:
            lo, hi = key[0]
            rest = index[1:]
            part = np.stack(
                [read_hf_slice(tm, lambda sl, i=i: ckpt.get(tm.hf_name(i), sl), rest) for i in range(lo, hi)]
            )
        else:
            part = read_hf_slice(tm, lambda sl: ckpt.get(tm.hf_name(), sl), index)
        part = np.ascontiguousarray(part.astype(np_dtype, copy=False))
        memo[key] = part
        return part

    return jax.make_array_from_callback(shape, sharding, read)


# --------------------------------------------------------------------------- random


def random_init(
    config: Any,
    mesh: Mesh | None = None,
    *,
    seed: int = 0,
    param_dtype: Any = "float32",
    compute_dtype: Any = "float32",
    remat: str = "none",
    attention_impl: Any = "xla",
    rules: Mapping[str, Any] = PARAM_RULES,
    activation_rules: Mapping[str, Any] | None = None,
) -> Any:
    """A randomly initialised model, each parameter created in its sharding.

    ``config``: a family config (e.g. :class:`~grpo.models.qwen3.Qwen3Config`), a preset
    name, or a :class:`grpo.core.config.RandomModelConfig` (preset + overrides).
    """
    from grpo.core.config import RandomModelConfig
    from grpo.models.presets import from_random_config, preset_config

    if isinstance(config, str):
        config = preset_config(config)
    elif isinstance(config, RandomModelConfig):
        config = from_random_config(config)
    mesh = mesh if mesh is not None else default_mesh()
    kwargs = _model_kwargs(mesh, param_dtype, compute_dtype, remat, attention_impl, activation_rules)
    frozen = tuple(sorted((k, _freeze(v)) for k, v in kwargs.items()))
    graphdef, init = _compiled_init(config, frozen, _freeze(rules))
    return nnx.merge(graphdef, init(jax.random.key(seed)))


def _freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(v)
    return v


@functools.lru_cache(maxsize=8)
def _compiled_init(config: Any, frozen_kwargs: tuple, frozen_rules: tuple) -> tuple[Any, Any]:
    # Cached per (config, options, mesh, rules) so another seed reuses the executable:
    # compiling the random-number generators is the slow part of random init on CPU.
    kwargs = dict(frozen_kwargs)
    if kwargs["activation_rules"] is not None:
        kwargs["activation_rules"] = dict(kwargs["activation_rules"])
    graphdef, flat = _abstract(config, **kwargs)
    shardings = param_shardings(config, kwargs["mesh"], dict(frozen_rules))
    out_shardings = nnx.from_flat_state([(path, var.replace(shardings[_dotted(path)])) for path, var in flat])

    plugin = family_of(config)

    def init(key: jax.Array) -> Any:
        return nnx.state(plugin.build(config, rngs=nnx.Rngs(params=key), **kwargs))

    return graphdef, jax.jit(init, out_shardings=out_shardings)


# --------------------------------------------------------------------------- export


def _params_by_path(model: Any) -> dict[str, jax.Array]:
    _, state = nnx.split(model)
    return {_dotted(path): var[...] for path, var in nnx.to_flat_state(state)}


def save_hf(
    model: Any,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 4 * 1024**3,
) -> Path:
    """Write ``model`` as an HF directory ``transformers`` loads with
    ``AutoModelForCausalLM.from_pretrained`` (names, layout and ``config.json`` from the
    model's family plugin).

    Tensors go in ``dtype`` (default: the parameter dtype) into safetensors files of at
    most ``max_shard_bytes`` (more than one -> ``model-0000k-of-0000n.safetensors`` and
    an index). Tokenizer files (and ``generation_config.json``) are copied from
    ``tokenizer_dir`` (a directory or hub id) when given. Multi-process: every process
    must call this (gathers are collective); process 0 writes.
    """
    from safetensors.numpy import save_file

    cfg = model.config
    plugin = family_of(cfg)
    dtype = dtype or model.param_dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"Export dtype must be float32, bfloat16 or float16 (got {dtype!r}).")
    np_dtype = np.dtype(DTYPES[dtype])
    out = Path(out_dir)
    writer = jax.process_index() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    params = _params_by_path(model)
    if getattr(model, "lora_spec", None) is not None or getattr(model, "base_quantization", "none") != "none":
        from grpo.models.lora import merged_params

        params = merged_params(model)  # base (dequantized) + (alpha / r) A @ B
    entries: list[tuple[str, TensorMap, tuple[int | None, int | None]]] = []
    for tm in plugin.tensor_maps(cfg):
        for i, j in tm.entries(cfg.num_hidden_layers):
            entries.append((tm.hf_name(i, j), tm, (i, j)))
    # Plan the files up front (sizes are static) so names carry the final count.
    files: list[list[tuple[str, TensorMap, tuple[int | None, int | None]]]] = [[]]
    used = 0
    for entry in entries:
        size = math.prod(entry[1].hf_shape) * np_dtype.itemsize
        if files[-1] and used + size > max_shard_bytes:
            files.append([])
            used = 0
        files[-1].append(entry)
        used += size
    names = (
        [SINGLE_FILE] if len(files) == 1 else [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for fname, group in zip(names, files):
        tensors = {}
        for hf_name, tm, (layer, expert) in group:
            x = params[tm.param]
            if layer is not None:
                x = take_layer(x, np.int32(layer))
            if expert is not None:
                x = take_layer(x, np.int32(expert))
            tensors[hf_name] = to_hf(tm, to_host(x)).astype(np_dtype)
            weight_map[hf_name] = fname
            total += tensors[hf_name].nbytes
        if writer:
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    if writer:
        if len(files) > 1:
            write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        write_json(out / "config.json", {**plugin.hf_config(cfg), "torch_dtype": dtype})
        if tokenizer_dir is not None:
            _copy_tokenizer(tokenizer_dir, out)
    return out


def _copy_tokenizer(tokenizer_dir: str | os.PathLike, out: Path) -> None:
    src = resolve_checkpoint(tokenizer_dir)
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not any(name.startswith("tokenizer") or name in ("vocab.json",) for name in copied):
        raise CheckpointError(f"{str(src)!r} holds no tokenizer files (looked for {', '.join(TOKENIZER_FILES[:5])}, ...).")
    for name in copied:
        if (src / name).resolve() != (out / name).resolve():
            shutil.copyfile(src / name, out / name)


# --------------------------------------------------------------------------- run config


_CHECKED: dict[Any, str | None] = {}
"""(kernel name, platform, kernel) -> why its start-up check failed, or None: each kernel
is checked once per process and platform."""
_WARNED: set[tuple[str, str]] = set()


def resolve_attention(model_config: Any, mesh: Mesh | None = None, *, check: bool = False,
                      architecture: Any = None) -> tuple[str, Any]:
    """``(name, attention_impl)`` of ``model.attention`` on ``mesh``'s platform (``auto``
    resolved): the :class:`~grpo.core.contracts.AttentionPlugin`'s kernel, or ``"xla"``
    for the model's own attention. Raises ConfigError naming ``model.attention``.

    ``check``: the kernel must first pass :func:`grpo.kernels.attention.self_check` on this
    platform (once per process; ``grpo plan``, which only compiles for devices it does not
    have, does not check). A kernel that fails is a UserError naming it when
    ``model.attention`` names it; under ``auto`` it is replaced by ``xla`` with one warning.
    ``architecture`` gives the check the model's head size."""
    from grpo.core.config import attention_plugin

    mesh = mesh if mesh is not None else default_mesh()
    platform = mesh.devices.flat[0].platform
    name, plugin, options = attention_plugin(model_config, platform)
    impl = plugin.build(options, platform=platform)
    if impl is None:
        return name, "xla"
    reason = _kernel_check(name, platform, impl, model_config, mesh, architecture) if check else None
    if reason is None:
        return name, impl
    where = f"the attention kernel {name!r} failed its start-up check on {platform}: {reason}"
    if model_config.attention != "auto":
        raise UserError(
            f"model.attention={model_config.attention!r}: {where}. Set model.attention to 'xla' (the model's own "
            "attention) or 'auto' (which falls back to xla)."
        )
    if (name, platform) not in _WARNED:  # one line per process, not one per model built
        _WARNED.add((name, platform))
        log.warning("model.attention=auto: %s; using xla instead", where)
    return "xla", "xla"


def _local_device(mesh: Mesh) -> Any:
    here = jax.process_index()
    return next((d for d in mesh.devices.flat if d.process_index == here), mesh.devices.flat[0])


def _kernel_check(name: str, platform: str, impl: Any, model_config: Any, mesh: Mesh, architecture: Any) -> str | None:
    from grpo.kernels.attention import self_check

    try:
        key: Any = (name, platform, impl)
        hash(key)
    except TypeError:
        key = (name, platform)
    if key not in _CHECKED:
        head_dim = 64
        if architecture is not None:
            head_dim = architecture.head_dim or architecture.hidden_size // architecture.num_attention_heads
        group = 2 if architecture is None else min(4, architecture.num_attention_heads // architecture.num_key_value_heads)
        _CHECKED[key] = self_check(impl, dtype=DTYPES[model_config.compute_dtype], head_dim=head_dim,
                                   heads=max(1, group), device=_local_device(mesh))
    return _CHECKED[key]


def build_model(model_config: Any, mesh: Mesh | None = None, *, seed: int = 0) -> Any:
    """The policy model of a run config's ``model`` section (:class:`grpo.core.config.ModelConfig`)."""
    mesh = mesh if mesh is not None else default_mesh()
    try:
        arch = model_architecture(model_config)  # the check's head size; nothing downloaded
    except UserError:
        arch = None
    _, attention = resolve_attention(model_config, mesh, check=True, architecture=arch)
    common = dict(
        param_dtype=model_config.param_dtype, compute_dtype=model_config.compute_dtype, remat=model_config.remat,
        attention_impl=attention,
    )
    architecture = getattr(model_config, "architecture", AUTO)
    lora = getattr(model_config, "lora", None)
    if lora is not None:
        from grpo.models.lora import resolve_spec

        # Targets and rank are checked against the architecture before any weight is read.
        resolve_spec(model_architecture(model_config), lora)
    if model_config.source == "hf":
        model = load_hf(model_config.path, mesh, architecture=architecture, **common)
    else:
        from grpo.models.presets import from_random_config

        config = from_random_config(model_config.random)
        if architecture not in (AUTO, config.family):
            raise UserError(
                f"model.architecture={architecture!r} but model.random.preset={model_config.random.preset!r} is a "
                f"{config.family} model; set model.architecture to {config.family!r} or 'auto'."
            )
        model = random_init(config, mesh, seed=seed, **common)
    if lora is not None:
        from grpo.models.lora import apply_lora

        apply_lora(model, lora, seed=seed)
    return model


def model_architecture(model_config: Any) -> Any:
    """The architecture of a run config's ``model`` section without reading any weights
    or downloading anything: a random preset, a local directory's ``config.json``, or the
    built-in preset of a hub id the project knows (``Qwen/Qwen2.5-3B-Instruct``, ...)."""
    from grpo.models.presets import (
        HUB_PRESETS,
        from_random_config,
        hub_preset,
        preset_config,
    )

    if model_config.source != "hf":
        return from_random_config(model_config.random)
    path = Path(os.fspath(model_config.path)).expanduser()
    if path.is_dir():
        return read_config(path, architecture=getattr(model_config, "architecture", AUTO))
    preset = hub_preset(model_config.path)
    if preset is not None:
        return preset_config(preset)
    raise UserError(
        f"model.path={model_config.path!r} is neither a local model directory nor a hub id with a built-in "
        f"architecture preset ({', '.join(sorted(HUB_PRESETS))}); nothing is downloaded to size a run. Pass a "
        "local directory holding its config.json, or a preset: --set model.source=random "
        "--set model.random.preset=qwen2.5-3b."
    )


def abstract_model(model_config: Any, mesh: Mesh) -> tuple[Any, Any, Any]:
    """``(graphdef, params, architecture)`` of the policy ``build_model`` would build on
    ``mesh``, with every parameter a ``jax.ShapeDtypeStruct`` in its real sharding: no
    memory, no devices needed (``grpo plan``)."""
    config = model_architecture(model_config)
    _, attention = resolve_attention(model_config, mesh)
    kwargs = _model_kwargs(
        mesh, model_config.param_dtype, model_config.compute_dtype, model_config.remat, attention, None
    )
    graphdef, flat = _abstract(config, **kwargs)
    shardings = param_shardings(config, mesh)
    params = nnx.from_flat_state(
        [
            (path, var.replace(jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype, sharding=shardings[_dotted(path)])))
            for path, var in flat
        ]
    )
    lora = getattr(model_config, "lora", None)
    if lora is not None:
        from grpo.models.lora import apply_lora

        model = apply_lora(nnx.merge(graphdef, params), lora, abstract=True)
        graphdef, params = nnx.split(model)
    return graphdef, params, config


__all__ = [
    "resolve_attention",
    "CheckpointError",
    "abstract_model",
    "model_architecture",
    "SafetensorsCheckpoint",
    "build_model",
    "check_checkpoint",
    "default_mesh",
    "load_hf",
    "param_shardings",
    "random_init",
    "read_config",
    "read_family",
    "resolve_checkpoint",
    "save_hf",
]
