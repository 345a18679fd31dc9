"""The typed run configuration: a YAML file plus `key.sub=value` overrides (docs/config.md).

    sections.py   one pydantic model per section, a docstring per key; TrainConfig, the whole run
    load.py       load_config(path, overrides), build_config(tree, overrides), parse_overrides
    reference.py  docs/config.md generated from the models (`python -m tracetrain.config --markdown`)

Unknown keys and bad values are errors that name the key (`ConfigError`), never ignored or coerced.
"""

from tracetrain.config.load import build_config, load_config, parse_overrides
from tracetrain.config.reference import (
    EXTERNAL_DESCRIPTIONS,
    REFERENCE_COMMAND,
    config_reference,
    describe,
    leaf_keys,
    main,
    sections,
)
from tracetrain.config.sections import (
    WILDCARD_HOSTS,
    AdvantageConfig,
    AggregateConfig,
    ConfigError,
    CorrectionConfig,
    DataConfig,
    EngineConfig,
    EnvConfig,
    EnvironmentClassConfig,
    GatewayConfig,
    LocalEngineConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    ObjectSpec,
    OpenEnvConfig,
    OptimConfig,
    PluginEngineConfig,
    PolicyConfig,
    ReasoningGymConfig,
    ReasoningGymPart,
    Registered,
    RolesConfig,
    RolloutConfig,
    TrainConfig,
    TrainerConfig,
    VerifiersConfig,
    VerlConfig,
    VllmEngineConfig,
    WarmStartConfig,
    registered,
    union_sections,
)

__all__ = [
    "EXTERNAL_DESCRIPTIONS", "REFERENCE_COMMAND", "WILDCARD_HOSTS", "AdvantageConfig",
    "AggregateConfig", "ConfigError", "CorrectionConfig", "DataConfig", "EngineConfig", "EnvConfig",
    "EnvironmentClassConfig", "GatewayConfig", "LocalEngineConfig", "LoraConfig", "LossConfig",
    "ModelConfig", "ObjectSpec", "OpenEnvConfig", "OptimConfig", "PluginEngineConfig", "PolicyConfig",
    "ReasoningGymConfig", "ReasoningGymPart", "Registered", "RolesConfig", "RolloutConfig",
    "TrainConfig", "TrainerConfig", "VerifiersConfig", "VerlConfig", "VllmEngineConfig",
    "WarmStartConfig", "build_config", "config_reference", "describe", "leaf_keys", "load_config",
    "main", "parse_overrides", "registered", "sections", "union_sections",
]
