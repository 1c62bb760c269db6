"""Interim: both builtin backends on the flat InferenceConfig (replaced by per-backend packages)."""
from workers.common.config.inference import InferenceConfig
from workers.common.registry import BACKENDS, PluginSpec

for _name in ("embedded", "sglang"):
    BACKENDS.register(PluginSpec(name=_name, config=InferenceConfig))
