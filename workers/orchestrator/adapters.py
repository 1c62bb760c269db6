"""Several LoRA adapters on one base (``trainer.lora.adapters``, issue 44 item 5), orchestrator side.

Each adapter is the ``env=mix`` entry of its name (workers/common/config/lora.py checks it at plan
time), so a group's adapter is its task's mix label: every request of the group names it
(``lora_path``, the field the embedded engine and SGLang read), its rows go to the trainer tagged with
the adapter's index in ``trainer.lora.adapters`` (``adapter_ids`` in the batch file,
workers/common/protocol.py), and the batch reports ``reward/<adapter>`` beside the mix's
``env/<adapter>/...``. Versions and staleness are the run's: one published step holds every adapter
(workers/weights/lora_steps.py), confirmed as a whole.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def trained_adapters(cfg: Any) -> tuple[str, ...]:
    """The run's adapter names when it trains several, else ``()``."""
    lora = cfg.trainer.lora
    names = tuple(lora.adapters) if lora.enabled else ()
    return names if len(names) > 1 else ()


def adapter_of(task: Any, adapters: Sequence[str]) -> str:
    """The adapter a task trains (its mix label), ``""`` for a run of one adapter."""
    if not adapters:
        return ""
    label = getattr(task, "label", None)
    if label not in adapters:  # the plan check makes this impossible; a wrong row would train the wrong adapter
        raise ValueError(f"task {getattr(task, 'task_id', task)!r} has label {label!r}, not one of "
                         f"trainer.lora.adapters={list(adapters)}")
    return label


class NamedAdapterClient:
    """A generation client whose every request names one adapter (SGLang's ``lora_path``)."""

    def __init__(self, inner: Any, adapter: str):
        self.inner, self.adapter = inner, adapter

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, input_ids, **kw):
        kw["extra"] = {**(kw.get("extra") or {}), "lora_path": self.adapter}
        return await self.inner.generate(input_ids, **kw)


def client_for(client: Any, task: Any, adapters: Sequence[str]) -> Any:
    """``client`` as the task's adapter's (unchanged for a run of one adapter)."""
    name = adapter_of(task, adapters)
    return NamedAdapterClient(client, name) if name else client


def adapter_ids(groups: Sequence[Any], adapters: Sequence[str]) -> np.ndarray:
    """int32 [B]: each sample's adapter index, in the batch's row order (samples of groups in order)."""
    return np.array([adapters.index(g.adapter) for g in groups for _ in g.samples], dtype=np.int32)


def adapter_metrics(groups: Sequence[Any], adapters: Sequence[str]) -> dict[str, float]:
    """``reward/<adapter>`` (mean reward of its samples in this batch) and ``samples/<adapter>``."""
    out: dict[str, float] = {}
    for name in adapters:
        rewards = [s.reward for g in groups if g.adapter == name for s in g.samples]
        out[f"samples/{name}"] = len(rewards)
        out[f"reward/{name}"] = float(np.mean(rewards)) if rewards else float("nan")
    return out
