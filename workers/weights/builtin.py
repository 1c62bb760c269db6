"""Interim: both builtin transports on the flat WeightsConfig (replaced by per-transport packages)."""
from workers.common.config.weights import WeightsConfig
from workers.common.registry import TRANSPORTS, PluginSpec

for _name in ("filesystem", "broadcast"):
    TRANSPORTS.register(PluginSpec(name=_name, config=WeightsConfig))
