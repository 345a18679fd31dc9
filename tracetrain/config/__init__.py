"""The typed run configuration: a YAML file plus `key.sub=value` overrides (docs/config.md).

    base.py       what a section is (strict, a docstring per key), ConfigError, union_sections
    model.py      model, model.lora           policies.py  policies
    distill.py    distill (a teacher)                  tasks.py     data, env (one model per kind)
    objective.py  rollout, aggregate, roles, advantage, loss, correction, optim
    trainer.py    trainer, warm_start                  serving.py   gateway, engine (by kind), verl
    train.py      TrainConfig, the whole run, and the rules across its sections
    load.py       load_config(path, overrides), build_config(tree, overrides), parse_overrides
    reference.py  docs/config.md generated from the models (`python -m tracetrain.config --markdown`)

Unknown keys and bad values are errors that name the key (`ConfigError`), never ignored or coerced.
"""

from tracetrain.config.base import (
    ConfigError,
    ObjectSpec,
    Registered,
    registered,
    union_sections,
)
from tracetrain.config.distill import DistillConfig
from tracetrain.config.load import build_config, load_config, parse_overrides
from tracetrain.config.model import LoraConfig, ModelConfig, RemoteModelConfig
from tracetrain.config.objective import (
    AdvantageConfig,
    AggregateConfig,
    CorrectionConfig,
    LossConfig,
    OptimConfig,
    RolesConfig,
    RolloutConfig,
)
from tracetrain.config.policies import PolicyConfig
from tracetrain.config.reference import (
    EXTERNAL_DESCRIPTIONS,
    REFERENCE_COMMAND,
    config_reference,
    describe,
    leaf_keys,
    main,
    sections,
)
from tracetrain.config.serving import (
    WILDCARD_HOSTS,
    EngineConfig,
    GatewayConfig,
    LocalEngineConfig,
    PluginEngineConfig,
    VerlConfig,
    VllmEngineConfig,
)
from tracetrain.config.tasks import (
    DataConfig,
    EnvConfig,
    EnvironmentClassConfig,
    OpenEnvConfig,
    ReasoningGymConfig,
    ReasoningGymPart,
    VerifiersConfig,
)
from tracetrain.config.train import TrainConfig
from tracetrain.config.trainer import TrainerConfig, WarmStartConfig

__all__ = [
    "DistillConfig",
    "RemoteModelConfig",
    "EXTERNAL_DESCRIPTIONS", "REFERENCE_COMMAND", "WILDCARD_HOSTS", "AdvantageConfig",
    "AggregateConfig", "ConfigError", "CorrectionConfig", "DataConfig", "EngineConfig", "EnvConfig",
    "EnvironmentClassConfig", "GatewayConfig", "LocalEngineConfig", "LoraConfig", "LossConfig",
    "ModelConfig", "ObjectSpec", "OpenEnvConfig", "OptimConfig", "PluginEngineConfig", "PolicyConfig",
    "ReasoningGymConfig", "ReasoningGymPart", "Registered", "RolesConfig", "RolloutConfig",
    "TrainConfig", "TrainerConfig", "VerifiersConfig", "VerlConfig", "VllmEngineConfig",
    "WarmStartConfig", "build_config", "config_reference", "describe", "leaf_keys", "load_config",
    "main", "parse_overrides", "registered", "sections", "union_sections",
]
