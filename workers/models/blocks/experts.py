"""A MoE layer's routed experts as stacked parameters: one ``[E, out, in]`` tensor per projection.

Why stacked: the trainer's step was host-bound on the 1.5B MoE (H200 profile: ~830 parameters,
~770 of them per-expert matrices, each cast and copied by FSDP's gather, stacked again for the
grouped GEMM every forward and accumulated one by one in the backward). With one parameter per
projection per layer FSDP, the optimizer, gradient clipping and the grouped GEMM each see a few
large tensors. transformers 5.x keeps its experts the same way in memory.

Layout (transformers' too): gated (SwiGLU) experts hold ``gate_up_proj [E, 2I, H]`` (gate rows
then up rows) and ``down_proj [E, H, I]``; non-gated squared-ReLU experts (Nemotron-H) hold
``up_proj [E, I, H]`` and ``down_proj [E, H, I]``.

Names: checkpoints, published steps, SGLang and DCP checkpoints use the per-expert names
(``experts.7.gate_proj.weight``). ``state_dict()`` gives exactly those, as VIEWS of the stacks
(a state-dict hook), and ``load_state_dict`` takes them (a load pre-hook stacks them), so loaders,
publishers, the engine's weight updates and digests keep working on HF names; ``named_parameters()``
(what FSDP, the optimizer and gradient clipping see) gives the stacks. Under expert parallelism a
module holds experts ``[first, first + E_local)`` (:meth:`narrow_`) and names them by global id.
The sharding plans shard stacks over a non-expert dim (:data:`SHARD_DIM`), so every per-expert view
is a local view of this rank's shard (DTensor slicing of unsharded dims; no communication).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.blocks import kernels

SHARD_DIM = 2
"""The dim of a ``[E, out, in]`` stack that FSDP shards (the input width): selecting one expert
(dim 0) and its gate or up rows (dim 1) then stays inside every rank's shard."""

_STACKED_NAMES = [False]


@contextlib.contextmanager
def stacked_state_names():
    """Inside: ``state_dict()`` gives the stacks under their parameter names (what torch's
    distributed-checkpoint helpers map through ``named_parameters``; workers/trainer/dcp_state.py)."""
    _STACKED_NAMES[0] = True
    try:
        yield
    finally:
        _STACKED_NAMES[0] = False


class StackedExperts(nn.Module):
    """``E`` experts of width ``intermediate_size`` on rows of width ``hidden_size`` (module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, gated: bool = True):
        super().__init__()
        self.gated, self.first = gated, 0
        self.intermediate_size = intermediate_size
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.reset_parameters()
        self.register_state_dict_post_hook(_per_expert_state)
        self.register_load_state_dict_pre_hook(_stack_loaded)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default per expert (uniform within 1/sqrt(fan_in)): a block built on its own
        is usable; models overwrite it (``CausalLM.init_weights``, checkpoints)."""
        for name in self.stacks():
            w = getattr(self, name)
            if not w.is_meta:
                bound = w.shape[-1] ** -0.5
                w.uniform_(-bound, bound)

    @property
    def num_local(self) -> int:
        return self.down_proj.shape[0]

    def stacks(self) -> tuple[str, ...]:
        return ("gate_up_proj", "down_proj") if self.gated else ("up_proj", "down_proj")

    def per_expert_names(self) -> tuple[str, ...]:
        """Checkpoint names of one expert's tensors, relative to ``experts.<id>.``."""
        return (("gate_proj.weight", "up_proj.weight", "down_proj.weight") if self.gated
                else ("up_proj.weight", "down_proj.weight"))

    def split(self, stacks: dict[str, torch.Tensor], first: Optional[int] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(<global id>.<name>, view)`` of every expert in ``stacks`` {stack name: tensor shaped like
        it} (parameters, their gradients, optimizer moments; DTensors sharded on :data:`SHARD_DIM`;
        or all experts gathered, with ``first`` 0), expert by expert in :meth:`per_expert_names` order."""
        per = [list(self.split_stack(s, stacks[s], first)) for s in self.stacks()]
        n = len(stacks["down_proj"])
        for e in range(n):
            for views in per:
                k = len(views) // n
                yield from views[e * k:(e + 1) * k]

    def split_stack(self, stack: str, t: torch.Tensor, first: Optional[int] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`split` of one stack (an optimizer moment, a gradient)."""
        inter = self.intermediate_size
        first = self.first if first is None else first
        for e in range(len(t)):
            if stack == "gate_up_proj":
                yield f"{first + e}.gate_proj.weight", t[e][:inter]
                yield f"{first + e}.up_proj.weight", t[e][inter:]
            else:
                yield f"{first + e}.{stack}.weight", t[e]

    def stack_names(self, stack: str, first: Optional[int] = None) -> list[str]:
        """The per-expert names :meth:`split_stack` gives for ``stack``, in order (no tensor needed)."""
        return [n for n, _ in self.split_stack(stack, _Rows(self.num_local), first)]

    def expert_shape(self, stack: str) -> tuple[int, ...]:
        """Full shape of one expert's tensor cut from ``stack`` (a gate or up half of ``gate_up_proj``)."""
        shape = tuple(getattr(self, stack).shape[1:])  # a DTensor's shape is the full one
        return (shape[0] // 2, *shape[1:]) if stack == "gate_up_proj" else shape

    @torch.no_grad()
    def narrow_(self, first: int, count: int) -> None:
        """Keep experts ``[first, first + count)`` only (expert parallelism), still named by global id."""
        for name in self.stacks():
            old = getattr(self, name)
            setattr(self, name, nn.Parameter(old[first:first + count].clone(), requires_grad=old.requires_grad))
        self.first = first

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on rows ``x`` [n, H] (the reference loops)."""
        if self.gated:
            g, u = self.linear("gate_up_proj", e, x).chunk(2, dim=-1)
            h = F.silu(g) * u
        else:
            h = F.relu(self.linear("up_proj", e, x)).square()
        return self.linear("down_proj", e, h)

    def linear(self, stack: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``e``'s projection ``stack`` on rows ``x`` (a LoRA subclass adds its term:
        workers/models/lora/experts.py)."""
        return F.linear(x, getattr(self, stack)[e])

    def project(self, stack: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Projection ``stack`` of every local expert on its rows of ``x`` (grouped by expert, group
        ends ``offs``): ONE grouped GEMM (a LoRA subclass adds its own grouped GEMMs)."""
        return F.grouped_mm(x, getattr(self, stack).transpose(1, 2), offs=offs)

    def grouped_ok(self, rows: torch.Tensor) -> bool:
        """Grouped GEMM needs bf16 operands and widths in multiples of 8 (16-byte strides)."""
        return (hasattr(F, "grouped_mm") and rows.dtype == torch.bfloat16 and self.down_proj.dtype == torch.bfloat16
                and not any(d % 8 for name in self.stacks() for d in getattr(self, name).shape[1:]))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, padded: bool = False,
                row_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Local expert ``i`` on the ``counts[i]`` consecutive rows of ``rows`` (sorted by expert): ONE
        grouped GEMM per projection on the fast path (device-side offsets, no host sync), else a loop.
        ``padded``: rows past ``counts.sum()`` are fixed-capacity padding (workers/trainer/parallel/expert_capacity.py);
        their outputs are zero. ``row_scale`` [rows] (the gate weights): each output row scaled by it,
        applied to the activation before the down projection (linear, so the same product): the
        scaling fuses into the activation's kernel and its backward, over the intermediate width,
        instead of a pass of its own over ``[rows, hidden]`` output rows. FSDP hooks this call (its
        forward gathers the stacks)."""
        if kernels.fast(rows) and self.grouped_ok(rows):
            offs = counts.cumsum(0).to(torch.int32)
            if self.gated:
                g, u = self.project("gate_up_proj", rows, offs).chunk(2, dim=-1)
                h = F.silu(g) * u
            else:
                h = F.relu(self.project("up_proj", rows, offs)).square()
            if row_scale is not None:
                h = h * row_scale[:, None].to(h.dtype)
            out = self.project("down_proj", h, offs)
            if padded:  # grouped_mm leaves rows past the last offset unwritten
                real = torch.arange(rows.shape[0], device=rows.device) < counts.sum()
                out = torch.where(real[:, None], out, out.new_zeros(()))
            return out
        sizes = counts.tolist()  # the CPU loop (tests, the local loop) needs the sizes on the host
        if padded:
            sizes.append(rows.shape[0] - sum(sizes))
        segs = rows.split(sizes)
        outs = [self.expert(e, seg) for e, seg in enumerate(segs[:self.num_local])]
        if row_scale is not None:
            scales = row_scale.split(sizes)
            outs = [y * s[:, None].to(y.dtype) for y, s in zip(outs, scales)]
        if padded:
            outs.append(torch.zeros_like(segs[-1]))
        return torch.cat(outs) if outs else rows


def _per_expert_state(module: StackedExperts, state: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: the stacks become per-expert views under checkpoint names."""
    if _STACKED_NAMES[0]:
        return
    stacks = {n: state.pop(prefix + n) for n in module.stacks() if prefix + n in state}
    if len(stacks) != len(module.stacks()):
        return
    for name, view in module.split(stacks):
        state[prefix + name] = view


def _stack_loaded(module: StackedExperts, state: dict, prefix: str, local_metadata, strict, missing, unexpected,
                  errors) -> None:
    """load_state_dict pre-hook: per-expert tensors (checkpoint names) stacked into the module's names.
    Left alone when any expert tensor is missing: the load then reports the stack as missing and
    the per-expert keys as unexpected, by name. A mis-shaped one is reported as torch reports a
    size mismatch, by its checkpoint name."""
    want = {prefix + n: tuple(v.shape) for n, v in module.split({s: getattr(module, s) for s in module.stacks()})}
    if not all(n in state for n in want):
        return
    bad = [f"size mismatch for {n}: copying a param with shape {tuple(state[n].shape)} from checkpoint, the shape "
           f"in current model is {shape}." for n, shape in want.items() if tuple(state[n].shape) != shape]
    if bad:
        errors.extend(bad)
        for n in want:
            state.pop(n)
        return
    per = len(module.per_expert_names())
    parts = [state.pop(n) for n in want]
    if module.gated:
        state[prefix + "gate_up_proj"] = torch.stack([torch.cat(parts[i:i + 2]) for i in range(0, len(parts), per)])
        state[prefix + "down_proj"] = torch.stack(parts[2::per])
    else:
        state[prefix + "up_proj"] = torch.stack(parts[0::per])
        state[prefix + "down_proj"] = torch.stack(parts[1::per])


class _Rows:
    """Stands in for a stack when only :meth:`StackedExperts.split`'s names are wanted."""

    def __init__(self, n: int = 0):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, _):
        return self


def checkpoint_named(model: nn.Module, tensors: dict[str, torch.Tensor], *, first: Optional[int] = None
                     ) -> dict[str, torch.Tensor]:
    """``tensors`` {parameter name: tensor shaped like it} (gradients, optimizer moments) renamed to
    checkpoint names, in order: each expert stack split into per-expert views (global ids; ``first``
    0 for stacks gathered over every EP rank), other entries unchanged."""
    stacks = {}
    for prefix, mod in model.named_modules():
        if isinstance(mod, StackedExperts):
            pre = prefix + "." if prefix else ""
            stacks.update({pre + s: (pre, mod, s) for s in mod.stacks()})
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name not in stacks:
            out[name] = t
            continue
        pre, mod, stack = stacks[name]
        out.update((pre + n, v) for n, v in mod.split_stack(stack, t, first))
    return out


def checkpoint_order(model: nn.Module, state: dict) -> list[str]:
    """The names ``state_dict()`` gives, from ``state`` taken under :func:`stacked_state_names`: each
    module's stacks replaced, where the first of them stood, by its per-expert names (nothing sliced)."""
    owner = {}
    for prefix, mod in model.named_modules():
        if isinstance(mod, StackedExperts):
            pre = prefix + "." if prefix else ""
            owner.update({pre + s: (pre, mod) for s in mod.stacks()})
    out, done = [], set()
    for name in state:
        if name not in owner:
            out.append(name)
        elif owner[name][0] not in done:
            pre, mod = owner[name]
            done.add(pre)
            out.extend(pre + n for n, _ in mod.split({s: _Rows(mod.num_local) for s in mod.stacks()}))
    return out


def checkpoint_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters' gradients (zeros where one has none) under checkpoint names."""
    return checkpoint_named(model, {n: p.grad if p.grad is not None else torch.zeros_like(p)
                                    for n, p in model.named_parameters()})


def shard_placement(module: nn.Module):
    """``fully_shard``'s ``shard_placement_fn`` for ``module``: expert stacks on :data:`SHARD_DIM`,
    every other parameter FSDP's default (dim 0)."""
    from torch.distributed.tensor import Shard

    stacks = {id(p) for m in module.modules() if isinstance(m, StackedExperts) for p in m.parameters(recurse=False)}
    return lambda p: Shard(SHARD_DIM) if id(p) in stacks else None
