"""``trainer.compile``: torch.compile of each decoder layer's forward, the trainer's launch-bound fix.

Why per layer (as torchtitan does) and not the whole model: FSDP2 hooks fire around each layer's
``__call__`` (all-gather before, reshard after, reduce-scatter in the backward); compiling only
the layer's ``forward`` (the instance attribute ``__call__`` runs) keeps them outside the compiled
region, so the plans (workers/trainer/parallel/fsdp.py, mesh.py) are unchanged and work with any
family. One compiled graph serves every layer
of the same class and inputs (the layer index is not read on the training path), so a 60-layer
model compiles a handful of graphs, not 60.

Order (as torchtitan): ``apply_activation_checkpointing`` first, then :func:`apply_compile`, which
compiles whatever ``layer.forward`` is, so the checkpoint is traced as a higher-order op and its
recompute is part of the compiled backward. (The other order, a compiled forward inside an eager
checkpoint, lets the recompute pick another compiled variant than the forward did -- one with
other saved tensors -- and the checkpoint raises; seen with micro-batches of several shapes.)
The H200 profile of 2026-12-03 (benchmarks/results/README.md, "GPU") showed ~8.2k kernel launches a step for a 1.5B MoE
at 16k tokens: inductor fuses the elementwise tails (norms, rotary, SwiGLU, routing softmax and
top-k) into far fewer kernels.

Modes: ``none``; ``layers``; ``auto`` (the default) = ``layers`` on CUDA, ``none`` elsewhere (on
the CPU inductor would spend minutes compiling C++ for tiny models; tests compile with the
``aot_eager`` backend instead, which traces the same graphs without generating code). Graph
breaks left on purpose: the expert-parallel all-to-all's host-side split sizes
(workers/trainer/parallel/expert.py) and the CPU reference expert loop (``nonzero`` per expert).
Packed rows do not break the graph: their document boundaries reach attention as tensors
(workers/models/blocks/varlen.py; tests/unit/models/test_packed_compile.py), except the per-document
paths of sparse attention (DSA) and Mamba.
"""
from __future__ import annotations

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
    returns the resolved mode. Call AFTER activation checkpointing (module docstring)."""
    resolved = resolve(mode, torch.device(device))
    if resolved == "none":
        return resolved
    _raise_limits(len(layers))
    for layer in layers:
        if compiled(layer):
            continue
        # What __call__ runs: the class's forward, or the activation-checkpointing wrapper around it
        # (then dynamo traces the checkpoint as a higher-order op: the recompute is part of the graph).
        inner = layer.__dict__.get("forward") or type(layer).forward.__get__(layer)
        layer.forward = CompiledForward(torch.compile(inner, backend=backend), inner, backend)
    return resolved


def compiled(layer: nn.Module) -> bool:
    """True when :func:`apply_compile` compiled ``layer``'s forward (also under a checkpoint wrapper)."""
    return isinstance(layer.__dict__.get("forward"), CompiledForward)


class CompiledForward:
    """A layer's compiled ``forward(x, ctx)`` with the token dimensions marked dynamic up front.

    Why: every micro-batch and step has other row counts and lengths. Left to dynamo's automatic
    dynamic shapes, the first shape compiles a static graph and the second a dynamic one; an
    activation-checkpointing recompute can then pick the other graph than its forward did, which
    saves another number of tensors (torch.utils.checkpoint raises; pytorch issue 166926), and
    inductor would compile twice. Marked before the first call, the rows and positions of ``x``
    and of the context's per-token tensors are symbolic from the start: one graph per layer kind
    (a 1-row or 1-column input, e.g. the padding micro-batch, still gets its own static one)."""

    def __init__(self, fn, inner, backend: str):
        self.fn, self.inner, self.backend = fn, inner, backend  # inner: the uncompiled forward

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        ctx = args[0] if args else None  # our layers: (x, ctx); transformers' (the generic path): (x, **kwargs)
        _mark(x, (0, 1))
        for name in ("position_ids", "valid", "forced", "forced_mask"):
            _mark(getattr(ctx, name, None), (0, 1))
        _mark(getattr(ctx, "mask", None), (0, -2, -1))
        _mark(kwargs.get("position_ids"), (0, 1))
        return self.fn(x, *args, **kwargs)


def _mark(t, dims: tuple[int, ...]) -> None:
    if isinstance(t, torch.Tensor):
        for d in dims:
            if t.dim() > abs(d) - (d < 0) and t.shape[d] > 1:
                torch._dynamo.maybe_mark_dynamic(t, d)


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
