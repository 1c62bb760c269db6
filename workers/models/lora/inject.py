"""Turning a model into a LoRA model, its adapters' initial values, and the adapter as published.

:func:`apply_lora` swaps every targeted ``nn.Linear`` (linear.py) and expert stack (experts.py) of
the decoder layers in place and freezes everything else, so the trainer's plans, checkpoints and
optimizer see a model whose only trainable parameters are the adapters (float32 master), while the
base stays in the compute dtype it was built in: no master copy, no gradient, no AdamW state.

Initial values (:func:`init_tensors`, a stream like ``CausalLM.seeded_tensors`` that ``materialize``
fills a meta-built, sharded model from): A uniform in +-1/sqrt(in) (PEFT's kaiming-uniform default),
B zeros, so step 0's policy IS the base and the step-0 publish is the base itself. Each tensor has
its own generator seeded from (seed, name): the values do not depend on the sharding or the order.

:func:`gather_adapter` (COLLECTIVE under a plan: one ``full_tensor`` per factor) gives the
in-memory adapter of workers/weights/lora_format.py under Hugging Face names.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from workers.common.config.lora import adapts_experts, linear_targets
from workers.common.config.ranges import ConfigError
from workers.models.blocks.experts import StackedExperts
from workers.models.lora.experts import LoraExperts, lora_experts
from workers.models.lora.linear import LoraLinear, lora_linear
from workers.models.lora.rows import AdapterRows
from workers.weights.lora_format import Adapter

LORA_PARAM_MARK = ("lora_A", "lora_B")


def is_lora_name(name: str) -> bool:
    """True for an adapter parameter's name (``...q_proj.lora_A``, ``...experts.lora_B.down_proj``)."""
    parts = name.split(".")
    return any(p in LORA_PARAM_MARK for p in parts)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(path, module)`` of every LoRA target of ``model``, in module order."""
    for name, mod in model.named_modules():
        if isinstance(mod, (LoraLinear, LoraExperts)):
            yield name, mod


def is_lora(model: nn.Module) -> bool:
    return next(lora_modules(model), None) is not None


def apply_lora(model: nn.Module, lcfg, *, family: str = "", adapter_dtype: torch.dtype = torch.float32) -> list[str]:
    """Make ``model`` (a CausalLM; any device, meta included) a LoRA model per ``lcfg`` (trainer.lora) and
    freeze its base; returns the adapted module paths. ConfigError naming trainer.lora.targets when
    nothing in the model matches. Several adapters (``lcfg.adapters``): every target holds them side by
    side and shares one :class:`AdapterRows`, also set as ``model.lora_rows`` (rows.py)."""
    moe = any(isinstance(m, StackedExperts) for m in model.modules())
    names, experts = linear_targets(lcfg.targets, moe=moe), adapts_experts(lcfg.targets)
    scale = lcfg.alpha / lcfg.rank
    rows = AdapterRows(lcfg.adapters, lcfg.rank) if len(lcfg.adapters) > 1 else None
    if rows is not None and experts and moe:
        raise ConfigError(f"trainer.lora.adapters={list(lcfg.adapters)} with routed-expert adapters "
                          f"(trainer.lora.targets has 'experts'): several adapters adapt dense projections only; "
                          f"set trainer.lora.targets=[attention] on a MoE model")
    done = []
    for path, mod in list(model.named_modules()):
        if ".layers." not in f".{path}.":  # decoder layers only (never embeddings, lm_head)
            continue
        if experts and isinstance(mod, StackedExperts) and not isinstance(mod, LoraExperts):
            lora_experts(mod, rank=lcfg.rank, scale=scale, mode=lcfg.experts, dtype=adapter_dtype)
            done.append(path)
        elif type(mod) is nn.Linear and path.rpartition(".")[2] in names:
            lora_linear(mod, rank=lcfg.rank, scale=scale, dropout=lcfg.dropout, dtype=adapter_dtype, rows=rows)
            done.append(path)
    if not done:
        raise ConfigError(f"trainer.lora.targets={list(lcfg.targets)} matches no projection of model family "
                          f"{family or type(model).__name__}; choose groups (attention, mlp, experts...) it has")
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_name(name))
    if rows is not None:
        model.lora_rows = rows
    return done


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))


def init_tensors(model: nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, float32 tensor)`` of every adapter parameter (module docstring); names and FULL shapes
    are read now (call before sharding), values when iterated."""
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters() if is_lora_name(n)]

    def stream():
        for name, shape in shapes:
            if "lora_B" in name.split("."):
                yield name, torch.zeros(shape)
            else:
                bound = shape[-1] ** -0.5
                yield name, torch.empty(shape).uniform_(-bound, bound, generator=_generator(seed, name))
    return stream()


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _hf_path(path: str, probe: str, to_hf: Optional[Callable[[dict], dict]]) -> str:
    """The Hugging Face module path of our ``path``, through the family's name map on ``path + probe``."""
    if to_hf is None:
        return path
    hf = next(iter(to_hf({path + probe: None})))
    return hf[:-len(probe)] if hf.endswith(probe) else path


@torch.no_grad()
def gather_adapter(model: nn.Module, lcfg, *, to_hf: Optional[Callable[[dict], dict]] = None,
                   base_model: Optional[str] = None) -> Adapter:
    """The model's adapters, full tensors under HF target names (COLLECTIVE under a sharding plan:
    every rank calls it, in step; every rank gets the whole adapter, which is small)."""
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for path, mod in lora_modules(model):
        if isinstance(mod, LoraLinear):
            tensors[_hf_path(path, ".weight", to_hf)] = (_full(mod.lora_A).cpu(), _full(mod.lora_B).cpu())
            continue
        for stack in mod.stacks():
            a, b = mod.per_expert_factors(stack, _full(mod.lora_A[stack]).cpu(), _full(mod.lora_B[stack]).cpu())
            probe = f".{mod.first}.{'gate_proj' if stack == 'gate_up_proj' else stack}.weight"
            tensors[f"{_hf_path(path, probe, to_hf)}.{stack}"] = (a, b)
    return Adapter(tensors, rank=lcfg.rank, alpha=lcfg.alpha, dropout=lcfg.dropout, base_model=base_model)


def split_adapters(adapter: Adapter, names) -> dict[str, Adapter]:
    """A several-adapter model's gathered factors (``[N*r, in]`` / ``[out, N*r]``, rows.py) as one
    Adapter per name, each its own block (contiguous copies: each is written as its own PEFT file)."""
    r = adapter.rank
    return {name: dataclasses.replace(adapter, tensors={t: (a.narrow(0, i * r, r).contiguous(),
                                                           b.narrow(1, i * r, r).contiguous())
                                                       for t, (a, b) in adapter.tensors.items()})
            for i, name in enumerate(names)}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters the optimizer steps: all of them, or only the adapters of a LoRA model."""
    return [p for p in model.parameters() if p.requires_grad]
