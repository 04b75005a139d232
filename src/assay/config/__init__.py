"""The typed run configuration: YAML plus dotted `key=value` overrides, validated.

Every section is a pydantic model that forbids unknown keys; each field is documented
where it is declared. `load_config` turns any mistake into one `AssayError` line that
names the key, the value given and what is allowed.

The sections live in `base.py` (what every config shares: `Section`, YAML, overrides, the explainer), `sections.py`
(model, data, rollout, algo, critic, selection, preference, optim, train) and `run.py` (image, monitor, env, cluster,
`RunConfig`, `load_config`); every name is importable from `assay.config`.
"""

from assay.config.base import Section, apply_override, explain, read_yaml_mapping, yaml_problem
from assay.config.run import ClusterConfig, EnvConfig, ImageConfig, MonitorConfig, RunConfig, load_config
from assay.config.sections import (DEFAULT_TASK, AlgoConfig, CriticConfig, DataConfig, LoraSettings, ModelConfig, OptimConfig,
                                   PreferenceConfig, RolloutConfig, SelectionConfig, TrainConfig)

__all__ = ["DEFAULT_TASK", "AlgoConfig", "ClusterConfig", "CriticConfig", "DataConfig", "EnvConfig", "ImageConfig", "LoraSettings",
           "ModelConfig", "MonitorConfig", "OptimConfig", "PreferenceConfig", "RolloutConfig", "RunConfig", "Section",
           "SelectionConfig", "TrainConfig", "apply_override", "explain", "load_config", "read_yaml_mapping", "yaml_problem"]
