"""GPT-OSS's Mixture-of-Experts MLP: a biased softmax router and experts with biases and a clamped SwiGLU.

Routing (transformers' GptOssTopKRouter): ``logits = x W^T + b``, the top_k experts by logit, gate
weights the softmax over those k logits. That is :class:`MoeBlock`'s routing with
``norm_topk_prob`` on (the renormalised top-k of a softmax over all experts equals the softmax over
the top-k logits), so the router, the balance loss, Router Replay (``forced`` experts keep this
router's weights, so its gradient flows) and the three expert paths (reference loop, grouped GEMM,
the capture-safe dense sum) are MoeBlock's; only the modules differ.

Experts (:class:`ClampedSwiGLUExperts`) keep transformers' in-memory and checkpoint layout, so the
parameter names ARE the checkpoint's and no per-expert split exists (``to_hf`` / ``from_hf`` are the
identity, and a published step is what ``GptOssForCausalLM.from_pretrained`` loads)::

    experts.gate_up_proj       [E, H, 2I]  x @ W: gate and up INTERLEAVED on the last dim (gate 0::2, up 1::2)
    experts.gate_up_proj_bias  [E, 2I]
    experts.down_proj          [E, I, H]
    experts.down_proj_bias     [E, H]

and compute ``h = x @ W_gu[e] + b_gu[e]``, ``gate = min(h[::2], limit)``, ``up = clamp(h[1::2],
-limit, limit)``, ``y = ((up + 1) * gate * sigmoid(alpha * gate)) @ W_d[e] + b_d[e]`` (alpha 1.702,
limit 7.0 in the released models). The layout differs from :class:`StackedExperts` (``[E, out, in]``,
gate rows then up rows, no biases), whose per-expert names the trainer's state paths split.

Expert parallelism (the mesh plan, ep > 1): the checkpoint names are the WHOLE stacks, so a rank
cannot hold "its" experts under names of their own (as StackedExperts' per-expert names do).
Instead :meth:`~ClampedSwiGLUExperts.distribute_over_ep` makes every stack a DTensor sharded on
dim 0 (the expert) over the ``ep`` mesh: each EP rank holds experts ``[r * E/ep, (r+1) * E/ep)``
of every stack and bias, yet the parameter's GLOBAL shape is the full ``[E, ...]``. FSDP2 shards it
further over the expert-data-parallel mesh (its FSDP + EP path), so every state path reads the full
logical stacks with no expert-specific code: DCP saves ``experts.gate_up_proj`` ``[E, H, 2I]`` by
offsets (an ep = 2 checkpoint resumes at ep = 1 or on the FSDP plan), ``full_tensor`` gathers the
whole stack for the published step (transformers' layout), ``materialize`` cuts this rank's experts
from a full checkpoint tensor, and the global gradient norm counts each element once. The compute
reads the local experts (:meth:`~ClampedSwiGLUExperts.local`): the token exchange is
workers/trainer/parallel/expert.py's, as for every MoE family. Under tp > 1 alone the experts are
replicated over tp (the tokens split) through :meth:`~ClampedSwiGLUExperts.narrow_`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from workers.models.blocks import kernels
from workers.models.blocks.moe_softmax import MoeBlock


class ClampedSwiGLUExperts(nn.Module):
    """``E`` GPT-OSS experts (module docstring); the interface MoeBlock's expert paths call."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit, self.intermediate_size = alpha, limit, intermediate_size
        self.first, self.local_count = 0, num_experts  # global id of local expert 0, how many (narrow_, ep)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))
        with torch.no_grad():
            for w in (self.gate_up_proj, self.down_proj):
                if not w.is_meta:
                    w.normal_(0.0, 0.02)

    @property
    def num_local(self) -> int:
        """This EP rank's experts (not the FSDP shard's rows a sharded parameter shows between forwards)."""
        return self.local_count

    def local(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s local experts: the tensor itself, or this EP rank's rows of a stack
        distributed over ``ep`` (:meth:`distribute_over_ep`; differentiable, its gradient a DTensor)."""
        t = getattr(self, name)
        return t.to_local() if isinstance(t, DTensor) else t  # isinstance: what dynamo traces (not hasattr)

    @torch.no_grad()
    def distribute_over_ep(self, ep_mesh) -> None:
        """Expert parallelism (module docstring): every stack and bias a DTensor sharded on dim 0 over
        ``ep_mesh``, each rank keeping its own experts of the identical full copy (no communication)."""
        from torch.distributed.tensor import Shard, distribute_tensor

        for name, old in list(self.named_parameters(recurse=False)):
            t = distribute_tensor(old.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(self, name, nn.Parameter(t, requires_grad=old.requires_grad))
        self.local_count = self.down_proj.shape[0] // ep_mesh.size()
        self.first = ep_mesh.get_local_rank() * self.local_count

    @torch.no_grad()
    def narrow_(self, first: int, count: int) -> None:
        """Keep experts ``[first, first + count)`` only (the trainer's expert-parallel split:
        workers/trainer/parallel/expert.py ``shard_experts``; ``count`` = all of them under tp alone)."""
        for name, old in list(self.named_parameters(recurse=False)):
            setattr(self, name, nn.Parameter(old[first:first + count].clone(), requires_grad=old.requires_grad))
        self.first, self.local_count = first, count

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of interleaved gate/up columns ``[n, 2I] -> [n, I]``."""
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on rows ``x`` [n, H] (the reference loop and the dense sum)."""
        gu, gu_bias, down, down_bias = self.weights()
        h = self.activation(x @ gu[e] + gu_bias[e])
        return h @ down[e] + down_bias[e]

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias) of the local experts."""
        return tuple(self.local(n) for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))

    def grouped_ok(self, rows: torch.Tensor) -> bool:
        """Grouped GEMM needs bf16 operands and widths in multiples of 8 (16-byte strides)."""
        return (hasattr(F, "grouped_mm") and rows.dtype == torch.bfloat16 and self.down_proj.dtype == torch.bfloat16
                and not any(d % 8 for d in (*self.gate_up_proj.shape[1:], *self.down_proj.shape[1:])))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, padded: bool = False,
                row_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Expert ``i`` on the ``counts[i]`` consecutive rows of ``rows`` (sorted by expert), each output
        row times ``row_scale`` (the gate weight; applied after the down bias, which it scales too).
        Fast path: one grouped GEMM per projection, each row's biases gathered by its expert id
        (found by ``bucketize`` on the offsets: no host sync)."""
        if kernels.fast(rows) and self.grouped_ok(rows):
            gu, gu_bias, down, down_bias = self.weights()
            offs, expert_of = self._offsets(rows, counts)
            offs = offs.to(torch.int32)
            h = F.grouped_mm(rows, gu, offs=offs) + gu_bias.index_select(0, expert_of)
            out = F.grouped_mm(self.activation(h), down, offs=offs) + down_bias.index_select(0, expert_of)
            return self._finish(out, counts, padded, row_scale)
        if rows.is_cuda:  # no host sync (CUDA-graph capture refuses one): each row gathers its expert's matrices
            return self.gathered(rows, counts, padded, row_scale)
        sizes = counts.tolist()
        if padded:
            sizes.append(rows.shape[0] - sum(sizes))
        segs = rows.split(sizes)
        outs = [self.expert(e, seg) for e, seg in enumerate(segs[:self.num_local])]
        if row_scale is not None:
            outs = [y * s[:, None].to(y.dtype) for y, s in zip(outs, row_scale.split(sizes))]
        if padded:
            outs.append(torch.zeros_like(segs[-1]))
        return torch.cat(outs) if outs else rows

    def gathered(self, rows: torch.Tensor, counts: torch.Tensor, padded: bool,
                 row_scale: Optional[torch.Tensor]) -> torch.Tensor:
        """The experts with no host sync and no grouped GEMM (float32 on CUDA, odd widths): each row's
        matrices gathered by its expert id, one batched matmul per projection. Memory grows with rows x
        matrix size: the path of small decode batches (CUDA graphs)."""
        gu, gu_bias, down, down_bias = self.weights()
        _, expert_of = self._offsets(rows, counts)
        h = torch.bmm(rows[:, None], gu.index_select(0, expert_of)).squeeze(1)
        h = self.activation(h + gu_bias.index_select(0, expert_of))
        out = torch.bmm(h[:, None], down.index_select(0, expert_of)).squeeze(1)
        out = out + down_bias.index_select(0, expert_of)
        return self._finish(out, counts, padded, row_scale)

    def _offsets(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(end offset of each expert's rows, each row's expert id) on the device: ``bucketize``, no host sync;
        padded rows past the last offset are given the last expert (their output is zeroed)."""
        offs = counts.cumsum(0)
        expert_of = torch.bucketize(torch.arange(rows.shape[0], device=rows.device), offs, right=True)
        return offs, expert_of.clamp_max(self.num_local - 1)

    @staticmethod
    def _finish(out: torch.Tensor, counts: torch.Tensor, padded: bool, row_scale: Optional[torch.Tensor]) -> torch.Tensor:
        """Scale each row by its gate weight; zero the padded rows (past ``counts.sum()``)."""
        if row_scale is not None:
            out = out * row_scale[:, None].to(out.dtype)
        if padded:
            real = torch.arange(out.shape[0], device=out.device) < counts.sum()
            out = torch.where(real[:, None], out, out.new_zeros(()))
        return out


class GptOssMoe(MoeBlock):
    """Router ``router`` (weight and bias) + :class:`ClampedSwiGLUExperts`; MoeBlock's routing with the
    top-k probabilities renormalised (= softmax over the top-k logits) and its expert paths."""

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, expert_intermediate_size: int,
                 swiglu_alpha: float, swiglu_limit: float):
        nn.Module.__init__(self)  # MoeBlock's own gate and stacked experts are not built
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, True
        self.router = nn.Linear(hidden_size, num_experts, bias=True)
        self.experts = ClampedSwiGLUExperts(num_experts, hidden_size, expert_intermediate_size,
                                            alpha=swiglu_alpha, limit=swiglu_limit)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x)
