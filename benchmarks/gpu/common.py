"""Shared pieces of the GPU benchmarks: model presets, FLOP counting, timing, result files.

The presets are the GPU model of issue 11: an MoE of ~1.5B parameters (0.35B active) in
bf16 that fits one H200 with room for the trainer (AdamW) and the embedded engine at once,
and its dense counterpart (same active parameters, one expert of top_k x the width).
``tiny`` variants of both let every script run on CPU in seconds (``--tiny``) so a GPU
call never fails on a typo. No Hydra here: the device machine has none.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from workers.models.tiny_moe.model import TinyMoeConfig, TinyMoeForCausalLM

H200_BF16_PEAK = 989e12
"""Dense bf16 peak of the H100/H200 SXM datasheet, the MFU denominator of the issue."""

PEAKS = (("H100 PCIe", 756e12, 51e12), ("H100 NVL", 835e12, 60e12), ("H100", 989e12, 67e12), ("H200", 989e12, 67e12),
         ("H800", 989e12, 67e12), ("GH200", 989e12, 67e12), ("A100", 312e12, 19.5e12))
"""(name fragment, dense bf16 peak, float32 non-tensor peak) from the datasheets, first match wins
(``torch.cuda.get_device_name``: "NVIDIA H100 80GB HBM3" is the SXM card)."""


def peak_flops(device_name: str) -> tuple[float | None, float | None]:
    """(bf16 dense, float32) peak FLOP/s of the card named ``device_name``; (None, None) when unknown."""
    for fragment, bf16, fp32 in PEAKS:
        if fragment.lower() in device_name.lower():
            return bf16, fp32
    return None, None


GPU_MOE = TinyMoeConfig(vocab_size=32768, hidden_size=2048, num_layers=8, num_heads=16, num_experts=32, top_k=4,
                        expert_intermediate_size=768, max_position_embeddings=16384, rope_theta=1e6)
"""Qwen3-30B-A3B's layer shape (hidden 2048, expert width 768, head dim 128), 8 layers, 32 experts top-4."""

GPU_DENSE = dataclasses.replace(GPU_MOE, num_experts=1, top_k=1, expert_intermediate_size=GPU_MOE.top_k * 768)
"""Same active parameters as GPU_MOE, one always-on SwiGLU MLP of width 3072: the dense part's ceiling."""

TINY_MOE = TinyMoeConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_experts=8, top_k=2,
                         expert_intermediate_size=32, max_position_embeddings=1024)
TINY_DENSE = dataclasses.replace(TINY_MOE, num_experts=1, top_k=1, expert_intermediate_size=64)


def presets(tiny: bool) -> tuple[TinyMoeConfig, TinyMoeConfig]:
    return (TINY_MOE, TINY_DENSE) if tiny else (GPU_MOE, GPU_DENSE)


def param_counts(cfg: TinyMoeConfig) -> dict[str, int]:
    """total, active (what one token multiplies with: attention, router, top_k experts, lm_head)."""
    h, i, L = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_layers
    attn = 4 * h * h
    router = h * cfg.num_experts
    expert = 3 * h * i
    norms = 2 * h
    embed = cfg.vocab_size * h
    total = L * (attn + router + cfg.num_experts * expert + norms) + h + 2 * embed
    active_matmul = L * (attn + router + cfg.top_k * expert) + embed  # lm_head; the embedding is a lookup
    return {"total": total, "active_matmul": active_matmul, "active_with_embedding": active_matmul + embed}


def train_flops_per_token(cfg: TinyMoeConfig, seq_len: int) -> dict[str, float]:
    """Model FLOPs per trained token (forward + backward), the standard count.

    ``6 * N_active`` (N_active: attention projections, router, the top_k experts and lm_head,
    embedding lookup excluded) plus attention scores and values ``12 * L * hidden * seq``
    (PaLM / Megatron / torchtitan: full, non-causal count). ``causal`` halves the attention
    term, i.e. counts only what a causal kernel does; we report MFU with both.
    """
    n = param_counts(cfg)["active_matmul"]
    dense = 6.0 * n
    attn = 12.0 * cfg.num_layers * cfg.hidden_size * seq_len
    return {"matmul": dense, "attention": attn, "total": dense + attn, "total_causal": dense + attn / 2}


def device_info() -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "host": platform.node(), "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), sm_count=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), capability=list(torch.cuda.get_device_capability(0)),
                    cuda_runtime=torch.version.cuda)
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informational only
            pass
    else:
        info["device"] = "cpu (" + platform.processor() + ")"
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Callable[[], object], device: torch.device, *, warmup: int, iters: int) -> dict[str, float]:
    """Median / min / max wall seconds of ``fn`` after ``warmup`` calls (synchronised each call)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "iters": iters}


@torch.no_grad()
def init_on_device(cfg: TinyMoeConfig, device: torch.device, dtype: torch.dtype, seed: int) -> TinyMoeForCausalLM:
    """Random init in place on ``device`` with TinyMoeForCausalLM.init_weights' scheme.

    init_weights draws on the CPU generator (minutes for 1.5B parameters on a few cores);
    this draws on the device's generator: same distributions, other values.
    """
    with torch.device("meta"):
        model = TinyMoeForCausalLM(cfg)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = cfg.init_std
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            scale = std / math.sqrt(2 * cfg.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            p.normal_(0.0, scale, generator=gen)
    return model.to(dtype)


def write_result(out_dir: Path, name: str, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, sort_keys=True, default=str))
    return path


def free_cuda() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false")


def kernel_table(fn, title: str, rows: int = 30, sort_by: str = "cuda_time_total") -> None:
    """Prints the CUDA kernels of one ``fn()`` by total GPU time (kernels replayed from CUDA graphs
    included): where a decode step's time goes, for the next change."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"== profile: {title}", flush=True)
    print(prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=90), flush=True)
