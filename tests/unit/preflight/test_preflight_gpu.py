"""NVML code paths of workers/preflight (gpu.py, checks.py, heartbeat.py) against fake_nvml.

CI has no GPU, so every fault is injected into tests/fakes/fake_nvml.py, which mirrors the
pynvml calls, return shapes and error classes preflight uses; the code under test is real.
"""
from __future__ import annotations

import pytest

from tests.fakes.fake_nvml import (UNSUPPORTED, FakeGPU, FakeNVML, NVMLError_DriverNotLoaded,
                                   NVMLError_LibraryNotFound)
from workers.common.config import PreflightConfig
from workers.preflight.checks import NodeExpectation, check_node, check_versions, failed, limit_errors
from workers.common.nvml import visible_indices
from workers.preflight.gpu import collect_node, cuda_version_text
from workers.common.heartbeat import Heartbeat
from workers.preflight.checks import report_lines, summarize

LIMITS = PreflightConfig()
EIGHT = NodeExpectation(num_gpus=8, source="--gpus-per-node of het group 3", gpu_memory_gb=141)


def node(gpus: list[FakeGPU], *, name: str = "gpu-007", cuda_visible=None, **kw) -> dict:
    nvml = FakeNVML(gpus, **kw)
    report = collect_node(nvml, node=name, cuda_visible=cuda_visible, use_env=False)
    assert nvml.initialized == 0  # nvmlShutdown after every collection
    report.update(het_group=3, component="trainer")
    return report


def findings(gpus: list[FakeGPU], limits: PreflightConfig = LIMITS, expect: NodeExpectation = EIGHT, **kw) -> list[str]:
    return [f.line() for f in check_node(node(gpus, **kw), expect, limits)]


def healthy(n: int = 8) -> list[FakeGPU]:
    return [FakeGPU() for _ in range(n)]


def test_healthy_hgx_h200_node_has_no_findings_and_a_full_report():
    r = node(healthy())
    assert r["driver_version"] == "570.124.06" and r["cuda_driver_version"] == "12.8" and r["nvml_error"] is None
    g = r["gpus"][3]
    assert g["name"] == "NVIDIA H200" and g["pci_bus_id"] == "00000000:48:00.0" and g["uuid"].startswith("GPU-00000003")
    assert g["memory_total_gib"] == pytest.approx(140.4, abs=0.01) and g["memory_free_gib"] == pytest.approx(139.9, abs=0.01)
    assert (g["ecc_uncorrected_volatile"], g["retired_pages"], g["row_remap_failed"]) == (0, None, False)
    assert g["clock_event_reasons"] == ["gpu_idle"] and g["nvlinks_active"] == 18 and g["errors"] == []
    assert check_node(r, EIGHT, PreflightConfig(min_nvlinks_per_gpu=18, gpu_name="H200", min_free_memory_gb=130)) == []


def test_each_fault_names_node_gpu_and_limit():
    gpus = healthy()
    gpus[1].ecc_uncorrected_volatile = 2
    gpus[2].retired_pages_dbe, gpus[2].retired_pages_sbe, gpus[2].retired_pending = 70, 3, 1
    gpus[3].remapped_rows = (4, 1, 0, 1)
    gpus[4].remapped_rows = (0, 0, 1, 0)
    gpus[5].clock_event_reasons = 0x8 | 0x4  # hw_slowdown + sw_power_cap
    gpus[6].memory_used = 100 << 30
    gpus[6].processes = ((41234, 99 << 30),)
    gpus[7].lost = True
    lines = findings(gpus, PreflightConfig(min_free_memory_gb=100))
    where = "gpu-007 (het group 3, trainer)"
    expected = [
        f"FAIL {where} GPU 1 (00000000:28:00.0, {gpus[1].uuid}): ecc: 2 uncorrected ECC errors since the last reset > "
        "cluster.preflight.max_uncorrected_ecc_errors(0)",
        f"FAIL {where} GPU 2 (00000000:38:00.0, {gpus[2].uuid}): retired_pages: 73 retired pages > "
        "cluster.preflight.max_retired_pages(60)",
        f"FAIL {where} GPU 2 (00000000:38:00.0, {gpus[2].uuid}): retired_pages: a page retirement is pending: reset the GPU "
        "(nvidia-smi -r) before use",
        f"FAIL {where} GPU 3 (00000000:48:00.0, {gpus[3].uuid}): row_remap: a row remapping failed: the GPU needs replacing (RMA)",
        f"WARN {where} GPU 3 (00000000:48:00.0, {gpus[3].uuid}): row_remap: 1 rows remapped after uncorrectable errors",
        f"FAIL {where} GPU 4 (00000000:58:00.0, {gpus[4].uuid}): row_remap: a row remapping is pending: reset the GPU "
        "(nvidia-smi -r) before use",
        f"FAIL {where} GPU 5 (00000000:68:00.0, {gpus[5].uuid}): clocks: clocks held down by hw_slowdown "
        "(cluster.preflight.fail_on_throttle)",
        f"WARN {where} GPU 5 (00000000:68:00.0, {gpus[5].uuid}): clocks: clocks held down by sw_power_cap",
        f"FAIL {where} GPU 6 (00000000:78:00.0, {gpus[6].uuid}): memory: 40.4 GiB free < "
        "cluster.preflight.min_free_memory_gb(100); pid 41234 uses 99.0 GiB",
    ]
    assert [ln for ln in lines if "GPU 7" not in ln] == expected
    lost = [ln for ln in lines if "GPU 7" in ln]  # fell off the bus: every query fails, each one is reported
    assert lost and all(ln.startswith(f"FAIL {where} GPU 7") and "NVMLError_GpuIsLost" in ln for ln in lost)


def test_nvlink_down_on_one_gpu_and_minimum_links():
    gpus = healthy()
    gpus[5].nvlinks = (1,) * 4 + (0,) + (1,) * 11 + (0, 0)
    assert findings(gpus) == [f"FAIL gpu-007 (het group 3, trainer) GPU 5 (00000000:68:00.0, {gpus[5].uuid}): nvlink: "
                              "15 active NVLinks, other GPUs of the node have 18 (inactive links: [4, 16, 17])"]
    pcie = [FakeGPU(name="NVIDIA H100 PCIe", nvlinks=UNSUPPORTED, memory_total=80 << 30) for _ in range(2)]
    r = node(pcie)
    assert r["gpus"][0]["nvlinks_active"] is None and r["gpus"][0]["errors"] == []  # NotSupported is not an error
    lines = [f.line() for f in check_node(r, NodeExpectation(num_gpus=2, gpu_memory_gb=141),
                                          PreflightConfig(min_nvlinks_per_gpu=18, gpu_name="H200"))]
    assert sum("0 active NVLinks < cluster.preflight.min_nvlinks_per_gpu(18)" in ln for ln in lines) == 2
    assert sum("'NVIDIA H100 PCIe' does not contain cluster.preflight.gpu_name='H200'" in ln for ln in lines) == 2
    assert sum("80.0 GiB total < cluster.gpu_memory_gb(141) x 0.95" in ln for ln in lines) == 2


def test_gpu_count_against_plan_and_cuda_visible_devices():
    assert findings(healthy(7)) == ["FAIL gpu-007 (het group 3, trainer): gpu_count: expected 8 GPU(s) "
                                    "(--gpus-per-node of het group 3), found 7 (NVML sees 7; CUDA_VISIBLE_DEVICES=None)"]
    r = node(healthy(), cuda_visible="2,3")
    assert [g["index"] for g in r["gpus"]] == [2, 3]
    nvml = FakeNVML(healthy(4))  # gives the GPUs their UUIDs
    r = collect_node(nvml, node="n", cuda_visible=f"{nvml.gpus[1].uuid},{nvml.gpus[3].uuid[:12]}", use_env=False)
    assert [g["index"] for g in r["gpus"]] == [1, 3]  # UUIDs and UUID prefixes, as CUDA accepts them
    assert visible_indices(4, "0,1,2,3") == [0, 1, 2, 3] and visible_indices(2, "4,5") == [0, 1]  # cgroup renumbering
    assert visible_indices(8, "") == [] and visible_indices(8, "1,-1,2") == [1] and visible_indices(3, None) == [0, 1, 2]


def test_no_driver_is_a_report_not_a_crash():
    r = node([], init_error=NVMLError_LibraryNotFound)
    assert r["gpus"] == [] and r["nvml_error"] == "NVML library not found (libnvidia-ml.so): no NVIDIA driver on this node"
    assert [f.line() for f in check_node(r, EIGHT, LIMITS)] == [
        "FAIL gpu-007 (het group 3, trainer): gpu_count: expected 8 GPU(s) (--gpus-per-node of het group 3), "
        "NVML: NVML library not found (libnvidia-ml.so): no NVIDIA driver on this node"]
    assert check_node(r, NodeExpectation(num_gpus=0), LIMITS) == []  # a CPU component's node
    standalone = check_node(r, NodeExpectation(num_gpus=None), LIMITS)
    assert [f.level for f in standalone] == ["warn"]
    assert node([], init_error=NVMLError_DriverNotLoaded)["nvml_error"].startswith("NVIDIA driver not loaded")


def test_old_bindings_bytes_names_and_throttle_api():
    r = node([FakeGPU(name=b"NVIDIA H200", clock_event_reasons=0x40)], driver=b"535.161.08", cuda=12020,
             old_throttle_api=True)
    assert r["driver_version"] == "535.161.08" and r["gpus"][0]["name"] == "NVIDIA H200"
    assert r["gpus"][0]["clock_event_reasons"] == ["hw_thermal_slowdown"]
    assert cuda_version_text(12080) == "12.8" and cuda_version_text(13000) == "13.0"


def test_versions_and_models_must_agree_across_nodes():
    reports = [node(healthy(2), name=f"gpu-00{i}") for i in range(3)]
    reports.append(node(healthy(2), name="gpu-009", driver="550.54.15", cuda=12040))
    reports.append(node([FakeGPU(name="NVIDIA H100 80GB HBM3")] * 2, name="gpu-010"))
    lines = [f.line() for f in check_versions(reports)]
    assert lines[0] == ("FAIL gpu-009: versions: NVIDIA driver differs across nodes: 570.124.06 on gpu-000, gpu-001, "
                        "gpu-002, gpu-010; 550.54.15 on gpu-009")
    assert lines[1].startswith("FAIL gpu-009: versions: CUDA driver version differs across nodes: 12.8 on")
    assert lines[2] == ("FAIL gpu-010: gpu_name: GPU model differs across nodes: NVIDIA H200 on gpu-000, gpu-001, gpu-002, "
                        "gpu-009; NVIDIA H100 80GB HBM3 on gpu-010")
    assert check_versions(reports[:3]) == []


def test_summary_report_leads_with_verdict_and_problems(tmp_path):
    gpus = healthy()
    gpus[6].ecc_uncorrected_volatile = 1
    r = node(gpus)
    found = check_node(r, EIGHT, LIMITS)
    s = summarize(node_reports=[r], findings=found, bandwidth={}, notes=["bandwidth: not measured (node checks failed)"])
    assert not s["ok"] and s["num_gpus"] == 8 and s["nodes"][0]["driver_version"] == "570.124.06"
    lines = report_lines(s, out_dir=tmp_path)
    assert lines[0] == "1 node(s), 8 GPU(s) checked: FAILED (1 problem(s))"
    assert lines[1].startswith("FAIL gpu-007 (het group 3, trainer) GPU 6 (00000000:78:00.0") and "ECC" in lines[1]
    assert lines[-1].startswith(f"report: {tmp_path}/summary.json")
    assert failed(found)


def test_limit_errors_name_the_key_and_choices():
    errors = limit_errors(PreflightConfig(collectives=["all_reduce", "reduce_scatter"], min_busbw_gbps={"allreduce": 1.0},
                                          fail_on_throttle=["hw_slowdwn"], expect_gpus_per_node={"trainers": 8},
                                          min_bytes=0), component_names=["control", "trainer"])
    assert errors[0].startswith("cluster.preflight.collectives has unknown names ['reduce_scatter']; choose from "
                                "['all_reduce', 'all_gather', 'alltoall', 'sendrecv']")
    assert "cluster.preflight.min_busbw_gbps has unknown names ['allreduce']" in errors[1]
    assert "cluster.preflight.fail_on_throttle has unknown names ['hw_slowdwn']" in errors[2]
    assert "cluster.preflight.expect_gpus_per_node has unknown names ['trainers']; choose from ['control', 'trainer']" in errors[3]
    assert "need 0 < cluster.preflight.min_bytes(0)" in errors[4]
    assert limit_errors(PreflightConfig(), component_names=[]) == []


def test_heartbeat_samples_visible_gpus_and_never_raises():
    gpus = healthy(4)
    for i, g in enumerate(gpus):
        g.memory_used, g.utilization, g.temperature_c = (10 + i) << 30, (50 + 10 * i, 20), 40 + i
    nvml = FakeNVML(gpus)
    beat = Heartbeat(nvml, cuda_visible="1,2", use_env=False)
    s = beat.sample()
    assert s["gpu_mem_used_gib"] == 12.0 and s["gpu_util_pct"] == 65.0 and s["gpu_temp_c"] == 42.0
    assert s["gpu1_mem_used_gib"] == 11.0 and s["gpu2_util_pct"] == 70.0 and "gpu0_mem_used_gib" not in s
    assert s["host_rss_gib"] > 0
    gpus[2].lost = True
    s = beat.sample()
    assert s["gpu_mem_used_gib"] == 11.0 and s["gpu_heartbeat_errors"] == 1.0
    beat.close()
    assert nvml.initialized == 0
    cpu = Heartbeat(FakeNVML([], init_error=NVMLError_LibraryNotFound), use_env=False)
    assert set(cpu.sample()) == {"host_rss_gib"} and "no NVIDIA driver" in cpu.unavailable
