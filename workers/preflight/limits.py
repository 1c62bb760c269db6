"""Preflight names and limits that the plan checks on the login node: pure, no NVML, no torch.

Why its own module: the launcher refuses a typo in ``cluster.preflight`` before anything is
submitted, and it must not import the GPU probe (pynvml) or the benchmarks to do so. The GPU
probe (gpu.py) and the bandwidth judge (bandwidth.py) take their name tables from here.
Also home of :class:`Finding`, the unit every preflight check returns.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

from workers.common.config import PreflightConfig

KEY = "cluster.preflight"
THROTTLE_BITS = {
    # nvmlClocksEventReason* (formerly nvmlClocksThrottleReason*) bit values of the NVML ABI.
    "gpu_idle": 0x1, "applications_clocks_setting": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8,
    "sync_boost": 0x10, "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80, "display_clock_setting": 0x100,
}
BUSBW_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "sendrecv": lambda n: 1.0,
}
COLLECTIVES = tuple(BUSBW_FACTOR)


@dataclasses.dataclass(frozen=True)
class Finding:
    level: str
    """``fail`` (stops the job) or ``warn``."""
    check: str
    """Short name: gpu_count, gpu_name, memory, ecc, retired_pages, row_remap, clocks, nvlink, nvml, versions,
    report, busbw, wrong, truncated, benchmark."""
    where: str
    """Node (and het group / component), or the component for bandwidth findings."""
    gpu: Optional[str]
    """``GPU i (pci bus id, uuid)``, or None for node-wide findings."""
    message: str

    def line(self) -> str:
        gpu = f" {self.gpu}" if self.gpu else ""
        return f"{self.level.upper()} {self.where}{gpu}: {self.check}: {self.message}"


def limit_errors(limits: PreflightConfig, *, component_names: Iterable[str]) -> list[str]:
    """User mistakes in ``cluster.preflight``, for the plan to raise before anything is submitted."""
    errors = []
    for key, names, valid in (("collectives", limits.collectives, COLLECTIVES),
                              ("min_busbw_gbps", limits.min_busbw_gbps, COLLECTIVES),
                              ("min_busbw_gbps_intra_node", limits.min_busbw_gbps_intra_node, COLLECTIVES),
                              ("fail_on_throttle", limits.fail_on_throttle, tuple(THROTTLE_BITS)),
                              ("expect_gpus_per_node", limits.expect_gpus_per_node, tuple(component_names))):
        bad = sorted(set(names) - set(valid))
        if bad:
            errors.append(f"{KEY}.{key} has unknown names {bad}; choose from {list(valid)}")
    if not 0 < limits.min_bytes <= limits.max_bytes or limits.size_factor < 2:
        errors.append(f"need 0 < {KEY}.min_bytes({limits.min_bytes}) <= {KEY}.max_bytes({limits.max_bytes}) "
                      f"and {KEY}.size_factor({limits.size_factor}) >= 2")
    if limits.timeout_s <= 0 or limits.num_iters <= 0 or limits.num_warmup_iters < 0:
        errors.append(f"{KEY}.timeout_s({limits.timeout_s}) and num_iters({limits.num_iters}) must be > 0, "
                      f"num_warmup_iters({limits.num_warmup_iters}) >= 0")
    return errors
