"""The run config: pydantic v2 models, YAML loading, overrides, plugin options, checks.

Loading happens in two stages:

1. :func:`load_config` — YAML + ``${VAR}`` interpolation + ``--set`` overrides, schema
   validation, plugin names and plugin options, cross-field checks that need no devices.
2. :func:`resolve_layout` — given a :class:`~grpo.core.contracts.Topology`, the mesh
   layout and every check that depends on it (batch divisibility over the mesh, rollout
   style and loss constraints).

Every problem is reported at once, each naming the dotted field path and the value
received. Behaviour is configured in the file; nothing reads hidden environment
variables except explicit ``${VAR}`` references.

The modules, in the order a config passes through them:

- :mod:`~grpo.core.config.section`: the base of every section;
- :mod:`~grpo.core.config.training`: the ``train`` sub-sections (advantages, dynamic and
  down-sampling, packing, async; :mod:`~grpo.core.config.compile`: the ``train.compile``
  section, when and where the programs compile);
- :mod:`~grpo.core.config.schema`: the other sections and :class:`RunConfig`;
- :mod:`~grpo.core.config.engine`: the rollout engines' option sections;
- :mod:`~grpo.core.config.load`: YAML, interpolation, ``--set``, :func:`load_config`;
- :mod:`~grpo.core.config.validate`: validation errors as problems, plugin selection,
  cross-field checks and :func:`resolve_layout`;
- :mod:`~grpo.core.config.fingerprint`: a run's identity, the fields that define it.
"""

from __future__ import annotations

from grpo.core.config.load import (
    SWITCHABLE,
    apply_overrides,
    drop_switched_options,
    load_config,
    parse_override,
    read_yaml,
)
from grpo.core.config.schema import (
    LORA_PROJECTIONS,
    PRESETS,
    AdvantageConfig,
    AsyncConfig,
    CheckpointConfig,
    CompileConfig,
    ContinuousEngineConfig,
    DistributedConfig,
    DownSamplingConfig,
    DynamicSamplingConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    LossConfig,
    MeshConfig,
    MismatchConfig,
    ModelConfig,
    MoeConfig,
    OptimizerConfig,
    OverlongConfig,
    PackingConfig,
    RandomModelConfig,
    RolloutConfig,
    RolloutQuantizationConfig,
    RunConfig,
    Section,
    TaskConfig,
    TrainConfig,
    WandbConfig,
    json_schema,
)
from grpo.core.config.validate import (
    OPTION_FIELDS,
    PLUGIN_FIELDS,
    Selected,
    attention_plugin,
    cross_field_problems,
    resolve_layout,
    select_plugins,
    validation_problems,
)
from grpo.core.errors import ConfigError, PluginError, UserError

__all__ = [
    "OPTION_FIELDS",
    "PLUGIN_FIELDS",
    "PRESETS",
    "RunConfig",
    "Selected",
    "apply_overrides",
    "attention_plugin",
    "cross_field_problems",
    "json_schema",
    "load_config",
    "read_yaml",
    "resolve_layout",
    "select_plugins",
]
