"""Per-layer attention kinds of the interleaved local/global families (gemma3_text, gpt_oss). Torch-free.

transformers describes which layers attend through a sliding window by ``layer_types``: one of
``"sliding_attention"`` / ``"full_attention"`` per layer. Older config.json files give a period
instead (Gemma 3's ``sliding_window_pattern`` 6: every 6th layer full; GPT-OSS's default
alternates, even layers sliding); :func:`periodic` expands both into the list the model sections
keep, so the config always says, layer by layer, what the model builds.
"""
from __future__ import annotations

from workers.common.config.ranges import Each, one_of

SLIDING, FULL = "sliding_attention", "full_attention"
KINDS = (SLIDING, FULL)
RULE = Each(one_of(*KINDS))
"""The range rule of a ``layer_types`` field."""


def periodic(num_layers: int, period: int) -> list[str]:
    """transformers' expansion: layer i is full when (i + 1) % period == 0, sliding otherwise."""
    return [FULL if (i + 1) % period == 0 else SLIDING for i in range(num_layers)]


def check(m) -> None:
    """``model.layer_types`` has one entry per layer; a sliding layer needs ``model.sliding_window`` > 0."""
    if len(m.layer_types) != m.num_layers:
        raise ValueError(f"model.layer_types has {len(m.layer_types)} entries; model.num_layers is {m.num_layers} "
                         f"(one of {list(KINDS)} per layer)")
    if SLIDING in m.layer_types and m.sliding_window <= 0:
        raise ValueError(f"model.layer_types has {SLIDING!r} layers, so model.sliding_window must be > 0, "
                         f"got {m.sliding_window}")


def from_hf(d: dict, num_layers: int, default_period: int) -> list[str]:
    """``layer_types`` of a config.json dict (popping the keys it reads): the list as given, else the
    expansion of ``sliding_window_pattern`` (or ``_sliding_window_pattern``), else of ``default_period``."""
    period = d.pop("sliding_window_pattern", None)
    hidden = d.pop("_sliding_window_pattern", None)
    types = d.pop("layer_types", None)
    if types is not None:
        return list(types)
    return periodic(num_layers, int(period or hidden or default_period))
