"""``trainer.compile``: torch.compile of each decoder layer's forward, the trainer's launch-bound fix.

Why per layer (as torchtitan does) and not the whole model: FSDP2 hooks fire around each layer's
``__call__`` (all-gather before, reshard after, reduce-scatter in the backward) and activation
checkpointing wraps each layer's ``forward``; compiling only the layer's own ``forward`` keeps
both outside the compiled region, so the plans (workers/trainer/fsdp.py, mesh_plan.py) and
checkpointing (workers/trainer/micro.py) are unchanged. One compiled graph serves every layer
of the same class and inputs (the layer index is not read on the training path), so a 60-layer
model compiles a handful of graphs, not 60.

Order: :func:`apply_compile` BEFORE ``apply_activation_checkpointing`` (which wraps whatever
``layer.forward`` is): the checkpoint then sits outside the compiled function and its recompute
runs the compiled code again. The H200 profile of 2026-12-03 (README "GPU") showed ~8.2k kernel
launches a step for a 1.5B MoE at 16k tokens: inductor fuses the elementwise tails (norms, rotary,
SwiGLU, routing softmax/top-k) into far fewer kernels.

Modes: ``none``; ``layers``; ``auto`` (the default) = ``layers`` on CUDA, ``none`` elsewhere (on
the CPU inductor would spend minutes compiling C++ for tiny models; tests compile with the
``aot_eager`` backend instead, which traces the same graphs without generating code). Graph
breaks left on purpose: the expert-parallel all-to-all's host-side split sizes
(workers/trainer/expert_parallel.py) and the CPU reference expert loop (``nonzero`` per expert).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

COMPILE_MODES = ("none", "layers", "auto")
"""``trainer.compile`` choices."""
BACKEND = "inductor"
"""The backend real runs use; tests pass ``backend="aot_eager"`` (same tracing, no code generation)."""


def resolve(mode: str, device: torch.device) -> str:
    """``none`` | ``layers``: what ``trainer.compile=mode`` means on ``device`` (``auto``: layers on CUDA)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"trainer.compile={mode!r}: choose one of {list(COMPILE_MODES)}")
    if mode == "auto":
        return "layers" if torch.device(device).type == "cuda" else "none"
    return mode


def apply_compile(layers: nn.ModuleList, mode: str, *, device: torch.device | str = "cpu",
                  backend: str = BACKEND) -> str:
    """Compile each layer's ``forward`` on the instance when ``mode`` resolves to ``layers``;
    returns the resolved mode. Call before activation checkpointing (module docstring)."""
    resolved = resolve(mode, torch.device(device))
    if resolved == "none":
        return resolved
    _raise_limits(len(layers))
    for layer in layers:
        if isinstance(layer.__dict__.get("forward"), functools.partial):
            raise ValueError("trainer.compile: apply it before activation checkpointing (the checkpoint must wrap "
                             "the compiled forward)")
        # The bound method of the class: parameters are graph inputs (dynamo inlines nn.Modules), so
        # the layers of one class share compiled code and differ only in the tensors they pass in.
        layer.forward = torch.compile(type(layer).forward.__get__(layer), backend=backend, dynamic=None)
        layer.__dict__["compiled_with"] = backend
    return resolved


def compiled(layer: nn.Module) -> bool:
    """True when :func:`apply_compile` compiled ``layer``'s forward."""
    return "compiled_with" in layer.__dict__


def _raise_limits(num_layers: int) -> None:
    """Dynamo keeps a bounded number of compiled variants per code object (8 by default) and falls
    back to eager silently past it. Layers of one class share the code object, and a family may
    need one variant per layer kind x (replay on / off) x (static / dynamic shapes): allow a few per
    layer so a 60-layer model never falls back."""
    cfg = torch._dynamo.config
    wanted = max(64, 4 * num_layers)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < wanted:
            setattr(cfg, name, wanted)
    if hasattr(cfg, "accumulated_recompile_limit") and cfg.accumulated_recompile_limit < 4 * wanted:
        cfg.accumulated_recompile_limit = 4 * wanted
