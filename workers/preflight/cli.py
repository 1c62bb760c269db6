"""``slurmrl-preflight`` / ``python -m workers.preflight``: the preflight commands.

    slurmrl-preflight standalone --out DIR [--cluster h200_ib | --run-config RUN/config/run.yaml]
                                 [--expect-gpus N] [key=value ...]     # this machine, no Slurm
    slurmrl-preflight job --run-dir RUN                                # batch script of the hetjob
    slurmrl-preflight node --run-dir RUN --het-group K ... --node NAME # one node's task (job step)
    slurmrl-preflight bench --run-dir RUN --node-rank R ...            # one node's benchmark task

Across N Slurm nodes without a training job: ``slurmrl submit preflight --nodes N -- --out DIR``
(launcher/standalone.py, through submitit: ``standalone`` on every node, into ``DIR/<node>/``).

Exit status: 0 all checks passed, 1 a check failed (the report says which), 2 usage errors.
``key=value`` overrides set fields of cluster.preflight (``max_bytes=67108864``,
``min_busbw_gbps_intra_node.all_reduce=300``).

``standalone`` checks this one machine without Slurm (a GPU node before it joins a
partition, a laptop, a CI box): the NVML node checks, then the bandwidth of its GPUs
(nccl-tests with -g N when ``nccl_tests_dir`` is set, else the built-in benchmark with one
process per GPU over NCCL), judged against ``min_busbw_gbps_intra_node``. Without a GPU the
built-in benchmark runs 2 gloo processes and caps messages at 4 MiB (gloo over loopback
measures the CPU, not a link, so 1 GiB buffers would only cost time).

Limits come from PreflightConfig's defaults, a site profile (``--cluster h200_ib`` reads
hydra_conf/cluster/h200_ib.yaml), or a resolved ``--run-config run.yaml``, then ``key=value``
overrides of cluster.preflight fields. Writes node_<host>.json, bandwidth.json, summary.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from workers.common.config import PreflightConfig, load_run_config
from workers.preflight import nccl_tests
from workers.preflight.bandwidth import CollectiveResult, evaluate
from workers.preflight.checks import (PREFIX, NodeExpectation, check_node, failed, node_report_path, print_report,
                                      summarize, write_json)
from workers.preflight.gpu import collect_node


CLUSTER_DIR = Path(__file__).resolve().parents[2] / "hydra_conf" / "cluster"
CPU_MAX_BYTES = 4 << 20
CPU_NPROCS = 2
KEY = "cluster.preflight.min_busbw_gbps_intra_node"


def load_limits(*, cluster: Optional[str], run_config: Optional[str], overrides: list[str]) -> tuple[PreflightConfig, float]:
    """(preflight limits, cluster.gpu_memory_gb) from a profile or run config plus ``key=value`` overrides."""
    if run_config:
        c = load_run_config(run_config).cluster
        base = OmegaConf.structured(c.preflight)
        memory = c.gpu_memory_gb
    elif cluster:
        path = CLUSTER_DIR / f"{cluster}.yaml"
        if not path.exists():
            names = sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))
            raise SystemExit(f"slurmrl-preflight: no cluster profile {cluster!r}; choose one of {names}")
        raw = OmegaConf.load(path)
        base = OmegaConf.merge(OmegaConf.structured(PreflightConfig), raw.get("preflight", {}))
        memory = float(raw.get("gpu_memory_gb", 0.0))
    else:
        base, memory = OmegaConf.structured(PreflightConfig), 0.0
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise SystemExit(f"slurmrl-preflight: overrides must be key=value (fields of cluster.preflight), got {bad}")
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))
    return OmegaConf.to_object(merged), memory  # type: ignore[return-value]


def run_standalone(out_dir: Path, limits: PreflightConfig, *, gpu_memory_gb: float = 0.0,
                   expect_gpus: Optional[int] = None, nvml=None, use_env: bool = True) -> int:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    node = socket.gethostname()
    t0 = time.monotonic()
    report = collect_node(nvml, node=node, use_env=use_env)
    source = "--expect-gpus" if expect_gpus is not None else "NVML"
    findings = check_node(report, NodeExpectation(num_gpus=expect_gpus, source=source, gpu_memory_gb=gpu_memory_gb),
                          limits)
    report["findings"] = [dataclasses.asdict(f) for f in findings]
    write_json(node_report_path(out_dir, node, None), report)
    notes = [f"node checks took {time.monotonic() - t0:.1f}s"]
    results: dict[str, list[CollectiveResult]] = {}
    if failed(findings):
        notes.append("bandwidth: not measured (node checks failed)")
    else:
        t1 = time.monotonic()
        gpus = len(report["gpus"])
        got = local_bandwidth(limits, gpus, notes)
        where = f"{node} ({gpus} GPU(s))" if gpus else f"{node} (CPU, gloo)"
        write_json(out_dir / "bandwidth.json", {"where": where, "results": [r.to_dict() for r in got]})
        findings += [f for r in got for f in evaluate(r, where=where, thresholds=limits.min_busbw_gbps_intra_node,
                                                      threshold_key=KEY)]
        results[where] = got
        notes.append(f"bandwidth took {time.monotonic() - t1:.1f}s")
    summary = summarize(node_reports=[report], findings=findings, bandwidth=results, notes=notes)
    write_json(out_dir / "summary.json", summary)
    print_report(summary, out_dir=out_dir)
    return 0 if summary["ok"] else 1


def local_bandwidth(limits: PreflightConfig, num_gpus: int, notes: list[str]) -> list[CollectiveResult]:
    if limits.nccl_tests_dir and num_gpus:
        return [nccl_tests.run_test(nccl_tests.local_command(limits, c, num_gpus), c, exe=nccl_tests.binary(limits, c),
                                    timeout_s=limits.timeout_s, num_ranks=num_gpus) for c in limits.collectives]
    from workers.preflight import bench  # imports torch

    max_bytes, nprocs, device = limits.max_bytes, num_gpus, "cuda"
    if not num_gpus:
        max_bytes, nprocs, device = min(limits.max_bytes, CPU_MAX_BYTES), CPU_NPROCS, "cpu"
        if max_bytes < limits.max_bytes:
            notes.append(f"CPU (gloo): message sizes capped at {CPU_MAX_BYTES >> 20} MiB")
    sizes = bench.message_sizes(min(limits.min_bytes, max_bytes), max_bytes, limits.size_factor)
    with tempfile.TemporaryDirectory(prefix="slurmrl-preflight-") as tmp:
        out = Path(tmp) / "bench.json"
        try:
            bench.run_node(node_rank=0, num_nodes=1, nprocs=nprocs, store=str(Path(tmp) / "store"), out=str(out),
                           collectives=list(limits.collectives), sizes=sizes, iters=limits.num_iters,
                           warmup=limits.num_warmup_iters, device=device, timeout_s=limits.timeout_s)
            return bench.read_results(out)
        except Exception as e:  # a rank died: report it like a failed nccl-tests run
            tool = f"torch-{'nccl' if device == 'cuda' else 'gloo'}"
            return [CollectiveResult(c, tool, nprocs, error=f"benchmark failed: {type(e).__name__}: "
                                     f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}")
                    for c in limits.collectives]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slurmrl-preflight", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="GPU health (NVML) and collective bandwidth checks before a slurmrl job; "
                                            "see docs/preflight.md",
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("standalone", help="check this machine's GPUs and their bandwidth, without Slurm")
    s.add_argument("--out", required=True, help="directory for node_<host>.json, bandwidth.json, summary.json")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--cluster", help="site profile whose preflight limits apply (hydra_conf/cluster/NAME.yaml)")
    src.add_argument("--run-config", help="a resolved run.yaml whose cluster.preflight limits apply")
    s.add_argument("--expect-gpus", type=int, default=None, help="GPUs this machine must show (default: any)")
    s.add_argument("overrides", nargs="*", help="key=value overrides of cluster.preflight fields")
    j = sub.add_parser("job", help="inside the hetjob's batch script: check every node, then bandwidth")
    j.add_argument("--run-dir", required=True)
    n = sub.add_parser("node", help="one node's checks (a task of the preflight step)")
    n.add_argument("--run-dir", required=True)
    n.add_argument("--out", required=True)
    n.add_argument("--het-group", type=int, required=True)
    n.add_argument("--component", required=True)
    n.add_argument("--expect-gpus", type=int, required=True)
    n.add_argument("--expect-source", default="the plan")
    n.add_argument("--node", required=True, help="this task's Slurm node name ($SLURMD_NODENAME)")
    b = sub.add_parser("bench", help="one node's share of the built-in benchmark (a task of the bench step)")
    b.add_argument("--run-dir", required=True)
    b.add_argument("--node-rank", type=int, required=True, help="this node's index in the step ($SLURM_PROCID)")
    b.add_argument("--num-nodes", type=int, required=True)
    b.add_argument("--nprocs", type=int, required=True, help="processes on this node (one per GPU)")
    b.add_argument("--device", choices=("cuda", "cpu"), required=True)
    b.add_argument("--store", required=True, help="FileStore path on the shared run dir (fresh per run)")
    b.add_argument("--out", required=True, help="results JSON (written by global rank 0)")
    return p


def node_main(args: argparse.Namespace) -> int:
    cfg = load_run_config(str(Path(args.run_dir) / "config" / "run.yaml"))
    report = collect_node(node=args.node)
    report.update(het_group=args.het_group, component=args.component)
    findings = check_node(report, NodeExpectation(num_gpus=args.expect_gpus, source=args.expect_source,
                                                  gpu_memory_gb=cfg.cluster.gpu_memory_gb), cfg.cluster.preflight)
    report["findings"] = [dataclasses.asdict(f) for f in findings]
    write_json(node_report_path(Path(args.out), args.node, args.het_group), report)
    print(f"{PREFIX} {args.node}: {len(report['gpus'])} GPU(s), {len(findings)} finding(s)"
          + "".join(f"\n{PREFIX}   {f.line()}" for f in findings), flush=True)
    return 1 if failed(findings) else 0


def bench_main(args: argparse.Namespace) -> int:
    from workers.preflight import bench  # imports torch

    limits = load_run_config(str(Path(args.run_dir) / "config" / "run.yaml")).cluster.preflight
    sizes = bench.message_sizes(limits.min_bytes, limits.max_bytes, limits.size_factor)
    bench.run_node(node_rank=args.node_rank, num_nodes=args.num_nodes, nprocs=args.nprocs, store=args.store,
                   out=args.out, collectives=list(limits.collectives), sizes=sizes, iters=limits.num_iters,
                   warmup=limits.num_warmup_iters, device=args.device, timeout_s=limits.timeout_s)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "standalone":
        limits, memory = load_limits(cluster=args.cluster, run_config=args.run_config, overrides=args.overrides)
        return run_standalone(Path(args.out), limits, gpu_memory_gb=memory, expect_gpus=args.expect_gpus)
    if args.command == "job":
        from workers.preflight.job import run_job

        return run_job(Path(args.run_dir))
    if args.command == "node":
        return node_main(args)
    return bench_main(args)


def console_main() -> None:
    sys.exit(main())
