"""Interim: every builtin env on the flat EnvConfig (replaced by per-env modules)."""
from workers.common.config.env import EnvConfig
from workers.common.registry import ENVS, PluginSpec

for _name in ("reverse_digits", "code_repair", "verifiers", "reverse_text"):
    ENVS.register(PluginSpec(name=_name, config=EnvConfig))
