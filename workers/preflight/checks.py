"""Judge node reports (gpu.py) against the plan and the site limits (``cluster.preflight``); write the reports.

Pure functions from dicts to :class:`Finding` lists, so a report written on a compute node can
be judged again anywhere and tests need no GPU. A finding names the node, the GPU (index, PCI
bus id, UUID: what an admin needs to drain the right card) and the limit's config key with the
numbers, like the plan's errors do. ``fail`` stops the job; ``warn`` is printed and kept.

Outputs (``run_dir/preflight/`` in a job, ``--out DIR`` standalone)::

    node_g<K>_<node>.json   one node's NVML facts (gpu.py) + its findings
    bandwidth_g<K>.json     one component's collective results (bench.py or nccl_tests.py)
    summary.json            ok, every finding, per-node versions, bandwidth headlines

The printed report leads with the verdict, then one line per problem naming the node, the
GPU and the limit, so the batch log says what to drain without opening any JSON.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

from workers.common.config import PreflightConfig
from workers.preflight.limits import KEY, Finding, limit_errors  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from workers.preflight.bandwidth import CollectiveResult

HARMLESS_CLOCK_REASONS = {"gpu_idle", "applications_clocks_setting", "sync_boost", "display_clock_setting"}
MEMORY_TOLERANCE = 0.95
"""NVML's total memory may be a little under the marketing number (H200: 140.4 GiB for "141 GB")."""


@dataclasses.dataclass(frozen=True)
class NodeExpectation:
    """What the plan says about one node."""

    num_gpus: Optional[int]
    """GPUs the node must show; 0: a CPU node (no GPU checks); None: whatever NVML finds (standalone)."""
    source: str = "the plan"
    """Where num_gpus came from, for the message (``--gpus-per-node of het group 2``)."""
    gpu_memory_gb: float = 0.0
    """cluster.gpu_memory_gb (0: unchecked)."""


def where_of(report: dict) -> str:
    node = report.get("node", "?")
    if report.get("het_group") is None:
        return node
    return f"{node} (het group {report['het_group']}, {report.get('component', '?')})"


def gpu_label(gpu: dict) -> str:
    ids = ", ".join(str(x) for x in (gpu.get("pci_bus_id"), gpu.get("uuid")) if x)
    return f"GPU {gpu.get('index', '?')}" + (f" ({ids})" if ids else "")


def check_node(report: dict, expect: NodeExpectation, limits: PreflightConfig) -> list[Finding]:
    """Every problem of one node report."""
    where, out = where_of(report), []

    def add(level: str, check: str, message: str, gpu: Optional[dict] = None) -> None:
        out.append(Finding(level, check, where, gpu_label(gpu) if gpu is not None else None, message))

    gpus = report.get("gpus", [])
    if expect.num_gpus == 0:
        return out  # a CPU node: nothing to check, NVML may well be absent
    if expect.num_gpus is not None and len(gpus) != expect.num_gpus:
        seen = (f"NVML: {report['nvml_error']}" if report.get("nvml_error") and not gpus else
                f"found {len(gpus)} (NVML sees {report.get('num_gpus_nvml', 0)}; "
                f"CUDA_VISIBLE_DEVICES={report.get('cuda_visible_devices')})")
        add("fail", "gpu_count", f"expected {expect.num_gpus} GPU(s) ({expect.source}), {seen}")
    elif report.get("nvml_error"):  # some queries failed, or no GPU where none was required
        add("warn", "nvml", report["nvml_error"])
    for gpu in gpus:
        out += check_gpu(gpu, where, expect, limits)
    links = {g["index"]: g.get("nvlinks_active") for g in gpus if g.get("nvlinks_active") is not None}
    if len(set(links.values())) > 1:
        most = max(links.values())
        for gpu in gpus:
            n = links.get(gpu["index"])
            if n is not None and n < most:
                add("fail", "nvlink", f"{n} active NVLinks, other GPUs of the node have {most} "
                                      f"(inactive links: {gpu.get('nvlinks_inactive')})", gpu)
    return out


def check_gpu(gpu: dict, where: str, expect: NodeExpectation, limits: PreflightConfig) -> list[Finding]:
    out = []

    def add(level: str, check: str, message: str) -> None:
        out.append(Finding(level, check, where, gpu_label(gpu), message))

    for err in gpu.get("errors", ()):
        add("fail" if "GpuIsLost" in err else "warn", "nvml", err)  # others: often a container's NVML
    name = gpu.get("name")
    if limits.gpu_name and limits.gpu_name not in str(name):
        add("fail", "gpu_name", f"{name!r} does not contain {KEY}.gpu_name={limits.gpu_name!r}")
    total, free = gpu.get("memory_total_gib"), gpu.get("memory_free_gib")
    if expect.gpu_memory_gb and total is not None and total < MEMORY_TOLERANCE * expect.gpu_memory_gb:
        add("fail", "memory", f"{total:.1f} GiB total < cluster.gpu_memory_gb({expect.gpu_memory_gb:g}) x "
                              f"{MEMORY_TOLERANCE}: the plan's memory estimates assume a larger GPU")
    if limits.min_free_memory_gb and free is not None and free < limits.min_free_memory_gb:
        procs = ", ".join(f"pid {p['pid']} uses {p['used_gib']:.1f} GiB" for p in gpu.get("processes") or ())
        add("fail", "memory", f"{free:.1f} GiB free < {KEY}.min_free_memory_gb({limits.min_free_memory_gb:g})"
                              + (f"; {procs}" if procs else ""))
    ecc = gpu.get("ecc_uncorrected_volatile")
    if ecc is not None and ecc > limits.max_uncorrected_ecc_errors:
        add("fail", "ecc", f"{ecc} uncorrected ECC errors since the last reset > "
                           f"{KEY}.max_uncorrected_ecc_errors({limits.max_uncorrected_ecc_errors})")
    agg = gpu.get("ecc_uncorrected_aggregate")
    if agg and (ecc is None or agg > ecc):
        add("warn", "ecc", f"{agg} uncorrected ECC errors over the GPU's lifetime")
    pages = gpu.get("retired_pages")
    if pages is not None and pages > limits.max_retired_pages:
        add("fail", "retired_pages", f"{pages} retired pages > {KEY}.max_retired_pages({limits.max_retired_pages})")
    if gpu.get("retired_pages_pending"):
        add("fail", "retired_pages", "a page retirement is pending: reset the GPU (nvidia-smi -r) before use")
    if gpu.get("row_remap_failed"):
        add("fail", "row_remap", "a row remapping failed: the GPU needs replacing (RMA)")
    elif gpu.get("row_remap_pending"):
        add("fail", "row_remap", "a row remapping is pending: reset the GPU (nvidia-smi -r) before use")
    if gpu.get("remapped_rows_uncorrectable"):
        add("warn", "row_remap", f"{gpu['remapped_rows_uncorrectable']} rows remapped after uncorrectable errors")
    reasons = gpu.get("clock_event_reasons") or []
    bad = [r for r in reasons if r in limits.fail_on_throttle]
    if bad:
        add("fail", "clocks", f"clocks held down by {', '.join(bad)} ({KEY}.fail_on_throttle)")
    odd = [r for r in reasons if r not in bad and r not in HARMLESS_CLOCK_REASONS]
    if odd:
        add("warn", "clocks", f"clocks held down by {', '.join(odd)}")
    active = gpu.get("nvlinks_active")
    if limits.min_nvlinks_per_gpu and (active or 0) < limits.min_nvlinks_per_gpu:
        add("fail", "nvlink", f"{active or 0} active NVLinks < {KEY}.min_nvlinks_per_gpu({limits.min_nvlinks_per_gpu})"
                              f" (inactive links: {gpu.get('nvlinks_inactive')})")
    return out


def check_versions(reports: Iterable[dict]) -> list[Finding]:
    """Driver version, CUDA driver version and GPU name must agree across the job's GPU nodes."""
    reports = [r for r in reports if r.get("gpus")]
    out = []
    for key, what in (("driver_version", "NVIDIA driver"), ("cuda_driver_version", "CUDA driver version")):
        out += _disagreement(what, key, {r.get("node", "?"): r.get(key) for r in reports})
    names = {r.get("node", "?"): "/".join(sorted({str(g.get("name")) for g in r["gpus"]})) for r in reports}
    out += _disagreement("GPU model", "gpu_name", names)
    return out


def _disagreement(what: str, check: str, by_node: dict[str, Any]) -> list[Finding]:
    groups: dict[Any, list[str]] = defaultdict(list)
    for node, value in sorted(by_node.items()):
        groups[value].append(node)
    if len(groups) <= 1:
        return []
    detail = "; ".join(f"{value} on {', '.join(nodes)}" for value, nodes in
                       sorted(groups.items(), key=lambda kv: (-len(kv[1]), str(kv[0]))))
    minority = min(groups.values(), key=len)
    return [Finding("fail", "versions" if check != "gpu_name" else check, ", ".join(minority), None,
                    f"{what} differs across nodes: {detail}")]


def failed(findings: Iterable[Finding]) -> bool:
    return any(f.level == "fail" for f in findings)


# --- reports -------------------------------------------------------------------------------------
PREFIX = "[preflight]"


def write_json(path: Path, obj: object) -> None:
    """Written to a temp name and renamed: a reader on another node never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


def node_report_path(out_dir: Path, node: str, het_group: Optional[int]) -> Path:
    group = "" if het_group is None else f"g{het_group}_"
    return Path(out_dir) / f"node_{group}{node}.json"


def read_node_reports(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("node_*.json"))]


def findings_of(report: dict) -> list[Finding]:
    return [Finding(**f) for f in report.get("findings", [])]


def summarize(*, node_reports: list[dict], findings: Iterable[Finding], bandwidth: dict[str, list["CollectiveResult"]],
              notes: Iterable[str] = ()) -> dict:
    findings = list(findings)
    return {
        "ok": not failed(findings),
        "time": time.time(),
        "num_nodes": len(node_reports),
        "num_gpus": sum(len(r.get("gpus", [])) for r in node_reports),
        "findings": [dataclasses.asdict(f) for f in findings],
        "nodes": [{"node": r.get("node"), "het_group": r.get("het_group"), "component": r.get("component"),
                   "num_gpus": len(r.get("gpus", [])), "gpu_names": sorted({str(g.get("name")) for g in r.get("gpus", [])}),
                   "driver_version": r.get("driver_version"), "cuda_driver_version": r.get("cuda_driver_version"),
                   "ok": not failed(findings_of(r))} for r in node_reports],
        "bandwidth": {where: [r.headline() for r in results] for where, results in bandwidth.items()},
        "notes": list(notes),
    }


def report_lines(summary: dict, *, out_dir: Path) -> list[str]:
    findings = [Finding(**f) for f in summary["findings"]]
    problems = [f for f in findings if f.level == "fail"]
    verdict = "OK" if summary["ok"] else f"FAILED ({len(problems)} problem(s))"
    lines = [f"{summary['num_nodes']} node(s), {summary['num_gpus']} GPU(s) checked: {verdict}"]
    lines += [f.line() for f in problems]
    lines += [f.line() for f in findings if f.level != "fail"]
    versions = sorted({(n["driver_version"], n["cuda_driver_version"]) for n in summary["nodes"] if n["num_gpus"]})
    if versions:
        lines.append("driver / CUDA: " + "; ".join(f"{d} / {c}" for d, c in versions))
    for where, heads in summary["bandwidth"].items():
        lines += [f"bandwidth {where}: {h}" for h in heads]
    lines += list(summary.get("notes", ()))
    lines.append(f"report: {Path(out_dir) / 'summary.json'} (per node: {Path(out_dir)}/node_*.json)")
    return lines


def print_report(summary: dict, *, out_dir: Path) -> None:
    for line in report_lines(summary, out_dir=out_dir):
        print(f"{PREFIX} {line}", flush=True)
