"""Registers model family ``hf_generic``: any ``AutoModelForCausalLM`` checkpoint no native family covers.

How a checkpoint gets here: workers/models/hf_dir.py ``spec_for`` gives ``model.path``'s config.json
to the native family whose ``hf_architectures`` holds its ``architectures``; an architecture none
holds falls to this family when transformers' ``AutoModelForCausalLM`` knows its ``model_type``
(hf_source.py reads that from transformers' source, torch-free), otherwise it is refused as before.

What it is: transformers' own modeling code (model.py) behind our CausalLM contract, so the trainer
and the embedded engine need nothing of their own for it. What it is NOT (the plan says so on its
``model:`` line and refuses the settings by key): tensor, expert or context parallelism (data
parallel only: FSDP2 over every trainer rank, a unit per decoder layer), Router Replay (no router
hook), the static engine and its CUDA graphs (transformers' growing KV cache instead). Parameter
names are the checkpoint's (``to_hf`` / ``from_hf`` the identity); a published step's config.json
is the source's own, less a stored quantization (steps are dequantised).

Torch-free at import (the launcher's side); ``build`` / ``init`` import model.py when called.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from workers.common.registry import MODELS
from workers.models.facts import Architecture, ParamCount
from workers.models.hf_generic.config import GenericConfig
from workers.models.hf_generic.hf_source import causal_lm_classes, config_facts, standard_values, transformers_version
from workers.models.spec import ModelSpec

FAMILY = "hf_generic"
REQUIRED = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
            "num_attention_heads": "num_heads"}
"""transformers' standard name -> our field: what the plan cannot do without."""


def knows(config: dict) -> tuple[bool, str]:
    """(True, "") when transformers' ``AutoModelForCausalLM`` builds config.json's ``model_type`` as its
    ``architectures`` class; else (False, why not), for the refusal."""
    model_type, arches = str(config.get("model_type", "")), config.get("architectures") or []
    classes = causal_lm_classes()
    if not classes:
        return False, "the generic transformers path needs the transformers package where the launcher runs"
    built = classes.get(model_type)
    if built is None:
        return False, (f"model_type={model_type!r} is not one transformers {transformers_version()}'s "
                       f"AutoModelForCausalLM builds (the generic path)")
    if arches[:1] != [built]:
        return False, (f"transformers builds {built!r} for model_type={model_type!r}, not {arches[0]!r} (the generic "
                       f"path runs transformers' own class only, never custom modeling code)")
    return True, ""


def from_hf_config(config: dict) -> dict:
    """{model field: value} of a config.json, read with transformers' own names and defaults."""
    model_type = str(config.get("model_type", ""))
    classes = causal_lm_classes()
    if not classes:
        raise ValueError("config.json: the generic transformers path needs the transformers package where the "
                         "launcher runs (pip install 'transformers>=5,<6')")
    if model_type not in classes:
        raise ValueError(f"config.json: model_type={model_type!r} is not one transformers "
                         f"{transformers_version()}'s AutoModelForCausalLM builds")
    arch = (config.get("architectures") or [classes[model_type]])[0]
    if arch != classes[model_type]:
        raise ValueError(f"config.json: architectures={config.get('architectures')} but transformers builds "
                         f"{classes[model_type]!r} for model_type={model_type!r}; the generic path builds only "
                         f"transformers' own class (custom modeling code, auto_map / trust_remote_code, is not run)")
    values = standard_values(config)
    attribute_map = config_facts(model_type)[0]
    out: dict[str, Any] = {"architecture": arch, "model_type": model_type}
    for name, field in REQUIRED.items():
        value = values.get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            spelled = sorted({name, attribute_map.get(name, name)})
            raise ValueError(f"config.json: the generic path needs an integer {' or '.join(spelled)} (transformers' "
                             f"{name}), got {value!r}" + (" (a multimodal config: its text_config is not read)"
                                                           if "text_config" in config else ""))
        out[field] = value
    for name, field in (("num_key_value_heads", "num_kv_heads"), ("head_dim", "head_dim"),
                        ("max_position_embeddings", "max_position_embeddings")):
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:  # else left to the model section
            out[field] = value
    out["tie_word_embeddings"] = bool(values.get("tie_word_embeddings", False))
    return out


def to_hf_config(m: GenericConfig) -> dict:
    """The source's config.json (a published step is the same architecture), stored quantization dropped."""
    if not m.path:
        raise ValueError("model.family=hf_generic publishes the config.json of model.path, which is empty")
    config = json.loads((Path(m.path) / "config.json").read_text())
    config.pop("quantization_config", None)
    config.pop("torch_dtype", None)
    return config


@functools.lru_cache(maxsize=16)
def checkpoint_parameters(path: str) -> int:
    """Elements of every tensor of the checkpoint (safetensors headers; FP8 block scales not counted)."""
    from workers.models.hf_dir import read_st_header, weight_map

    directory, total = Path(path), 0
    files = weight_map(directory)
    for file in sorted(set(files.values())):
        for name, entry in read_st_header(directory / file).items():
            if name in files and not name.endswith("_scale_inv"):
                n = 1
                for d in entry.get("shape", []):
                    n *= int(d)
                total += n
    return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenericArchitecture(Architecture):
    """Counted from the checkpoint itself (any block kind transformers has); KV bytes from the sizes."""

    num_parameters: int = 0

    def params(self) -> ParamCount:
        if not self.num_parameters:
            return super().params()
        return ParamCount(total=self.num_parameters, active=self.num_parameters, mtp=0)


def arch(m: GenericConfig) -> Architecture:
    count = checkpoint_parameters(str(m.path)) if m.path and Path(m.path).is_dir() else 0
    return GenericArchitecture(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                               num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                               dense_intermediate_size=4 * m.hidden_size, tie_word_embeddings=m.tie_word_embeddings,
                               num_parameters=count)


def check(cfg) -> None:
    """Plan time: a checkpoint to load, and the settings this path does not have, each refused by its key
    (a config.json without a position limit leaves model.max_position_embeddings 0: check_base refuses it)."""
    m, par = cfg.model, cfg.trainer.parallel
    if not m.path:
        raise ValueError("model.family=hf_generic trains a Hugging Face checkpoint through transformers: set "
                         "model.path=DIR (config.json + safetensors)")
    for key in ("tp", "ep", "cp", "pp"):
        value = getattr(par, key)
        if value != 1:
            raise ValueError(f"trainer.parallel.{key}={value}: {m.architecture} takes the generic transformers path, "
                             f"which trains data parallel only (FSDP2 over all trainer.num_ranks ranks); set "
                             f"trainer.parallel.{key}=1")
    inf = cfg.inference
    if inf.backend == "embedded" and getattr(inf, "static_cache", "auto") == "on":
        raise ValueError(f"inference.static_cache=on: {m.architecture} takes the generic transformers path, whose "
                         f"embedded engine keeps transformers' own KV cache (no static slots or CUDA graphs); set "
                         f"inference.static_cache=auto (or off), or serve it with SGLang: inference=sglang_node")


def route(m: GenericConfig) -> str:
    """The plan's line on which code trains and serves this checkpoint, and why."""
    return (f"generic transformers path (architectures=['{m.architecture}'] has no native family; transformers "
            f"{transformers_version() or '?'} builds it); data parallel only (no TP/EP/CP, no Router Replay); "
            f"embedded engine: dynamic KV cache, no CUDA graphs")


def build(model_cfg, *, device=None, dtype=None):
    from workers.models.hf_generic import model

    return model.build(model_cfg, device=device, dtype=dtype)


def init(model_cfg, dtype):
    from workers.models.hf_generic import model

    return model.init(model_cfg, dtype)


def not_built(model_cfg, name: str) -> bool:
    from workers.models.hf_generic import model

    return model.not_built(model_cfg, name)


SPEC = MODELS.register(ModelSpec(
    name=FAMILY, config=GenericConfig, check=check, arch=arch, build=build, init=init, not_built=not_built,
    parallelize="", router_hook=None, to_hf_config=to_hf_config, from_hf_config=from_hf_config, route_line=route,
    catch_all=knows,
    summary="the generic transformers path: any model_type transformers' AutoModelForCausalLM builds"))
