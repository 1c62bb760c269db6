"""The trainer's weights as a :class:`~workers.weights.stream.WeightStream`: what the loop publishes.

Why: a full state dict on every rank (``full_state_dict(to_rank=None)``) would hold the whole
model in the compute dtype next to its shards. :class:`ModelWeights` gathers one tensor at a time, when the publisher reaches it, and the publisher drops it once written or sent.

Per tensor, under each plan (every rank asks for the same names in the same order):
  plain module      the tensor itself (nothing to gather);
  FSDP plan         ``DTensor.full_tensor()``: one all-gather over the data-parallel ranks;
  mesh plan         dense / TP DTensors the same (over their mesh).
Routed experts are stacked parameters (workers/models/blocks/experts.py), and a sharded block's
experts are served as views of its FULL stacks, fetched once per projection (not once per expert
tensor: 3E times fewer collectives): gathered with ``full_tensor`` over the stack's mesh; under
ep > 1 the experts of EP rank r (``[r * E/ep, (r+1) * E/ep)``, parallel/expert.py) are gathered by
r's expert-data-parallel group, then each ep group broadcasts the stack from its member on EP rank
r. Only the stacks of one (block, EP rank) are held at a time (the checkpoint order walks a block's
experts by id). Then floating tensors are cast to the published (compute) dtype. Names and shapes
come from the model without communication (an absent expert takes the shape of a local sibling:
every routed expert of a block has the same shapes), so publishers lay out files and buckets up front.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from workers.models.blocks.experts import StackedExperts, checkpoint_named, checkpoint_order, stacked_state_names
from workers.models.lora.inject import is_lora_name
from workers.weights.checksums import nonfinite_names
from workers.common.dtensor import full_tensor, local_part
from workers.weights.stream import DictStream, ExpertSlot, cast, meta_of


class ModelWeights(DictStream):
    """Full HF-named tensors of ``model`` (a plan's sharded model, or a plain module), in ``dtype``.

    ``to_hf`` is the family's name map (``ModelSpec.to_hf``, a dict -> dict renaming keys); it is
    applied to the names only, once, so it must map each name on its own (every family's does)."""

    def __init__(self, model: nn.Module, *, dtype: Optional[torch.dtype] = None,
                 to_hf: Optional[Callable[[dict], dict]] = None):
        self.model, self.dtype = model, dtype
        with stacked_state_names():  # references to this rank's shards, expert stacks whole: nothing copied
            self.state = model.state_dict()
        self.slots = self._stack_slots(model)
        names = list(getattr(model, "full_state_names", None) or checkpoint_order(model, self.state))
        names = [n for n in names if not is_lora_name(n)]  # LoRA: the base alone (adapters: lora_publish.py)
        self.ours = to_hf({n: n for n in names}) if to_hf is not None else {n: n for n in names}  # HF -> ours
        self.metas = []
        for hf, n in self.ours.items():
            if n in self.slots:  # an expert (maybe another EP rank's): shaped like its stack's rows
                mod, _, stack, _, _ = self.slots[n]
                param = getattr(mod, stack)
                self.metas.append(meta_of(hf, mod.expert_shape(stack), param.dtype, dtype))
            else:
                t = self.state[n]
                self.metas.append(meta_of(hf, t.shape, t.dtype, dtype))  # DTensor.shape is the full shape
        self._held: Optional[tuple[tuple[str, int], dict[str, list[torch.Tensor]]]] = None  # (block, EP rank) stacks

    @staticmethod
    def _stack_slots(model: nn.Module) -> dict[str, ExpertSlot]:
        """{per-expert name: its slot} of every block's experts, those of other EP ranks included
        (names only: nothing is sliced)."""
        dims = getattr(model, "dims", None)
        ep = dims.ep if dims is not None else 1
        out = {}
        for prefix, mod in model.named_modules():
            if isinstance(mod, StackedExperts):
                pre = prefix + "." if prefix else ""
                per = mod.num_local
                for r in range(ep):
                    for s in mod.stacks():
                        out.update((pre + n, ExpertSlot(mod, pre, s, r, k))
                                   for k, n in enumerate(mod.stack_names(s, r * per)))
        return out

    def _from_stack(self, name: str) -> torch.Tensor:
        """Expert ``name`` as a view of its full stack, fetched on a miss (module docstring). Every rank
        asks the same names in the same order, so the gathers and broadcasts pair up."""
        mod, pre, stack, owner, k = self.slots[name]
        if self._held is None or self._held[0] != (pre, owner):
            self._held = ((pre, owner), {})  # drop the previous stacks before fetching the next
        views = self._held[1]
        if stack not in views:
            param = getattr(mod, stack)
            dims = getattr(self.model, "dims", None)
            if dims is None or dims.ep == 1:
                full = full_tensor(param.detach())
            else:
                full = (full_tensor(param.detach()).contiguous() if owner == dims.ep_rank
                        else torch.empty(tuple(param.shape), dtype=param.dtype, device=dims.device))
                dist.broadcast(full, group=self.model.mesh.get_group("ep"), group_src=owner)
            views[stack] = [v for _, v in mod.split_stack(stack, full, owner * mod.num_local)]
        return views[stack][k]

    @torch.no_grad()
    def items(self, names: Optional[Sequence[str]] = None) -> Iterator[tuple[str, torch.Tensor]]:
        for hf in self.names if names is None else names:
            yield hf, cast(self._gather(self.ours[hf]), self.dtype)

    def _gather(self, name: str) -> torch.Tensor:
        return self._from_stack(name) if name in self.slots else full_tensor(self.state[name].detach())

    def local_nonfinite(self) -> list[str]:
        """Checked on this rank's shards, one check per expert stack (names are HF names; a bad stack
        is resolved to its bad experts)."""
        bad = set(super().local_nonfinite())
        experts = {n for n, (_, pre, s, owner, _) in self.slots.items() if pre + s in bad}
        if experts:
            bad -= {pre + s for _, pre, s, _, _ in self.slots.values()}
            views = checkpoint_named(self.model, {pre + s: local_part(getattr(mod, s).detach())
                                                  for mod, pre, s, _, _ in self.slots.values() if pre + s in self.state})
            bad |= set(nonfinite_names((n, v) for n, v in views.items() if n in experts))
        hf = {n: h for h, n in self.ours.items()}
        return sorted(hf[n] for n in bad)
