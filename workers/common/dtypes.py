"""The one dtype table: config names -> torch dtypes, safetensors codes and byte sizes.

Why one table: the trainer, the embedded engine, the weight shards and the planner all name dtypes;
with a copy each, a name accepted by one could be refused by another. Importing this module does not
import torch (the launcher uses :data:`COMPUTE_DTYPES` and :func:`itemsize`); :func:`torch_dtype`
imports it when called.
"""
from __future__ import annotations

from typing import Any

#: dtype name (torch's, without ``torch.``) -> (safetensors code, bytes per element)
TABLE: dict[str, tuple[str, float]] = {
    "float64": ("F64", 8), "float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1), "uint8": ("U8", 1),
    "bool": ("BOOL", 1), "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1)}
COMPUTE_DTYPES = ("float32", "bfloat16")
"""What ``trainer.dtype`` accepts (and ``inference.dtype``, plus :data:`FLOAT8`)."""
FLOAT8 = "float8"
"""``inference.dtype=float8``: the embedded engine holds bf16 weights and runs its projections and experts
in fp8 (workers/inference/embedded/fp8.py); not a storage dtype (the published weights are bf16)."""
INFERENCE_DTYPES = COMPUTE_DTYPES + (FLOAT8,)


def held_dtype(inference_dtype: str) -> str:
    """The dtype of the weights an engine holds (what the trainer publishes to it, what its digests and
    patches apply to): ``float8`` engines hold bfloat16 and quantize it themselves."""
    return "bfloat16" if inference_dtype == FLOAT8 else inference_dtype


def check_name(key: str, name: str, choices=COMPUTE_DTYPES) -> str:
    """``name`` if it is one of ``choices``; ValueError naming the config key otherwise."""
    if name not in choices:
        raise ValueError(f"{key}={name!r} is not supported; choose one of {list(choices)}")
    return name


def itemsize(name: str) -> float:
    return TABLE[check_name("dtype", name, tuple(TABLE))][1]


def safetensors_code(name: str) -> str:
    return TABLE[check_name("dtype", name, tuple(TABLE))][0]


def torch_dtype(name: str, key: str = "dtype") -> Any:
    """The torch dtype called ``name`` (``bfloat16`` -> torch.bfloat16); ValueError naming ``key``."""
    import torch

    check_name(key, name, tuple(TABLE))
    return getattr(torch, name)


def dtype_name(dtype: Any) -> str:
    """torch dtype -> its name in this table (``torch.bfloat16`` -> ``bfloat16``)."""
    return str(dtype).replace("torch.", "")
