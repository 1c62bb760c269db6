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
Then floating tensors are cast to the published (compute) dtype. Names and shapes come from the
model without communication (an absent expert takes the shape of a local sibling: every routed
expert of a block has the same shapes), so publishers lay out files and buckets up front.
"""
from __future__ import annotations

import re
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from workers.weights.stream import WeightStream, cast, meta_of
from workers.weights.checksums import nonfinite_names


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective over its mesh for a DTensor)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class RemoteExpert:
    """Where a routed expert tensor this rank does not hold lives: its EP rank and a local sibling."""

    def __init__(self, ep_rank: int, sibling: str):
        self.ep_rank, self.sibling = ep_rank, sibling


class ModelWeights(WeightStream):
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

    @staticmethod
    def _remote_experts(model: nn.Module, names: list[str]) -> dict[str, RemoteExpert]:
        """Routed-expert names held by another EP rank (mesh plan with ep > 1), else empty."""
        dims = getattr(model, "dims", None)
        if dims is None or dims.ep == 1 or not hasattr(model, "expert_modules"):
            return {}
        out: dict[str, RemoteExpert] = {}
        for prefix, local in model.expert_modules():
            ids = sorted(int(i) for i in local.keys())
            per_rank = len(ids)
            assert ids == list(range(dims.ep_rank * per_rank, (dims.ep_rank + 1) * per_rank)), (prefix, ids)
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
        if not self.remote:
            return _full(self.state[name].detach())
        owner = self.remote[name].ep_rank if name in self.remote else None
        if owner is None and not self._is_expert(name):
            return _full(self.state[name].detach())
        # a routed expert under ep > 1: gathered on its EP rank, broadcast over every ep group
        dims = self.model.dims
        if owner is None:
            owner, full = dims.ep_rank, _full(self.state[name].detach()).contiguous()
        else:
            sib = self.state[self.remote[name].sibling]
            full = torch.empty(tuple(sib.shape), dtype=sib.dtype, device=dims.device)
        dist.broadcast(full, group=self.model.mesh.get_group("ep"), group_src=owner)
        return full

    def _is_expert(self, name: str) -> bool:
        experts = self.__dict__.get("_experts")
        if experts is None:
            experts = self.__dict__["_experts"] = {n for n in self.state if any(
                n.startswith(p + ".") for p, _ in self.model.expert_modules())}
        return name in experts

    def local_nonfinite(self) -> list[str]:
        """Checked on this rank's shards (names are HF names)."""
        hf = {n: h for h, n in self.ours.items()}
        return sorted(hf[n] for n in nonfinite_names((n, _local(t.detach())) for n, t in self.state.items()))
