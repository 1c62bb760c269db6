"""One storage per dtype for a GPU engine's parameters, so a weight update patches one storage, not ~300.

Why: a sparse patch step (``weights.delta``) is staged per storage it lands in
(workers/weights/delta/apply.stage_chain: the union of touched positions, a gather of the values there,
the sum64 check, later one ``index_copy_``). With every parameter in its own storage that is ~10 small
device ops and their Python per parameter: SmolLM2-135M has 272, and staging a 2.7 % patch took
0.05-0.1 s on an H100 (issue 45's loop, ``engine_stage`` in the timeline), most of a weight apply that
sits on the loop's critical path (generation of batch N+2 waits for weights N). With the parameters
laid out as views of one buffer per (device, dtype), the same patch is one group: a handful of ops
whatever the model's depth.

What does not change: every parameter stays the same ``nn.Parameter`` (only its ``.data`` moves), with
its shape, dtype and contiguity; tied parameters stay one parameter; ``state_dict()`` gives the same
names and values (an expert's view of its stack is still a view). Each view starts on a 256-byte
boundary (the alignment kernels and cuBLAS assume for a fresh allocation). It must run before anything
keeps a parameter's old storage: fp8 quantization (its fp8 copies are separate buffers and are not
packed), CUDA graphs, LoRA adapters; workers/inference/embedded/startup.build_engine calls it right
after the model is built. Not for an fp8 engine (``inference.dtype=float8``): it re-quantizes a
projection when that weight's version counter moved (workers/inference/embedded/fp8.py), and a write
through the shared buffer moves the buffer's counter, not each parameter's. On a CPU engine (tests, the CPU path) the per-storage layout stays unless
``PACK_ON_CPU`` is set: there staging costs what the arithmetic costs, not launches.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("slurmrl.inference")

ALIGN_BYTES = 256
PACK_ON_CPU = False
"""Tests: pack a CPU model as a GPU engine's is packed."""


def _aligned(n: int, elem: int) -> int:
    step = max(1, ALIGN_BYTES // elem)
    return -(-n // step) * step


@torch.no_grad()
def pack_parameters(model: nn.Module) -> dict[str, int]:
    """Move every parameter into one buffer per (device, dtype); returns ``{dtype name: parameters packed}``
    (empty when nothing was packed: a CPU model without ``PACK_ON_CPU``, or one parameter per group)."""
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p in model.parameters():  # each parameter once, tied ones included
        if p.device.type == "cpu" and not PACK_ON_CPU:
            continue
        if p.is_contiguous() and p.numel() > 0:
            groups.setdefault((p.device, p.dtype), []).append(p)
    packed: dict[str, int] = {}
    for (device, dtype), params in groups.items():
        if len(params) < 2:
            continue
        elem = params[0].element_size()
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += _aligned(p.numel(), elem)
        arena = torch.empty(total, dtype=dtype, device=device)
        for p, off in zip(params, offsets):
            view = arena[off:off + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view  # the old storage goes when its last reference does: peak is one parameter over
        packed[str(dtype).replace("torch.", "")] = len(params)
    if packed:
        log.info("parameters packed into one storage per dtype (%s): a weight patch is staged and written as "
                 "one group", ", ".join(f"{k}: {v} tensors" for k, v in packed.items()))
    return packed


def storages(model: nn.Module) -> int:
    """How many distinct storages the parameters live in (1 per dtype once packed)."""
    return len({p.untyped_storage().data_ptr() for p in model.parameters()})
