"""The trainer's weights as a :class:`~workers.weights.stream.WeightStream`: what the loop publishes.

Why: publishing used to call ``full_state_dict(to_rank=None)``, so every rank held the whole model
in the compute dtype next to its shards (item 4 of issue 19). :class:`ModelWeights` gathers one
tensor at a time, when the publisher reaches it, and the publisher drops it once written or sent.

Per tensor, under each plan (every rank asks for the same names in the same order):
  plain module      the tensor itself (nothing to gather);
  FSDP plan         ``DTensor.full_tensor()``: one all-gather over the data-parallel ranks;
  mesh plan         dense / TP DTensors the same (over their mesh); a routed expert lives only on
                    its EP rank r (experts ``[r * E/ep, (r+1) * E/ep)``, expert_parallel.py): the
                    ranks of r's expert-data-parallel group gather it (``full_tensor`` over edp),
                    then each ep group broadcasts it from its member on EP rank r.
Routed experts are stacked parameters (workers/models/blocks/experts.py): a block's stacks are
gathered once each (one all-gather per projection, not one per expert tensor) and its experts
served as views of them. Then floating tensors are cast to the published (compute) dtype. Names and shapes come from the
model without communication (an absent expert takes the shape of a local sibling: every routed
expert of a block has the same shapes), so publishers lay out files and buckets up front.
"""
from __future__ import annotations

import re
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from workers.models.blocks.experts import StackedExperts
from workers.weights.stream import DictStream, cast, full_tensor, meta_of


class RemoteExpert:
    """Where a routed expert tensor this rank does not hold lives: its EP rank and a local sibling."""

    def __init__(self, ep_rank: int, sibling: str):
        self.ep_rank, self.sibling = ep_rank, sibling


class ModelWeights(DictStream):
    """Full HF-named tensors of ``model`` (a plan's sharded model, or a plain module), in ``dtype``.

    ``to_hf`` is the family's name map (``ModelSpec.to_hf``, a dict -> dict renaming keys); it is
    applied to the names only, once, so it must map each name on its own (every family's does)."""

    def __init__(self, model: nn.Module, *, dtype: Optional[torch.dtype] = None,
                 to_hf: Optional[Callable[[dict], dict]] = None):
        self.model, self.dtype = model, dtype
        self.state = model.state_dict()  # references to this rank's shards: nothing is copied
        names = list(getattr(model, "full_state_names", None) or self.state)
        self.remote = self._remote_experts(model, names)
        self.ours = to_hf({n: n for n in names}) if to_hf is not None else {n: n for n in names}  # HF -> ours
        self.metas = []
        for hf, n in self.ours.items():
            t = self.state[self.remote[n].sibling if n in self.remote else n]
            self.metas.append(meta_of(hf, t.shape, t.dtype, dtype))  # DTensor.shape is the full shape
        self.experts = {n for n in self.state if self.remote and ".experts." in n and any(
            n.startswith(p + ".") for p, _ in model.expert_modules())}
        self.in_stack = self._stack_slots(model)
        self._stack: Optional[tuple[str, dict[str, list[torch.Tensor]]]] = None  # the last block's stacks

    @staticmethod
    def _stack_slots(model: nn.Module) -> dict[str, tuple[StackedExperts, str, str, int]]:
        """{per-expert name this rank holds: (module, its prefix, stack name, index in split_stack)}:
        a sharded stack is gathered ONCE (one all-gather per projection and layer, not one per
        expert tensor: 3E times fewer collectives) and its experts served as views of it."""
        out = {}
        for prefix, mod in model.named_modules():
            if isinstance(mod, StackedExperts) and isinstance(mod.down_proj, DTensor):
                pre = prefix + "." if prefix else ""
                for s in mod.stacks():
                    out.update((pre + n, (mod, pre, s, k)) for k, n in enumerate(mod.stack_names(s)))
        return out

    def _from_stack(self, name: str) -> torch.Tensor:
        """Expert ``name`` as a view of its full stack, gathered over the stack's mesh on a miss. The
        stacks of the block asked last are kept (checkpoint order interleaves a block's stacks
        expert by expert); every rank of that mesh asks the same names in order, so misses pair up."""
        mod, pre, stack, k = self.in_stack[name]
        if self._stack is None or self._stack[0] != pre:
            self._stack = (pre, {})  # drop the previous block's stacks before gathering the next
        views = self._stack[1]
        if stack not in views:
            views[stack] = [v for _, v in mod.split_stack(stack, full_tensor(getattr(mod, stack).detach()))]
        return views[stack][k]

    @staticmethod
    def _remote_experts(model: nn.Module, names: list[str]) -> dict[str, RemoteExpert]:
        """Routed-expert names held by another EP rank (mesh plan with ep > 1), else empty."""
        dims = getattr(model, "dims", None)
        if dims is None or dims.ep == 1 or not hasattr(model, "expert_modules"):
            return {}
        out: dict[str, RemoteExpert] = {}
        for prefix, local in model.expert_modules():
            ids = list(range(local.first, local.first + local.num_local))
            per_rank = len(ids)
            assert local.first == dims.ep_rank * per_rank, (prefix, local.first)
            pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.(.+)$")
            for n in names:
                m = pattern.match(n)
                if m and int(m.group(1)) not in ids:
                    out[n] = RemoteExpert(int(m.group(1)) // per_rank, f"{prefix}.{ids[0]}.{m.group(2)}")
        return out

    @torch.no_grad()
    def items(self, names: Optional[Sequence[str]] = None) -> Iterator[tuple[str, torch.Tensor]]:
        for hf in self.names if names is None else names:
            yield hf, cast(self._gather(self.ours[hf]), self.dtype)

    def _gather(self, name: str) -> torch.Tensor:
        if name not in self.remote and name not in self.experts:
            return self._from_stack(name) if name in self.in_stack else full_tensor(self.state[name].detach())
        # a routed expert under ep > 1: gathered on its EP rank, broadcast over every ep group
        dims = self.model.dims
        if name in self.remote:
            owner, sib = self.remote[name].ep_rank, self.state[self.remote[name].sibling]
            full = torch.empty(tuple(sib.shape), dtype=sib.dtype, device=dims.device)
        else:
            owner = dims.ep_rank
            full = (self._from_stack(name) if name in self.in_stack else full_tensor(self.state[name].detach())).contiguous()
        dist.broadcast(full, group=self.model.mesh.get_group("ep"), group_src=owner)
        return full

    def local_nonfinite(self) -> list[str]:
        """Checked on this rank's shards (names are HF names)."""
        hf = {n: h for h, n in self.ours.items()}
        return sorted(hf[n] for n in super().local_nonfinite())
