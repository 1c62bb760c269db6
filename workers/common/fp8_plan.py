"""Plan-time rules of ``inference.dtype=float8`` (torch-free, role-free: the launcher imports it).

Why at plan time: an fp8 engine on a GPU without fp8 tensor cores, or on the CPU, fails only when its
first forward runs, minutes into a job. The plan refuses, naming the key to change, whatever is not
built: fp8 is the embedded engine's (SGLang quantizes on its own, with ``inference.sglang.quantization``),
on CUDA, without LoRA adapters, on a GPU the config names as Hopper or Blackwell.

Which GPU: the launcher never sees the compute nodes' GPUs, so the config must say it:
``cluster.preflight.gpu_name`` (the text every GPU's NVML name must contain, which ``preflight=true``
then checks on every node, and which the engine checks again when it starts).
"""
from __future__ import annotations

from workers.common.dtypes import FLOAT8

FP8_GPUS = ("H100", "H200", "H800", "H20", "B100", "B200", "B300")
"""Name parts of GPUs with fp8 tensor cores and sm90+ fp8 GEMMs in torch (GH200/GB200 contain H200/B200)."""


def fp8_gpu(name: str) -> bool:
    return any(g in name.upper() for g in FP8_GPUS)


def check_float8(cfg) -> None:
    """ValueError naming the key when ``inference.dtype=float8`` cannot run as configured."""
    inf = cfg.inference
    if inf.dtype != FLOAT8:
        return
    if inf.backend != "embedded":
        hint = (" (SGLang quantizes weights itself: inference.dtype=bfloat16 inference.sglang.quantization=fp8)"
                if str(inf.backend).startswith("sglang") else "")
        raise ValueError(f"inference.dtype=float8 is built for inference.backend=embedded only, got "
                         f"inference.backend={inf.backend}{hint}")
    if str(getattr(inf, "device", "cpu")) == "cpu":
        raise ValueError("inference.dtype=float8 needs inference.device=cuda on a Hopper or Blackwell GPU: the CPU "
                         "engine has no fp8 GEMMs (use inference.dtype=float32 or bfloat16 on CPU)")
    rank = int(getattr(getattr(cfg.trainer, "lora", None), "rank", 0) or 0)
    if rank > 0:
        raise ValueError(f"inference.dtype=float8 with trainer.lora.rank={rank}: adapters over an fp8 base are not "
                         f"built; set inference.dtype=bfloat16 or trainer.lora.rank=0")
    name = cfg.cluster.preflight.gpu_name
    if not name or not fp8_gpu(name):
        raise ValueError(f"inference.dtype=float8 needs GPUs with fp8 tensor cores (Hopper or Blackwell: "
                         f"{', '.join(FP8_GPUS)}); the plan cannot see the nodes' GPUs, so name them: "
                         f"cluster.preflight.gpu_name=H100 (or H200, B200, ...; preflight=true checks every GPU "
                         f"against it), got cluster.preflight.gpu_name={name!r}")
