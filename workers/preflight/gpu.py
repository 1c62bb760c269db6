"""Facts about this node's GPUs through NVML (``pynvml`` from nvidia-ml-py), as one JSON-able dict.

Only collection lives here; judging the facts against the site's limits is checks.py, so the
same report can be re-judged (and the fake NVML of tests/fakes/fake_nvml.py can drive both).
Every NVML query is guarded: a query the GPU does not support (retired pages on Hopper,
NVLink on PCIe cards) records None, and any other NVML error is kept in the GPU's ``errors``
list, so one odd GPU never hides the others. ``nvmlInit()`` raises NVMLError_LibraryNotFound
on a machine without the NVIDIA driver (docs/design.md, "Platform facts"): that is a report
(``nvml_error``), not a crash, because CPU nodes of the job run the same code.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Optional

from workers.common.nvml import GIB, close_nvml, open_nvml, visible_indices
from workers.preflight.limits import THROTTLE_BITS

MAX_NVLINKS = 18
"""NVLinks queried per GPU (Hopper has 18; NVML_NVLINK_MAX_LINKS may be larger in new bindings)."""
_SILENT = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
"""Errors that mean "this GPU or driver has no such counter": recorded as None, not as a problem."""


def _text(value: Any) -> Any:
    """Old bindings return bytes for names and versions, new ones str."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def cuda_version_text(version: Optional[int]) -> Optional[str]:
    """nvmlSystemGetCudaDriverVersion's 12080 -> ``"12.8"`` (major*1000 + minor*10)."""
    return None if version is None else f"{version // 1000}.{version % 1000 // 10}"


class _Query:
    """Calls NVML functions, turning "not supported" into None and other errors into messages."""

    def __init__(self, nvml: Any):
        self.nvml = nvml
        self.errors: list[str] = []

    def __call__(self, name: str, *args: Any) -> Any:
        fn: Optional[Callable] = getattr(self.nvml, name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.nvml.NVMLError as e:
            if type(e).__name__ not in _SILENT:
                self.errors.append(f"{name}: {type(e).__name__}: {e}")
            return None


def nvlink_states(q: _Query, handle: Any) -> tuple[Optional[int], list[int]]:
    """(active links, inactive link numbers); (None, []) when the GPU has no NVLink."""
    active, inactive, seen = 0, [], 0
    for link in range(MAX_NVLINKS):
        state = q("nvmlDeviceGetNvLinkState", handle, link)
        if state is None:
            continue
        seen += 1
        if state == 1:  # NVML_FEATURE_ENABLED
            active += 1
        else:
            inactive.append(link)
    # A link number past the GPU's last link raises InvalidArgument: not a problem to report.
    q.errors[:] = [e for e in q.errors if not e.startswith("nvmlDeviceGetNvLinkState: NVMLError_InvalidArgument")]
    return (active, inactive) if seen else (None, [])


def collect_gpu(nvml: Any, index: int) -> dict:
    """Everything preflight knows about one GPU (NVML index ``index``)."""
    q = _Query(nvml)
    handle = q("nvmlDeviceGetHandleByIndex", index)
    gpu: dict[str, Any] = {"index": index}
    if handle is None:
        gpu["errors"] = q.errors
        return gpu
    gpu["name"] = _text(q("nvmlDeviceGetName", handle))
    gpu["uuid"] = _text(q("nvmlDeviceGetUUID", handle))
    pci = q("nvmlDeviceGetPciInfo", handle)
    gpu["pci_bus_id"] = _text(getattr(pci, "busId", None)) if pci is not None else None
    mem = q("nvmlDeviceGetMemoryInfo", handle)
    gpu["memory_total_gib"] = round(mem.total / GIB, 3) if mem is not None else None
    gpu["memory_free_gib"] = round(mem.free / GIB, 3) if mem is not None else None
    uncorrected, volatile, aggregate = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC, nvml.NVML_AGGREGATE_ECC
    gpu["ecc_uncorrected_volatile"] = q("nvmlDeviceGetTotalEccErrors", handle, uncorrected, volatile)
    gpu["ecc_uncorrected_aggregate"] = q("nvmlDeviceGetTotalEccErrors", handle, uncorrected, aggregate)
    sbe = q("nvmlDeviceGetRetiredPages", handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    dbe = q("nvmlDeviceGetRetiredPages", handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    gpu["retired_pages"] = None if sbe is None and dbe is None else len(sbe or ()) + len(dbe or ())
    pending = q("nvmlDeviceGetRetiredPagesPendingStatus", handle)
    gpu["retired_pages_pending"] = None if pending is None else bool(pending)
    rows = q("nvmlDeviceGetRemappedRows", handle)
    if rows is not None:
        corr, unc, is_pending, failed = rows
        gpu.update(remapped_rows_correctable=corr, remapped_rows_uncorrectable=unc, row_remap_pending=bool(is_pending),
                   row_remap_failed=bool(failed))
    reasons_fn = ("nvmlDeviceGetCurrentClocksEventReasons" if getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                  else "nvmlDeviceGetCurrentClocksThrottleReasons")
    mask = q(reasons_fn, handle)
    gpu["clock_event_reasons"] = None if mask is None else [n for n, bit in THROTTLE_BITS.items() if mask & bit]
    gpu["nvlinks_active"], gpu["nvlinks_inactive"] = nvlink_states(q, handle)
    gpu["temperature_c"] = q("nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU)
    procs = q("nvmlDeviceGetComputeRunningProcesses", handle)
    gpu["processes"] = None if procs is None else [
        {"pid": p.pid, "used_gib": round((p.usedGpuMemory or 0) / GIB, 3)} for p in procs]
    gpu["errors"] = q.errors
    return gpu


def collect_node(nvml: Any = None, *, node: Optional[str] = None, cuda_visible: Optional[str] = None,
                 use_env: bool = True) -> dict:
    """The node report: driver and CUDA versions and one entry per GPU this process may use.

    ``cuda_visible`` defaults to this process's CUDA_VISIBLE_DEVICES (Slurm sets it per step);
    ``use_env=False`` ignores the environment (tests).
    """
    if cuda_visible is None and use_env:
        cuda_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    report: dict[str, Any] = {"node": node or socket.gethostname(), "time": time.time(), "nvml_error": None,
                              "driver_version": None, "cuda_driver_version": None, "num_gpus_nvml": 0,
                              "cuda_visible_devices": cuda_visible, "gpus": []}
    nvml, error = open_nvml(nvml)
    if nvml is None:
        report["nvml_error"] = error
        return report
    try:
        q = _Query(nvml)
        report["driver_version"] = _text(q("nvmlSystemGetDriverVersion"))
        report["cuda_driver_version"] = cuda_version_text(q("nvmlSystemGetCudaDriverVersion"))
        count = q("nvmlDeviceGetCount") or 0
        report["num_gpus_nvml"] = count
        gpus = [collect_gpu(nvml, i) for i in range(count)]
        report["gpus"] = [gpus[i] for i in visible_indices(count, cuda_visible, [g.get("uuid") for g in gpus])]
        if q.errors:
            report["nvml_error"] = "; ".join(q.errors)
    finally:
        close_nvml(nvml)
    return report
