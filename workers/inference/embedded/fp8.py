"""FP8 rollouts in the embedded engine (``inference.dtype=float8``): quantization, the FP8 linear, the swap.

Why: a decode step of a MoE or a larger dense model reads every projection's weights once per step;
float8_e4m3fn halves those bytes and doubles the tensor-core rate on Hopper. The RL loop already
measures and corrects the sampler/trainer mismatch (the mismatch KL, the importance corrections), so
rollouts may come from a slightly different policy than the trainer's bf16 one.

What is quantized: the attention and MLP projections (:data:`LINEAR_NAMES`) and the routed experts'
stacks (workers/inference/embedded/fp8_experts.py). Embeddings, norms, the router, the LM head and
every other layer stay bf16 (they are small, or their precision sets the sampled distribution).

Scales (``float32`` dequantization factors, ``x ~= q * scale``):

- ``block``: 128x128 weight blocks (DeepSeek-V3's fp8 checkpoints) and 1x128 activation groups, where
  the output width is a multiple of 128, the input width of 512 (:func:`fp8_quant.fits_block`) and
  torch's blockwise ``_scaled_mm`` runs on this GPU (probed once: :func:`block_kernel_check`, whose
  reason the swap report keeps as ``block_reason``);
- ``rowwise``: one scale per output row of the weight and per token of the activation otherwise (the
  kernel every sm90 torch build has; the grouped expert GEMM only has this one).

Weight updates: the engine keeps the published bf16 weights as the module's ``weight`` parameter (what
the loaders copy into, sparse patches add to and digests are taken of: nothing in the weight path
changes) and the fp8 copy as buffers the forward (and its CUDA graphs) read. :func:`refresh` re-quantizes,
IN PLACE, every module whose bf16 weight changed since it was last quantized (full steps and patches
alike: every in-place write through the parameter or a ``state_dict()`` tensor bumps its version counter;
a write through ``param.data`` would not, so weight loaders must not use it, and swapping the storage
changes ``data_ptr``, which is checked too). Memory: 1.5x the bf16 projections.

CPU: the same quantization, then a float32 matmul of the dequantized operands (the reference the tests
check against, and what ``kernels.FAST_PATH_ON_CPU`` tests run).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
from torch import nn

from workers.inference.embedded import fp8_kernels
from workers.inference.embedded.fp8_kernels import fp8_matmul  # noqa: F401  (its callers' name for it)
from workers.inference.embedded.fp8_quant import (dequantize_blocks, dequantize_rows, fits_block, fits_rowwise,
                                                  quantize_blocks, quantize_rows, reference_linear)

log = logging.getLogger("slurmrl.inference")

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""nn.Linear children quantized (attention and dense/shared-expert MLP projections of every builtin family)."""

class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose forward runs in fp8 (set by :func:`quantize_model` as the module's class, so
    its parameters, names, hooks and state_dict are the bf16 linear's). Buffers ``qweight``/``qscale``."""

    scheme: str = "rowwise"
    fused = None
    """The :class:`~workers.inference.embedded.fp8_fused.SharedInput` group whose one GEMM computes this
    projection with its siblings reading the same input (q/k/v, gate/up), or None."""

    def requantize(self, force: bool = False) -> bool:
        """Quantize ``weight`` into the fp8 buffers (in place once they exist: captured CUDA graphs read
        them) when it changed since the last time (or ``force``); True when it did."""
        w = self.weight.detach()
        stamp = (w.data_ptr(), w._version)
        if not force and getattr(self, "_stamp", None) == stamp:
            return False
        with torch.no_grad():
            if self.scheme == "block":
                q, s = quantize_blocks(w)
            else:
                q, s = quantize_rows(w)
            if "qweight" not in self._buffers:
                self.register_buffer("qweight", q, persistent=False)
                self.register_buffer("qscale", s, persistent=False)
            else:
                self.qweight.copy_(q)
                self.qscale.copy_(s)
        self._stamp = stamp
        return True

    def dequantized(self) -> torch.Tensor:
        """The weight the fp8 forward multiplies by (float32), for tests and error reports."""
        if self.scheme == "block":
            return dequantize_blocks(self.qweight, self.qscale)
        return dequantize_rows(self.qweight, self.qscale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            y = self.fused.output(self, x)
        else:
            y = fp8_matmul(x.reshape(-1, x.shape[-1]), self.qweight, self.qscale, self.scheme)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def block_kernel_check(device: torch.device) -> tuple[bool, str]:
    """Whether torch's blockwise (1x128 by 128x128) ``_scaled_mm`` runs here and agrees with the reference,
    and why (the swap report's ``block_reason``; CPU: the reference itself, so tests cover the block scheme)."""
    if device.type != "cuda":
        return True, "cpu: the float32 reference"
    try:
        w = torch.randn(384, 1024, device=device)  # K/128 = 8: the layout fits_block admits
        q, s = quantize_blocks(w)
        for rows in (1, 8, 200):  # a decode step of one row, a small batch, a prefill chunk
            x = torch.randn(rows, 1024, device=device, dtype=torch.bfloat16)
            got = fp8_kernels.scaled_linear(x, q, s, "block").float()
            want = reference_linear(x, q, s, "block")
            err = float((got - want).abs().max() / want.abs().max())
            if err > 0.02:
                return False, f"blockwise _scaled_mm disagrees with the reference at {rows} rows (relative error {err:.3g})"
        return True, f"blockwise _scaled_mm agrees with the reference (torch {torch.__version__})"
    except (RuntimeError, NotImplementedError, ValueError) as e:  # an older torch or cuBLAS: rowwise instead
        return False, f"blockwise _scaled_mm unavailable (torch {torch.__version__}): {str(e).splitlines()[0][:300]}"


def quantize_model(model: nn.Module, *, blocks: Optional[bool] = None, fuse: bool = True) -> dict:
    """Swap the model's projections (and routed experts) to fp8 in place; returns what was swapped
    ({"block": n, "rowwise": n, "experts": n, "fused_groups": n, "kept_bf16": [names], "block_reason": why}).
    ``blocks`` None: probe the GPU. ``fuse``: siblings reading one input share one GEMM (fp8_fused.py)."""
    from workers.inference.embedded.fp8_experts import quantize_experts
    from workers.inference.embedded.fp8_fused import fuse_siblings

    device = next(model.parameters()).device
    if blocks is None:
        blocks, reason = block_kernel_check(device)
        if not blocks:
            log.warning("fp8: %s; 128x128 blocks become per-row scales", reason)
    else:
        reason = "blocks=%s given" % blocks
    swapped: list[nn.Module] = []
    report = {"block": 0, "rowwise": 0, "experts": 0, "fused_groups": 0, "kept_bf16": [], "block_reason": reason}
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear and name.rsplit(".", 1)[-1] in LINEAR_NAMES:
            n, k = mod.weight.shape
            if not fits_rowwise(n, k):
                report["kept_bf16"].append(name)
                continue
            mod.__class__ = Fp8Linear
            mod.scheme = "block" if blocks and fits_block(n, k) else "rowwise"
            report[mod.scheme] += 1
            swapped.append(mod)
    swapped += quantize_experts(model, report)
    model.fp8_modules = swapped
    refresh(model, force=True)
    report["fused_groups"] = fuse_siblings(model, Fp8Linear) if fuse else 0
    return report


def refresh(model: nn.Module, force: bool = False) -> int:
    """Re-quantize the fp8 modules whose bf16 weights changed (after a weight update); returns how many."""
    return sum(bool(m.requantize(force)) for m in getattr(model, "fp8_modules", ()))


def quantize_for_serving(model: nn.Module) -> dict:
    """The server's entry (inference.dtype=float8): the GPU must have fp8 tensor cores (the plan checked
    the name the config gives: workers/common/fp8_plan.py; this checks the GPU it got), then
    :func:`quantize_model`, logged."""
    device = next(model.parameters()).device
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        what = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
        raise RuntimeError(f"inference.dtype=float8 needs a Hopper or Blackwell GPU (compute capability 9.0+), "
                           f"this engine runs on {what}; check cluster.preflight.gpu_name or use inference.dtype=bfloat16")
    report = quantize_model(model)
    log.info("fp8 engine: %d projections with 128x128 block scales, %d with per-row scales (%d shared-input groups "
             "as one GEMM each), %d expert layers (grouped fp8 GEMM %s); kept bf16: %s", report["block"],
             report["rowwise"], report["fused_groups"], report["experts"],
             "on" if fp8_kernels.grouped_available() else "unavailable: every expert on every token", report["kept_bf16"] or "none")
    return report


@contextlib.contextmanager
def bf16_forward(model: nn.Module):
    """Inside: the fp8 modules run their bf16 weights again (the trainer's view of the same parameters),
    so one resident copy serves as both the fp8 engine and its bf16 reference (the benchmark's mismatch KL)."""
    from workers.inference.embedded.fp8_experts import Fp8Experts
    from workers.models.blocks.experts import StackedExperts

    mods = list(getattr(model, "fp8_modules", ()))
    classes = [type(m) for m in mods]
    try:
        for m in mods:
            m.__class__ = StackedExperts if isinstance(m, Fp8Experts) else nn.Linear
        yield model
    finally:
        for m, cls in zip(mods, classes):
            m.__class__ = cls
