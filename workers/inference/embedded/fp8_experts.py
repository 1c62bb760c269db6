"""FP8 routed experts for the embedded engine: the stacked experts' projections as fp8 grouped GEMMs.

Why rowwise scales here (not 128x128 blocks): torch's fp8 grouped GEMM (``_scaled_grouped_mm``, what
keeps a MoE layer at two GEMMs with device-side offsets, hence CUDA-graph capturable) takes one scale
per token and one per expert output channel on sm90. Each expert stack ``[E, N, K]`` gets fp8 buffers
``<stack>_q`` and scales ``<stack>_s [E, N]``; the bf16 stacks stay the parameters the weight loaders
write (per-expert state_dict views of them: workers/models/blocks/experts.py), and a change of either
stack re-quantizes both (workers/inference/embedded/fp8.py's ``refresh``).

Which experts: :class:`~workers.models.blocks.experts.StackedExperts` exactly (qwen3_moe, tiny_moe,
deepseek_v3, glm_moe_dsa, ...). GPT-OSS's biased, interleaved experts and LoRA experts stay bf16 (the
plan refuses float8 with LoRA: workers/common/fp8_plan.py).
"""
from __future__ import annotations

import torch
from torch import nn

from workers.inference.embedded import fp8_kernels
from workers.inference.embedded.fp8_quant import dequantize_rows, quantize_rows
from workers.models.blocks.experts import StackedExperts


class Fp8Experts(StackedExperts):
    """:class:`StackedExperts` running its projections in fp8 (set as the module's class by
    :func:`quantize_experts`; parameters and state_dict are unchanged)."""

    def requantize(self, force: bool = False) -> bool:
        stamp = tuple((getattr(self, s).data_ptr(), getattr(self, s)._version) for s in self.stacks())
        if not force and getattr(self, "_stamp", None) == stamp:
            return False
        with torch.no_grad():
            for stack in self.stacks():
                q, s = quantize_rows(getattr(self, stack).detach())
                if stack + "_q" not in self._buffers:
                    self.register_buffer(stack + "_q", q, persistent=False)
                    self.register_buffer(stack + "_s", s, persistent=False)
                else:
                    self._buffers[stack + "_q"].copy_(q)
                    self._buffers[stack + "_s"].copy_(s)
        self._stamp = stamp
        return True

    def dequantized(self, stack: str) -> torch.Tensor:
        return dequantize_rows(self._buffers[stack + "_q"], self._buffers[stack + "_s"])

    def linear(self, stack: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s fp8 projection (the loop and the dense path)."""
        q, s = self._buffers[stack + "_q"][e], self._buffers[stack + "_s"][e]
        if x.is_cuda:
            return fp8_kernels.scaled_linear(x, q, s, "rowwise")
        xq, xs = quantize_rows(x)
        return (dequantize_rows(xq, xs) @ dequantize_rows(q, s).t()).to(x.dtype)

    def project(self, stack: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        q, s = self._buffers[stack + "_q"], self._buffers[stack + "_s"]
        if x.is_cuda:
            return fp8_kernels.scaled_grouped(x, q, s, offs)
        # CPU (kernels.FAST_PATH_ON_CPU tests): the grouped GEMM's math, group by group
        starts = [0] + offs.tolist()[:-1]
        out = x.new_zeros(x.shape[0], q.shape[1])
        for e, (a, b) in enumerate(zip(starts, offs.tolist())):
            out[a:b] = self.linear(stack, e, x[a:b])
        return out

    def grouped_ok(self, rows: torch.Tensor) -> bool:
        """fp8 grouped GEMM: bf16 activations, widths in multiples of 16, a torch that has it (CPU tests:
        the reference above)."""
        widths_ok = not any(d % 16 for name in self.stacks() for d in getattr(self, name).shape[1:])
        return (widths_ok and rows.dtype == torch.bfloat16
                and (not rows.is_cuda or fp8_kernels.grouped_available()))


def quantize_experts(model: nn.Module, report: dict) -> list[nn.Module]:
    """Swap every plain :class:`StackedExperts` of ``model`` to :class:`Fp8Experts`; the swapped ones."""
    out = []
    for mod in model.modules():
        if type(mod) is StackedExperts:
            mod.__class__ = Fp8Experts
            report["experts"] += 1
            out.append(mod)
    return out

