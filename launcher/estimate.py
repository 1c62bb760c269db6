"""Parameter counts and GPU memory estimates from the model's architecture facts.

The counts are the model family's (workers/models/facts.py through ``ModelSpec.arch``); this
module turns them into per-GPU memory for the trainer and each inference replica.

Why: a plan for 28 nodes must show, before anything is submitted, that the trainer's states
and every inference replica's weights fit the GPUs they were given. These are first-order
estimates (weights, gradients, Adam states, KV-cache room), not a profiler: activations and
fragmentation are what the headroom is for. Pure arithmetic; no torch.
"""
from __future__ import annotations

import dataclasses

from workers.models.spec import ParamCount, architecture  # noqa: F401  (ParamCount re-exported)

TRAIN_BYTES_PER_PARAM = 16
"""float32 master weights (4) + float32 gradients (4: FSDP reduce-scatters into them) + AdamW m and v
(4 + 4); the bf16 compute copies are gathered one layer at a time (transient). trainer.master_dtype
=bfloat16 halves all four (8)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
SERVER_MEM_FRACTION = 0.9
"""Share of a GPU an inference server may use (SGLang's --mem-fraction-static is of this order)."""


def count_params(m) -> ParamCount:
    """Total, active and MTP parameters of a model section (any family, through its spec's facts)."""
    return architecture(m).params()


def kv_bytes_per_token(m, dtype: str) -> int:
    """KV cache of one token over all layers (the family's facts; MLA stores the latent + rope key)."""
    return architecture(m).kv_bytes_per_token(DTYPE_BYTES[dtype])


def attention_params(m) -> int:
    return architecture(m).attention_params()


def expert_params(m) -> int:
    """One SwiGLU expert: gate, up and down projections."""
    return architecture(m).expert_params()


def human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    what: str
    """Which role or replica kind."""
    per_gpu_gb: float
    """Estimated resident bytes per GPU, in GB."""
    gpu_gb: float
    """GPU memory available for it."""
    detail: str
    """One line: how the number was obtained and what remains."""

    @property
    def fits(self) -> bool:
        return self.per_gpu_gb <= self.gpu_gb


def trainer_memory(params: ParamCount, num_gpus: int, gpu_gb: float, master_dtype: str = "float32") -> MemoryEstimate:
    """States fully sharded over every trainer GPU (the FSDP plan, workers/trainer/parallel/fsdp.py): master
    weights, their gradients and AdamW's two moments, all in ``trainer.master_dtype``."""
    per_param = TRAIN_BYTES_PER_PARAM * DTYPE_BYTES[master_dtype] // DTYPE_BYTES["float32"]
    per_gpu = (params.total + params.mtp) * per_param / num_gpus / 1e9
    return MemoryEstimate(what="trainer", per_gpu_gb=per_gpu, gpu_gb=gpu_gb,
                          detail=f"{states_formula(params, num_gpus, master_dtype)} = {per_gpu:.1f} GB/GPU of "
                                 f"{gpu_gb:.0f} ({gpu_gb - per_gpu:.0f} GB left for activations)")


def states_formula(params: ParamCount, num_gpus: int, master_dtype: str = "float32") -> str:
    """How the trainer's per-GPU states are counted, e.g. ``16 B/param x 1.5B params / 8 GPUs``."""
    per_param = TRAIN_BYTES_PER_PARAM * DTYPE_BYTES[master_dtype] // DTYPE_BYTES["float32"]
    return f"{per_param} B/param x {human(params.total + params.mtp)} params / {num_gpus} GPUs"


def server_memory(kind: str, m, params: ParamCount, *, dtype: str, tp: int, gpu_gb: float) -> MemoryEstimate:
    """Weights of one replica split over its tp GPUs; what is left of the usable share is KV cache."""
    usable = gpu_gb * SERVER_MEM_FRACTION
    per_gpu = (params.total + params.mtp) * DTYPE_BYTES[dtype] / tp / 1e9
    kv_tokens = max(0.0, usable - per_gpu) * 1e9 * tp / kv_bytes_per_token(m, dtype)
    return MemoryEstimate(what=kind, per_gpu_gb=per_gpu, gpu_gb=usable,
                          detail=f"{dtype} weights {per_gpu:.1f} GB/GPU over tp {tp} of {usable:.0f} usable; "
                                 f"KV cache room ~{human(kv_tokens)} tokens per replica "
                                 f"({kv_bytes_per_token(m, dtype) / 1024:.1f} KiB/token)")
