"""What every plugin has: a ``name``, a ``description`` and validated ``Options``."""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Mapping

from pydantic import BaseModel, ConfigDict


class PluginOptions(BaseModel):
    """Base class for plugin ``Options``: unknown keys are errors, values are checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoOptions(PluginOptions):
    """For plugins that take no options."""


class _PluginBase(abc.ABC):
    name: ClassVar[str]
    description: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = NoOptions

    def parse_options(self, raw: Mapping[str, Any] | None) -> BaseModel:
        return self.Options.model_validate(dict(raw or {}))
