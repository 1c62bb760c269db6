"""Interim: every builtin family on the flat ModelConfig (replaced by per-family homes)."""
from workers.common.config.model import ModelConfig
from workers.common.registry import MODELS, PluginSpec

for _name in ("tiny_moe", "llama", "deepseek_v3", "glm_moe_dsa", "nemotron_h"):
    MODELS.register(PluginSpec(name=_name, config=ModelConfig))
