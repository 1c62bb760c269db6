"""fake_nvml: a stand-in for the ``pynvml`` module (nvidia-ml-py) with GPUs and faults you choose.

There is no GPU in CI, so workers/preflight is tested against this module: it implements the
subset of pynvml that workers/common/nvml.py, workers/preflight/gpu.py and workers/common/heartbeat.py call, with the same function
names, argument order, return shapes (``c_nvmlMemory_t``-like objects with ``.total/.free/.used``)
and error classes (``NVMLError`` and its ``NVMLError_NotSupported``-style subclasses carrying
``.value``), so the code under test is the real code. Faults are plain fields of
:class:`FakeGPU`; a field set to :data:`UNSUPPORTED` makes its query raise NotSupported, the
way an H200 answers the pre-Ampere retired-pages query.

    nvml = FakeNVML([FakeGPU(), FakeGPU(ecc_uncorrected_volatile=3)])
    report = collect_node(nvml, node="node1")
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Optional

UNSUPPORTED = object()
"""A field value that makes the matching query raise NVMLError_NotSupported."""


class NVMLError(Exception):
    def __init__(self, value: int, text: str = ""):
        super().__init__(text or f"NVML error {value}")
        self.value = value


def _error(name: str, value: int, text: str) -> type:
    return type(name, (NVMLError,), {"__init__": lambda self: NVMLError.__init__(self, value, text)})


NVMLError_Uninitialized = _error("NVMLError_Uninitialized", 1, "Uninitialized")
NVMLError_InvalidArgument = _error("NVMLError_InvalidArgument", 2, "Invalid Argument")
NVMLError_NotSupported = _error("NVMLError_NotSupported", 3, "Not Supported")
NVMLError_NoPermission = _error("NVMLError_NoPermission", 4, "Insufficient Permissions")
NVMLError_DriverNotLoaded = _error("NVMLError_DriverNotLoaded", 9, "Driver Not Loaded")
NVMLError_LibraryNotFound = _error("NVMLError_LibraryNotFound", 12, "NVML Shared Library Not Found")
NVMLError_FunctionNotFound = _error("NVMLError_FunctionNotFound", 13, "Function Not Found")
NVMLError_GpuIsLost = _error("NVMLError_GpuIsLost", 15, "GPU is lost")

NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_TEMPERATURE_GPU = 0
NVML_NVLINK_MAX_LINKS = 18
GIB = 1 << 30


@dataclasses.dataclass
class FakeGPU:
    """One GPU's answers; defaults are a healthy, idle H200 SXM."""

    name: Any = "NVIDIA H200"
    uuid: str = ""
    pci_bus_id: str = ""
    memory_total: int = 143771 * (1 << 20)
    memory_used: int = 512 * (1 << 20)
    ecc_uncorrected_volatile: Any = 0
    ecc_uncorrected_aggregate: Any = 0
    retired_pages_sbe: Any = UNSUPPORTED
    """Pre-Ampere page retirement: H100/H200 answer NotSupported and remap rows instead."""
    retired_pages_dbe: Any = UNSUPPORTED
    retired_pending: Any = UNSUPPORTED
    remapped_rows: Any = (0, 0, 0, 0)
    """(correctable, uncorrectable, is_pending, failure_occurred), as nvmlDeviceGetRemappedRows returns."""
    clock_event_reasons: Any = 0x1
    """Bit mask (0x1: GPU idle)."""
    nvlinks: Any = (NVML_FEATURE_ENABLED,) * 18
    """State per NVLink; links beyond the tuple raise InvalidArgument like a real GPU."""
    temperature_c: Any = 32
    utilization: Any = (0, 0)
    """(gpu %, memory %)."""
    processes: Any = ()
    """(pid, used bytes) per compute process."""
    lost: bool = False
    """Every query raises NVMLError_GpuIsLost ("GPU has fallen off the bus")."""


class FakeNVML:
    """Module-like object: ``FakeNVML(gpus).nvmlDeviceGetCount()`` as ``pynvml.nvmlDeviceGetCount()``."""

    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGPU], *, driver: str = "570.124.06", cuda: int = 12080,
                 init_error: Optional[type] = None, old_throttle_api: bool = False):
        self.gpus = gpus
        for i, g in enumerate(gpus):
            g.uuid = g.uuid or f"GPU-{i:08x}-fake-0000-0000-{i:012x}"
            g.pci_bus_id = g.pci_bus_id or f"00000000:{0x18 + 0x10 * i:02X}:00.0"
        self.driver, self.cuda, self.init_error = driver, cuda, init_error
        self.initialized = 0
        self.calls: list[str] = []
        if old_throttle_api:  # nvidia-ml-py < 12.535 only has the throttle name
            self.nvmlDeviceGetCurrentClocksThrottleReasons = self.nvmlDeviceGetCurrentClocksEventReasons
            self.nvmlDeviceGetCurrentClocksEventReasons = None

    def __getattr__(self, name: str) -> Any:  # NVMLError_* classes and NVML_* constants
        value = globals().get(name)
        if value is None or not (name.startswith("NVML")):
            raise AttributeError(name)
        return value

    # --- library -----------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error()
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._need_init()
        self.initialized -= 1

    def _need_init(self) -> None:
        if self.initialized <= 0:
            raise NVMLError_Uninitialized()

    def nvmlSystemGetDriverVersion(self) -> str:
        self._need_init()
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._need_init()
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        self._need_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGPU:
        self._need_init()
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument()
        return self.gpus[index]

    # --- per device ----------------------------------------------------------------------------
    def _get(self, gpu: FakeGPU, field: str) -> Any:
        self._need_init()
        self.calls.append(field)
        if gpu.lost:
            raise NVMLError_GpuIsLost()
        value = getattr(gpu, field)
        if value is UNSUPPORTED:
            raise NVMLError_NotSupported()
        return value

    def nvmlDeviceGetName(self, gpu: FakeGPU) -> Any:
        return self._get(gpu, "name")

    def nvmlDeviceGetUUID(self, gpu: FakeGPU) -> str:
        return self._get(gpu, "uuid")

    def nvmlDeviceGetPciInfo(self, gpu: FakeGPU) -> SimpleNamespace:
        return SimpleNamespace(busId=self._get(gpu, "pci_bus_id"))

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGPU) -> SimpleNamespace:
        total, used = self._get(gpu, "memory_total"), self._get(gpu, "memory_used")
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGPU, error_type: int, counter_type: int) -> int:
        assert error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return self._get(gpu, "ecc_uncorrected_volatile" if counter_type == NVML_VOLATILE_ECC
                         else "ecc_uncorrected_aggregate")

    def nvmlDeviceGetRetiredPages(self, gpu: FakeGPU, cause: int) -> list[int]:
        count = self._get(gpu, "retired_pages_dbe" if cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
                          else "retired_pages_sbe")
        return [0x1000 * (i + 1) for i in range(count)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, gpu: FakeGPU) -> int:
        return int(self._get(gpu, "retired_pending"))

    def nvmlDeviceGetRemappedRows(self, gpu: FakeGPU) -> tuple:
        return tuple(self._get(gpu, "remapped_rows"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGPU) -> int:
        return self._get(gpu, "clock_event_reasons")

    def nvmlDeviceGetNvLinkState(self, gpu: FakeGPU, link: int) -> int:
        links = self._get(gpu, "nvlinks")
        if link >= len(links):
            raise NVMLError_InvalidArgument()
        return links[link]

    def nvmlDeviceGetTemperature(self, gpu: FakeGPU, sensor: int) -> int:
        assert sensor == NVML_TEMPERATURE_GPU
        return self._get(gpu, "temperature_c")

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGPU) -> SimpleNamespace:
        g, m = self._get(gpu, "utilization")
        return SimpleNamespace(gpu=g, memory=m)

    def nvmlDeviceGetComputeRunningProcesses(self, gpu: FakeGPU) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self._get(gpu, "processes")]
