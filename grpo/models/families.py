"""Which model plugin handles a checkpoint or a config (JAX-free).

- :func:`resolve_family` — ``model.architecture`` (``auto`` or a plugin name) and a
  checkpoint's ``config.json`` -> the :class:`grpo.ModelPlugin` to use, or a
  :class:`grpo.UserError` that says what the checkpoint is and which plugins are
  installed.
- :func:`family_of` — the plugin that owns a family config (by its ``family``).
- :class:`DecoderFamily` — the :class:`grpo.ModelPlugin` of any family that is the shared
  decoder (:mod:`grpo.models.decoder`) with a config of its own; exported as
  ``grpo.DecoderFamily``. JAX is imported inside its methods.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Mapping, Sequence

from grpo.core.contracts import ModelPlugin
from grpo.core.errors import PluginError, UserError

AUTO = "auto"


def _plugins(plugins: Any = None) -> Any:
    if plugins is not None:
        return plugins
    from grpo.core.plugins import get_plugins

    return get_plugins()


def installed(plugins: Any = None) -> str:
    """``name (model types), ...`` of every installed model plugin, for messages."""
    rows = [
        f"{e.name} ({', '.join(e.plugin.model_types) or 'no model types'})" for e in _plugins(plugins).registry("model")
    ]
    return ", ".join(rows) or "(none)"


def resolve_family(
    hf_config: Mapping[str, Any], *, architecture: str = AUTO, where: str = "the checkpoint", plugins: Any = None
) -> ModelPlugin:
    """The model plugin for a checkpoint whose ``config.json`` is ``hf_config``.

    ``architecture``: ``auto`` (the plugin whose ``model_types`` hold the checkpoint's
    ``model_type``) or a plugin name (which must handle it). ``where`` names the
    checkpoint in messages. Raises :class:`UserError` (exit 2) otherwise.
    """
    plugins = _plugins(plugins)
    model_type = hf_config.get("model_type")
    archs = [str(a) for a in (hf_config.get("architectures") or [])]
    shown = f"model_type={model_type!r}" + (f", architectures={archs}" if archs else "")
    registry = plugins.registry("model")
    by_type = [e.plugin for e in registry if model_type in e.plugin.model_types]
    if architecture != AUTO:
        try:
            plugin = plugins.get("model", architecture)
        except PluginError as err:
            raise UserError(f"model.architecture: {err}") from None
        if plugin.handles(model_type, archs):
            return plugin
        if model_type in plugin.model_types:
            raise UserError(
                f"{where} has {shown}; the {plugin.name} model plugin loads "
                f"{', '.join(plugin.architectures)} checkpoints (a causal-LM head), not {', '.join(archs)}."
            )
        owners = [p.name for p in by_type]
        hint = (
            f"it is a {' or '.join(owners)} checkpoint: set model.architecture to {owners[0]!r} or 'auto'"
            if owners else f"no installed model plugin handles it (installed: {installed(plugins)})"
        )
        raise UserError(
            f"model.architecture={architecture!r} asks for the {plugin.name} model family (model_type "
            f"{' or '.join(repr(t) for t in plugin.model_types)}), but {where} has {shown}; {hint}."
        )
    if model_type is None:
        raise UserError(f"{where} has no model_type in its config.json, so its model family is unknown.")
    fitting = [p for p in by_type if p.handles(model_type, archs)]
    if len(fitting) == 1:
        return fitting[0]
    if len(fitting) > 1:
        names = ", ".join(p.name for p in fitting)
        raise UserError(
            f"{where} has {shown}, which several model plugins handle ({names}); choose one with "
            "model.architecture."
        )
    if by_type:
        plugin = by_type[0]
        raise UserError(
            f"Unexpected architecture in {where}: {shown}; the {plugin.name} model plugin loads "
            f"{', '.join(plugin.architectures)} checkpoints (a causal-LM head), not other {plugin.name} heads."
        )
    reasons = [e.plugin.refused_model_types[model_type] for e in registry if model_type in e.plugin.refused_model_types]
    why = (" " + " ".join(reasons)) if reasons else ""
    raise UserError(
        f"Unexpected architecture in {where}: {shown}, which no installed model plugin handles.{why} "
        f"Installed model plugins (model types): {installed(plugins)}. A new family is a `register_models` "
        "plugin (see the README's 'Writing a plugin')."
    )


def family_of(config: Any, plugins: Any = None) -> ModelPlugin:
    """The model plugin that owns ``config`` (its ``family`` attribute names it)."""
    name = getattr(config, "family", None)
    if not isinstance(name, str):
        raise TypeError(f"{type(config).__name__} has no `family` naming its model plugin")
    return _plugins(plugins).get("model", name)


class DecoderFamily(ModelPlugin):
    """A :class:`grpo.ModelPlugin` for the shared decoder (:class:`grpo.models.decoder.Decoder`).

    Subclasses set ``name``, ``model_types``, ``architectures`` and ``config_class``
    (``"module:Class"`` of a :class:`~grpo.models.decoder.DecoderConfig` subclass whose
    ``family`` is ``name``).
    """

    config_class: ClassVar[str] = ""

    def config_type(self) -> Any:
        module, _, attr = self.config_class.partition(":")
        return getattr(importlib.import_module(module), attr)

    def config_from_hf(self, hf_config: Any) -> Any:
        return self.config_type().from_hf(hf_config)

    def hf_config(self, config: Any) -> dict[str, Any]:
        from grpo.models.hf import hf_config_dict

        return hf_config_dict(config)

    def param_specs(self, config: Any) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        return config.param_specs()

    def tensor_maps(self, config: Any) -> Sequence[Any]:
        from grpo.models.hf import tensor_maps

        return tensor_maps(config)

    def build(
        self,
        config: Any,
        *,
        rngs: Any,
        param_dtype: Any = "float32",
        compute_dtype: Any = "float32",
        remat: str = "none",
        attention_impl: Any = "xla",
        mesh: Any = None,
        activation_rules: Mapping[str, Any] | None = None,
    ) -> Any:
        from grpo.models.decoder import Decoder

        return Decoder(
            config, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat,
            attention_impl=attention_impl, mesh=mesh, activation_rules=activation_rules,
        )


__all__ = ["AUTO", "DecoderFamily", "family_of", "installed", "resolve_family"]
