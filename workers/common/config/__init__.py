"""Config schemas for every role: keyword-only dataclasses, one docstring per field, one file per section.

The launcher registers these in Hydra's ConfigStore and composes YAML onto them; it then
writes the resolved tree to ``run_dir/config/run.yaml``. Compute-node roles load that file
with :func:`load_run_config` (plain OmegaConf, no Hydra, no torch needed).
Required values are ``MISSING``; counts are ``num_*``. The sections ``model``, ``weights``,
``env`` and ``inference`` take the schema of the entry they name (workers/common/registry.py).
"""
from workers.common.config.algorithm import AlgorithmConfig, TeacherConfig
from workers.common.config.cluster import ClusterConfig, PreflightConfig
from workers.common.config.env import EnvConfig
from workers.common.config.inference import InferenceConfig, ServerLayout
from workers.common.config.launcher import LauncherConfig, RoleResources, TrainerLayout
from workers.common.config.model import ModelConfig
from workers.common.config.orchestrator import OrchestratorConfig
from workers.common.config.run import (ConfigError, RunConfig, conform_sections, load_run_config, section_schema,
                                       structure_section, to_yaml)
from workers.common.config.tracking import TrackingConfig
from workers.common.config.lora import LoraConfig
from workers.common.config.trainer import ParallelConfig, TrainerConfig
from workers.common.config.weights import WeightsConfig

__all__ = ["AlgorithmConfig", "TeacherConfig", "ClusterConfig", "ConfigError", "EnvConfig", "InferenceConfig", "LauncherConfig", "LoraConfig", "ModelConfig",
           "OrchestratorConfig", "ParallelConfig", "PreflightConfig", "RoleResources", "RunConfig", "ServerLayout",
           "TrackingConfig", "TrainerConfig", "TrainerLayout", "WeightsConfig", "conform_sections", "load_run_config",
           "section_schema", "structure_section", "to_yaml"]
