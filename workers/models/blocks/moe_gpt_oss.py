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
gate rows then up rows, no biases), whose per-expert names the expert-parallel state paths (DCP,
weight streaming) are written for: the mesh plan runs these experts under tp > 1 (replicated over tp,
the tokens split, through the same ``forward(rows, counts)`` and :meth:`~ClampedSwiGLUExperts.narrow_`),
and the family's spec refuses ep > 1 at plan time.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.blocks import kernels
from workers.models.blocks.moe_softmax import MoeBlock


class ClampedSwiGLUExperts(nn.Module):
    """``E`` GPT-OSS experts (module docstring); the interface MoeBlock's expert paths call."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit, self.intermediate_size = alpha, limit, intermediate_size
        self.first = 0  # global id of local expert 0 (narrow_)
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
        return self.down_proj.shape[0]

    @torch.no_grad()
    def narrow_(self, first: int, count: int) -> None:
        """Keep experts ``[first, first + count)`` only (the trainer's expert-parallel split:
        workers/trainer/parallel/expert.py ``shard_experts``; ``count`` = all of them under tp alone)."""
        for name, old in list(self.named_parameters(recurse=False)):
            setattr(self, name, nn.Parameter(old[first:first + count].clone(), requires_grad=old.requires_grad))
        self.first = first

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of interleaved gate/up columns ``[n, 2I] -> [n, I]``."""
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on rows ``x`` [n, H] (the reference loop and the dense sum)."""
        h = self.activation(x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e])
        return h @ self.down_proj[e] + self.down_proj_bias[e]

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
            offs, expert_of = self._offsets(rows, counts)
            offs = offs.to(torch.int32)
            h = F.grouped_mm(rows, self.gate_up_proj, offs=offs) + self.gate_up_proj_bias.index_select(0, expert_of)
            out = F.grouped_mm(self.activation(h), self.down_proj, offs=offs) + self.down_proj_bias.index_select(0, expert_of)
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
        _, expert_of = self._offsets(rows, counts)
        h = torch.bmm(rows[:, None], self.gate_up_proj.index_select(0, expert_of)).squeeze(1)
        h = self.activation(h + self.gate_up_proj_bias.index_select(0, expert_of))
        out = torch.bmm(h[:, None], self.down_proj.index_select(0, expert_of)).squeeze(1)
        out = out + self.down_proj_bias.index_select(0, expert_of)
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
