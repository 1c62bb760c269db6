"""A light heartbeat for roles: GPU memory and utilization (NVML, where present) as metric numbers.

A role creates one :class:`Heartbeat` at start and merges ``sample()`` into the record it
already writes each step (metrics.jsonl / TensorBoard), e.g. in the trainer::

    beat = Heartbeat()
    ...
    record.update(beat.sample())     # {"gpu_mem_used_gib": 61.2, "gpu_util_pct": 97.0, ...}

Why not the node check: that one runs every query once and judges; this runs every step, so
it opens NVML once, keeps the handles of the GPUs this process may use (CUDA_VISIBLE_DEVICES),
asks only memory, utilization and temperature (microseconds each) and never raises: a role
must not die because NVML hiccuped. Without NVML (CPU nodes, CI) it reports only the
process's resident memory, so the same call works in every role and every test.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

from workers.common.gc_pauses import pauses as gc_pauses
from workers.common.nvml import GIB, close_nvml, open_nvml, visible_indices

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_rss_gib() -> Optional[float]:
    """Resident memory of this process (Linux /proc), None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / GIB
    except (OSError, IndexError, ValueError):
        return None


class Heartbeat:
    """Per-process GPU sampler; ``sample()`` returns flat ``{name: number}`` for metrics."""

    def __init__(self, nvml: Any = None, *, cuda_visible: Optional[str] = None, use_env: bool = True):
        if cuda_visible is None and use_env:
            cuda_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.nvml, self.unavailable = open_nvml(nvml)
        self.handles: list[tuple[int, Any]] = []
        self.num_errors = 0
        if self.nvml is None:
            return
        try:
            count = self.nvml.nvmlDeviceGetCount()
            handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = [self._uuid(h) for h in handles]
            self.handles = [(i, handles[i]) for i in visible_indices(count, cuda_visible, uuids)]
        except self.nvml.NVMLError as e:
            self.unavailable = f"NVML: {type(e).__name__}: {e}"
            self.close()

    def _uuid(self, handle: Any) -> str:
        try:
            u = self.nvml.nvmlDeviceGetUUID(handle)
            return u.decode() if isinstance(u, bytes) else str(u)
        except self.nvml.NVMLError:
            return ""

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        rss = host_rss_gib()
        if rss is not None:
            out["host_rss_gib"] = round(rss, 3)
        used, total, util, temp = [], [], [], []
        for index, handle in self.handles:
            try:
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                temp.append(self.nvml.nvmlDeviceGetTemperature(handle, self.nvml.NVML_TEMPERATURE_GPU))
            except self.nvml.NVMLError:
                self.num_errors += 1
                continue
            used.append(mem.used / GIB)
            total.append(mem.total / GIB)
            util.append(float(rates.gpu))
            if len(self.handles) > 1:
                out[f"gpu{index}_mem_used_gib"] = round(mem.used / GIB, 3)
                out[f"gpu{index}_util_pct"] = float(rates.gpu)
        if used:
            out.update(gpu_mem_used_gib=round(max(used), 3), gpu_mem_total_gib=round(min(total), 3),
                       gpu_util_pct=round(sum(util) / len(util), 1), gpu_temp_c=float(max(temp)))
        out.update(self._torch_memory())
        out.update(gc_pauses())  # the garbage collector's pauses, in roles that settled it (gc_pauses.py)
        if self.num_errors:
            out["gpu_heartbeat_errors"] = float(self.num_errors)
        return out

    @staticmethod
    def _torch_memory() -> dict[str, float]:
        """The caching allocator's view, only when this process already uses CUDA through torch."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return {}
        return {"torch_allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
                "torch_max_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3)}

    def close(self) -> None:
        if self.nvml is not None:
            close_nvml(self.nvml)
            self.nvml, self.handles = None, []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
