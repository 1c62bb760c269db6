"""One registry per plugin axis: model families, weight transports, environments, inference backends.

Why registries: each thing users vary lives in one home (a folder or module) that owns its config
schema, its plan-time check and its role-side code. Everything else reaches it only through the
registry, by the name the config gives (``model.family``, ``weights.transport``, ``env.name``,
``inference.backend``), so a new entry is one new home and nothing else is edited.

Builtin entries are indexed by name -> module; the module registers its spec when imported, so
looking one name up imports only that home. Plugins outside this repo register the same way from
a module named in ``SLURMRL_PLUGINS`` or ``plugins=[...]`` (workers/common/plugins.py).

A spec's module, its ``config`` dataclass and its ``check`` are torch-free: the launcher imports
them on the login node. Role-side code (models, publishers, engines) is imported lazily inside
the spec's functions.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Generic, Optional, TypeVar


class UnknownEntry(ValueError):
    """A config names an entry no registry holds; the message names the key and the choices."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PluginSpec:
    """What every entry of every axis has; each axis adds its own fields in a subclass."""

    name: str
    """The value of the axis's config key that selects this entry."""
    config: type
    """Config schema (a keyword-only dataclass) of the section this entry reads."""
    check: Optional[Callable[[Any], None]] = None
    """Plan-time check ``check(run_cfg)``: pure, no torch, raises ValueError (PlanError) naming the key."""
    summary: str = ""
    """One line for ``--help``-style listings and docs."""


S = TypeVar("S", bound=PluginSpec)


class Registry(Generic[S]):
    """Named specs of one axis. ``get`` imports a builtin's module on first use."""

    def __init__(self, axis: str, key: str, group: str, builtins: dict[str, str]):
        self.axis, self.key, self.group = axis, key, group
        """``key``: the config key that names an entry; ``group``: the Hydra config group of its section."""
        self._builtins = dict(builtins)
        self._entries: dict[str, S] = {}

    def register(self, spec: S, *, replace: bool = False) -> S:
        """Add ``spec``; a second entry of the same name is a mistake unless ``replace``."""
        old = self._entries.get(spec.name)
        if old is not None and old is not spec and not replace:
            raise ValueError(f"{self.axis} {spec.name!r} is registered twice ({old!r} and {spec!r})")
        self._entries[spec.name] = spec
        return spec

    def unregister(self, name: str) -> None:
        """Tests only: drop an entry registered at run time."""
        self._entries.pop(name, None)

    def get(self, name: str) -> S:
        if name not in self._entries and name in self._builtins:
            importlib.import_module(self._builtins[name])
        if name not in self._entries:
            raise UnknownEntry(f"{self.key}={name!r} is not a known {self.axis}; choose one of {self.names()}")
        return self._entries[name]

    def names(self) -> list[str]:
        """Every builtin and registered name (imports every builtin home: torch-free by contract)."""
        for module in sorted(set(self._builtins.values())):
            importlib.import_module(module)
        return sorted(set(self._entries) | set(self._builtins))

    def specs(self) -> list[S]:
        return [self.get(n) for n in self.names()]

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._builtins


MODELS: Registry = Registry("model family", "model.family", "model", {
    "tiny_moe": "workers.models.tiny_moe.spec", "llama": "workers.models.llama.spec",
    "deepseek_v3": "workers.models.deepseek_v3.spec", "glm_moe_dsa": "workers.models.glm_moe_dsa.spec",
    "nemotron_h": "workers.models.nemotron_h.spec", "qwen3_moe": "workers.models.qwen3_moe.spec",
    "qwen3": "workers.models.qwen3.spec", "qwen2": "workers.models.qwen2.spec", "mistral": "workers.models.mistral.spec",
    "gemma3_text": "workers.models.gemma3_text.spec", "gpt_oss": "workers.models.gpt_oss.spec",
    "hf_generic": "workers.models.hf_generic.spec"})
TRANSPORTS: Registry = Registry("weight transport", "weights.transport", "weights", {
    "filesystem": "workers.weights.filesystem", "broadcast": "workers.weights.broadcast"})
ENVS: Registry = Registry("environment", "env.name", "env", {
    "reverse_digits": "workers.orchestrator.envs.reverse_digits", "code_repair": "workers.orchestrator.envs.code_repair",
    "verifiers": "workers.orchestrator.envs.verifiers_adapter", "reverse_text": "workers.orchestrator.envs.reverse_text",
    "dataset": "workers.orchestrator.envs.dataset", "swe": "workers.orchestrator.envs.swe",
    "mix": "workers.orchestrator.envs.mix", "target": "workers.orchestrator.envs.target"})
BACKENDS: Registry = Registry("inference backend", "inference.backend", "inference", {
    "embedded": "workers.inference.embedded.spec", "sglang": "workers.inference.sglang.spec"})

#: Config sections whose schema an entry chooses: section -> (field naming the entry, registry).
SECTIONS: dict[str, tuple[str, Registry]] = {
    "model": ("family", MODELS), "weights": ("transport", TRANSPORTS), "env": ("name", ENVS),
    "inference": ("backend", BACKENDS)}


def speaks_sglang(cfg: Any) -> bool:
    """Are the run's servers SGLang's (then SGLang's protocol for weights and adapters, else our embedded
    workers' routes)? One home for the question: the config's checks, both transports and LoRA ask it."""
    backend = BACKENDS.get(cfg.inference.backend)
    return "sglang" in (backend.name, *backend.serves_api_of)
