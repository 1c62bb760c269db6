"""Preflight inside the slurmrl hetjob: run by the batch script before any role starts.

    "$SLURMRL_PYTHON" -m workers.preflight job --run-dir "$SLURMRL_RUN_DIR"

Protocol (every wait has the deadline ``cluster.preflight.timeout_s``):
1. Node checks: one ``srun --het-group=K`` step per het component, all at once, one task per
   node with the component's GPUs; each task writes ``preflight/node_g<K>_<node>.json`` with
   its facts and findings to the shared run dir. The batch shell waits for every step, then
   counts reports: a node without one failed (or the run dir is not on a shared filesystem).
2. Across nodes: NVIDIA driver, CUDA driver version and GPU model must agree.
3. Only when 1-2 passed: bandwidth per GPU component (CPU ones with benchmark_cpu_components),
   one component after another so they do not compete for the network. nccl-tests when
   ``nccl_tests_dir`` is set (srun steps started from here, output parsed here), else the
   built-in benchmark (one task per node spawning one process per GPU, meeting through a
   FileStore under preflight/).
4. ``preflight/summary.json`` and the printed report; exit status 1 stops the job.
The components come from ``config/plan.json`` (written by the launcher), the limits from
``config/run.yaml``: no Slurm variables are read here; srun finds the allocation itself.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

from workers.common.config import PreflightConfig, load_run_config
from workers.preflight import nccl_tests
from workers.preflight.bandwidth import CollectiveResult, evaluate
from workers.preflight.checks import (Finding, check_versions, failed, findings_of, print_report, read_node_reports,
                                      summarize, write_json)

KEY = "cluster.preflight"


def components(run_dir: Path) -> list[dict]:
    """The het components of the plan: index, name, num_nodes, num_gpus_per_node, ..."""
    return json.loads((Path(run_dir) / "config" / "plan.json").read_text())["components"]


def expected_gpus(comp: dict, limits: PreflightConfig) -> tuple[int, str]:
    if comp["name"] in limits.expect_gpus_per_node:
        return int(limits.expect_gpus_per_node[comp["name"]]), f"{KEY}.expect_gpus_per_node.{comp['name']}"
    return int(comp["num_gpus_per_node"]), f"--gpus-per-node of het group {comp['index']}"


def srun_flags(comp: dict, *, ntasks_per_node: int, cpus_per_task: int, name: str) -> list[str]:
    opts: dict[str, object] = {
        "het-group": comp["index"], "nodes": comp["num_nodes"], "ntasks": comp["num_nodes"] * ntasks_per_node,
        "ntasks-per-node": ntasks_per_node, "cpus-per-task": cpus_per_task, "exact": "", "kill-on-bad-exit": 0,
        "job-name": name, "export": "ALL,SLURMRL_ROLE=preflight",
    }
    if comp["num_gpus_per_node"]:
        opts["gpus-per-node"] = comp["num_gpus_per_node"]
    return [f"--{k}" if v == "" else f"--{k}={v}" for k, v in sorted(opts.items())]


class Step:
    """One srun started from the batch shell, with its own output file and a deadline."""

    def __init__(self, argv: list[str], out_path: Path):
        self.argv, self.out_path = argv, out_path
        with open(out_path, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait(self, deadline: float) -> Optional[int]:
        """Exit status, or None when it was still running at ``deadline`` (then it is stopped)."""
        try:
            return self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # srun forwards it to the tasks and ends the step
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            return None

    def tail(self, n: int = 3) -> str:
        lines = self.out_path.read_text(errors="replace").strip().splitlines()[-n:]
        return " | ".join(line.strip() for line in lines) or "no output"


def node_checks(run_dir: Path, comps: list[dict], limits: PreflightConfig, out_dir: Path) -> list[Finding]:
    log_dir = run_dir / "logs"
    steps = {}
    for c in comps:
        expect, source = expected_gpus(c, limits)
        args = ["node", "--run-dir", str(run_dir), "--out", str(out_dir), "--het-group", str(c["index"]),
                "--component", c["name"], "--expect-gpus", str(expect), "--expect-source", source, "--node"]
        log = shlex.quote(str(log_dir / f"preflight_g{c['index']}")) + '_"$SLURM_PROCID".log'
        cmd = (f"exec {shlex.join([sys.executable, '-m', 'workers.preflight', *args])} \"$SLURMD_NODENAME\" "
               f">>{log} 2>&1")
        argv = ["srun", *srun_flags(c, ntasks_per_node=1, cpus_per_task=1, name="preflight"), "bash", "-c", cmd]
        steps[c["index"]] = Step(argv, out_dir / f"srun_nodes_g{c['index']}.log")
    deadline = time.monotonic() + limits.timeout_s
    status = {k: s.wait(deadline) for k, s in steps.items()}
    reports = read_node_reports(out_dir)
    out = [f for r in reports for f in findings_of(r)]
    for c in comps:
        got = [r for r in reports if r.get("het_group") == c["index"]]
        if len(got) < c["num_nodes"]:
            rc = status[c["index"]]
            why = (f"still running after {limits.timeout_s:.0f}s ({KEY}.timeout_s)" if rc is None
                   else f"srun exit status {rc}: {steps[c['index']].tail()}")
            out.append(Finding("fail", "report", f"het group {c['index']} ({c['name']})", None,
                               f"{len(got)} of {c['num_nodes']} node reports arrived ({why}); task logs: "
                               f"{log_dir}/preflight_g{c['index']}_*.log; is the run dir on a shared filesystem?"))
    return out + check_versions(reports)


def bandwidth(run_dir: Path, comps: list[dict], limits: PreflightConfig, out_dir: Path
              ) -> tuple[dict[str, list[CollectiveResult]], list[Finding], list[str]]:
    results: dict[str, list[CollectiveResult]] = {}
    findings: list[Finding] = []
    notes = []
    for c in comps:
        gpus, nodes = c["num_gpus_per_node"], c["num_nodes"]
        ranks = nodes * (gpus or 1)
        if not gpus and not limits.benchmark_cpu_components:
            continue
        where = f"het group {c['index']} ({c['name']}, {nodes} node(s))"
        if ranks < 2:
            notes.append(f"bandwidth {where}: 1 rank, nothing to measure")
            continue
        if limits.nccl_tests_dir and gpus:
            got = [nccl_tests.run_test(nccl_tests.srun_command(limits, coll, het_group=c["index"], num_nodes=nodes,
                                                               gpus_per_node=gpus),
                                       coll, exe=nccl_tests.binary(limits, coll), timeout_s=limits.timeout_s,
                                       num_ranks=ranks) for coll in limits.collectives]
        else:
            got = builtin_benchmark(run_dir, c, limits, out_dir)
        write_json(out_dir / f"bandwidth_g{c['index']}.json", {"where": where, "results": [r.to_dict() for r in got]})
        key, thresholds = ((f"{KEY}.min_busbw_gbps", limits.min_busbw_gbps) if nodes > 1
                           else (f"{KEY}.min_busbw_gbps_intra_node", limits.min_busbw_gbps_intra_node))
        findings += [f for r in got for f in evaluate(r, where=where, thresholds=thresholds, threshold_key=key)]
        results[where] = got
    return results, findings, notes


def builtin_benchmark(run_dir: Path, c: dict, limits: PreflightConfig, out_dir: Path) -> list[CollectiveResult]:
    gpus, nodes, index = c["num_gpus_per_node"], c["num_nodes"], c["index"]
    store = out_dir / f"store_g{index}_{uuid.uuid4().hex[:8]}"  # fresh per attempt: a stale FileStore hangs
    result_path = out_dir / f".bench_g{index}.json"
    result_path.unlink(missing_ok=True)
    args = ["bench", "--run-dir", str(run_dir), "--num-nodes", str(nodes), "--nprocs", str(gpus or 1),
            "--device", "cuda" if gpus else "cpu", "--store", str(store), "--out", str(result_path), "--node-rank"]
    log = shlex.quote(str(run_dir / "logs" / f"preflight_bench_g{index}")) + '_"$SLURM_PROCID".log'
    cmd = f"exec {shlex.join([sys.executable, '-m', 'workers.preflight', *args])} \"$SLURM_PROCID\" >>{log} 2>&1"
    cpus = max(1, c["num_cpus_per_task"] * c["num_tasks_per_node"])
    argv = ["srun", *srun_flags(c, ntasks_per_node=1, cpus_per_task=cpus, name="preflight-bench"), "bash", "-c", cmd]
    step = Step(argv, out_dir / f"srun_bench_g{index}.log")
    rc = step.wait(time.monotonic() + limits.timeout_s)
    store.unlink(missing_ok=True)
    tool = "torch-nccl" if gpus else "torch-gloo"
    if rc != 0 or not result_path.exists():
        why = f"did not finish within {limits.timeout_s:.0f}s" if rc is None else f"srun exit status {rc}: {step.tail()}"
        return [CollectiveResult(coll, tool, nodes * (gpus or 1), error=f"{why}; logs: {run_dir}/logs/"
                                 f"preflight_bench_g{index}_*.log") for coll in limits.collectives]
    from workers.preflight.bench import read_results  # torch only where the benchmark ran

    return read_results(result_path)


def run_job(run_dir: Path) -> int:
    run_dir = Path(run_dir).resolve()
    cfg = load_run_config(str(run_dir / "config" / "run.yaml"))
    limits, comps = cfg.cluster.preflight, components(run_dir)
    out_dir = run_dir / "preflight"
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("node_*.json"):  # a requeued job checks its (new) nodes again
        old.unlink()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    findings = node_checks(run_dir, comps, limits, out_dir)
    results, notes = {}, [f"node checks took {time.monotonic() - t0:.1f}s"]
    if failed(findings):
        notes.append("bandwidth: not measured (node checks failed)")
    else:
        t1 = time.monotonic()
        results, more, bw_notes = bandwidth(run_dir, comps, limits, out_dir)
        findings += more
        notes += bw_notes + [f"bandwidth took {time.monotonic() - t1:.1f}s"]
    summary = summarize(node_reports=read_node_reports(out_dir), findings=findings, bandwidth=results, notes=notes)
    write_json(out_dir / "summary.json", summary)
    print_report(summary, out_dir=out_dir)
    return 0 if summary["ok"] else 1
