"""An EP rank's parameters as SGLang lays them out, for the fake SGLang server's rank processes.

Why: with expert parallelism an SGLang rank holds only its routed experts, stacked in a FusedMoE's
``w13_weight [E_local, 2I, H]`` (gate rows, then up) and ``w2_weight [E_local, H, I]``, and finds an
expert's slot with ``_map_global_expert_id_to_local_expert_id`` (-1: not here). The custom weight loader
(workers/weights/sglang/patch_loader.Targets) maps HF names onto exactly that, so a fake server
whose ranks hold the dense HF state could not show that a rank pulls only its own experts' patches.

:func:`moe_rank` builds one rank: the stacks, the rank's HF-named state (non-expert tensors as copies,
each held expert's gate/up/down as VIEWS of the stacks: loading from disk and reading the state back go
through the stacks) and the module tree the loader is called with.
"""
from __future__ import annotations

import re
from typing import Sequence

import torch
from torch import nn

EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class FakeFusedMoE(nn.Module):
    """SGLang's FusedMoE parameters and expert map (no kernels: the fake never computes with them)."""

    def __init__(self, experts: Sequence[int], inter: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.experts = list(experts)
        self.moe_tp_size = 1
        self.w13_weight = nn.Parameter(torch.zeros(len(experts), 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(len(experts), hidden, inter, dtype=dtype), requires_grad=False)

    def _map_global_expert_id_to_local_expert_id(self, expert_id: int) -> int:
        return self.experts.index(expert_id) if expert_id in self.experts else -1


def _module_at(root: nn.Module, path: str) -> nn.Module:
    mod = root
    for p in path.split("."):
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    return mod


def moe_rank(hf: dict[str, torch.Tensor], experts: Sequence[int]) -> tuple[dict[str, torch.Tensor], nn.Module]:
    """(this rank's HF-named state, its model) holding the non-expert tensors and ``experts`` of every MoE layer."""
    root = nn.Module()
    state: dict[str, torch.Tensor] = {}
    moes: dict[str, FakeFusedMoE] = {}
    for name in sorted(hf):
        m = EXPERT.match(name)
        if m is None:
            state[name] = hf[name].clone()
            *path, leaf = name.split(".")
            _module_at(root, ".".join(path)).register_parameter(leaf, nn.Parameter(state[name], requires_grad=False))
            continue
        if int(m["expert"]) not in experts:
            continue
        module = m["module"]
        if module not in moes:
            inter, hidden = hf[f"{module}.{experts[0]}.gate_proj.weight"].shape
            parent, _, leaf = module.rpartition(".")
            moes[module] = FakeFusedMoE(experts, inter, hidden, hf[name].dtype)
            _module_at(root, parent).add_module(leaf, moes[module])
        moe, local = moes[module], experts.index(int(m["expert"]))
        inter = moe.w2_weight.shape[2]
        view = {"gate_proj": moe.w13_weight.data[local, :inter], "up_proj": moe.w13_weight.data[local, inter:],
                "down_proj": moe.w2_weight.data[local]}[m["proj"]]
        view.copy_(hf[name])
        state[name] = view
    return state, root
