"""One NVML session for whoever asks the driver about this process's GPUs: the node check
(workers/preflight/gpu.py) and every role's per-step heartbeat (workers/common/heartbeat.py).

Why in common: the roles sample NVML every step and the preflight collects a node report once;
both open NVML the same guarded way (a node without the driver is a report, not a crash) and
pick the GPUs this process may use from CUDA_VISIBLE_DEVICES the same way.
"""
from __future__ import annotations

from typing import Any, Optional

GIB = float(1 << 30)


def open_nvml(nvml: Any = None) -> tuple[Any, Optional[str]]:
    """(initialized NVML module, None) or (None, why not). Pass a fake module in tests."""
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError:
            return None, "pynvml is not installed (pip install nvidia-ml-py, or the [gpu] extra)"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        kind = type(e).__name__
        if kind == "NVMLError_LibraryNotFound":
            return None, "NVML library not found (libnvidia-ml.so): no NVIDIA driver on this node"
        if kind == "NVMLError_DriverNotLoaded":
            return None, "NVIDIA driver not loaded (nvmlInit: Driver Not Loaded)"
        return None, f"nvmlInit failed: {kind}: {e}"
    return nvml, None


def close_nvml(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        pass


def visible_indices(count: int, cuda_visible: Optional[str], uuids: Optional[list[str]] = None) -> list[int]:
    """NVML indices of the GPUs this process may use, from CUDA_VISIBLE_DEVICES.

    Unset: all. UUIDs (``GPU-...``, prefixes allowed as CUDA does): matched against ``uuids``.
    Indices: those, unless NVML already shows exactly that many GPUs (Slurm's cgroup device
    constraint hides the others and renumbers), or they do not exist (then all: the count
    check reports the mismatch).
    """
    if cuda_visible is None:
        return list(range(count))
    items = [x.strip() for x in cuda_visible.split(",") if x.strip()]
    if not items:
        return []
    if uuids is not None and any(x.startswith(("GPU-", "MIG-")) for x in items):
        return [i for i, u in enumerate(uuids) if any(str(u).startswith(x) for x in items)]
    if all(x.lstrip("-").isdigit() for x in items):
        ints = [int(x) for x in items]
        if any(i < 0 for i in ints):  # CUDA stops at the first invalid index
            ints = ints[:[i < 0 for i in ints].index(True)]
        if len(ints) == count or any(i >= count for i in ints):
            return list(range(count))
        return ints
    return list(range(count))
