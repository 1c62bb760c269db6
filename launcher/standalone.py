"""``slurmrl submit preflight|export|eval [SLURM OPTIONS] -- ARGS``: the standalone jobs, through submitit.

    slurmrl submit preflight --nodes 4 --cluster h200_ib -- --out checks/ --cluster h200_ib
    slurmrl submit export --partition cpu -- runs/x/weights/step_000020 exported/step_20
    slurmrl submit eval --gpus-per-node 8 -- runs/x/weights/step_000020 --k 4 --out eval.json

These jobs are homogeneous (N nodes, one task each, the same program), which is what submitit
does well: it writes the sbatch script, pickles the call, and gives back each task's result
or its traceback; its job state comes from the same batched sacct watcher ``slurmrl status
--all`` uses. The training run itself is a heterogeneous job (a group per role, each with its
own nodes, GPUs and memory) and submitit has no hetjobs, so that script is rendered by our
templates (sbatch_templates/) instead.

- ``preflight``: ``slurmrl-preflight standalone`` on every node (GPU checks, intra-node
  bandwidth), each into ``OUT/<node>/`` (``--out OUT`` among ARGS); the job fails if a node does.
- ``export``: ``python -m workers.weights.filesystem.resolve STEP_DIR OUT_DIR`` (a published
  step, delta steps included, as one self-contained Hugging Face directory).
- ``eval``: ``slurmrl-eval STEP_DIR ...`` (its own server on the node).

Slurm options come from a cluster profile (``--cluster NAME``: partition, account, qos, python,
cpus and GPUs per node) and then from the flags. ``--no-wait`` returns after submitting.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
CLUSTER_DIR = REPO / "hydra_conf" / "cluster"
KINDS = {
    "preflight": ("workers.preflight", ("standalone",)),
    "export": ("workers.weights.filesystem.resolve", ()),
    "eval": ("workers.orchestrator.evaluate_step", ()),
}
"""kind -> (module run with ``python -m``, its leading arguments)."""
TAIL_LINES = 40


@dataclasses.dataclass(frozen=True)
class Task:
    """What each task of the job runs (pickled by submitit, called on the node)."""

    module: str
    args: tuple[str, ...]
    per_node_out: bool = False
    """Give every node its own ``--out DIR/<node>`` (preflight: reports of one node each)."""

    def argv(self, node: str) -> list[str]:
        args = list(self.args)
        if self.per_node_out and "--out" in args:
            i = args.index("--out") + 1
            args[i] = str(Path(args[i]) / node)
        return [sys.executable, "-m", self.module, *args]

    def __call__(self) -> dict:
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # submitit's job environment has it too
        argv = self.argv(node)
        res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-TAIL_LINES:])
        if res.returncode != 0:
            raise RuntimeError(f"{node}: {' '.join(argv[1:])} exited with {res.returncode}:\n{tail}")
        return {"node": node, "returncode": res.returncode, "output": tail}


def profile_options(name: Optional[str]) -> dict:
    """Slurm settings of a cluster profile (hydra_conf/cluster/NAME.yaml) that a standalone job uses."""
    if not name:
        return {}
    from omegaconf import OmegaConf

    path = CLUSTER_DIR / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"slurmrl submit: no cluster profile {name!r}; choose one of "
                         f"{sorted(p.stem for p in CLUSTER_DIR.glob('*.yaml'))}")
    raw = OmegaConf.to_container(OmegaConf.load(path))
    if raw.get("backend", "slurm") != "slurm":
        raise SystemExit(f"slurmrl submit: cluster profile {name!r} has backend={raw['backend']}, not slurm")
    keys = ("partition", "account", "qos", "python", "num_cpus_per_node", "num_gpus_per_node", "setup")
    return {k: raw[k] for k in keys if raw.get(k) not in (None, "", [])}


def executor_parameters(a: argparse.Namespace, profile: dict) -> dict:
    """submitit SlurmExecutor parameters: one task per node, the node's CPUs (and GPUs) for it."""
    gpus = a.gpus_per_node if a.gpus_per_node is not None else profile.get("num_gpus_per_node", 0)
    params = {
        "job_name": f"slurmrl-{a.kind}", "nodes": a.nodes, "ntasks_per_node": 1,
        "cpus_per_task": a.cpus_per_task or profile.get("num_cpus_per_node", 1), "time": a.time_min,
        "partition": a.partition or profile.get("partition"), "account": profile.get("account"),
        "qos": profile.get("qos"), "gpus_per_node": gpus or None, "mem": a.mem,
        # the pickled Task lives in this repository: make it importable wherever sbatch starts
        "setup": [*profile.get("setup", []), f"export PYTHONPATH={shlex.quote(str(REPO))}${{PYTHONPATH:+:$PYTHONPATH}}"],
    }
    return {k: v for k, v in params.items() if v is not None}


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="slurmrl submit", description=__doc__.split("\n\n")[0],
                                epilog="ARGS after -- go to the program (preflight: slurmrl-preflight standalone; "
                                       "export: resolve STEP_DIR OUT_DIR; eval: slurmrl-eval).")
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("--nodes", type=int, default=1, help="nodes, one task each (export and eval: 1)")
    p.add_argument("--cluster", default=None, help="cluster profile for partition/account/qos/python (hydra_conf/cluster)")
    p.add_argument("--partition", default=None)
    p.add_argument("--cpus-per-task", type=int, default=None, help="default: the profile's num_cpus_per_node")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the profile's num_gpus_per_node")
    p.add_argument("--mem", default=None, help="e.g. 64G or 0 (the whole node)")
    p.add_argument("--time-min", type=int, default=60, help="time limit in minutes")
    p.add_argument("--folder", type=Path, default=Path("runs/standalone/%j"),
                   help="submitit's folder (script, pickles, logs); %%j becomes the job id")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    a = p.parse_args(argv)
    if a.nodes < 1 or a.time_min < 1:
        p.error(f"--nodes({a.nodes}) and --time-min({a.time_min}) must be >= 1")
    if a.kind != "preflight" and a.nodes != 1:
        p.error(f"--nodes={a.nodes}: {a.kind} runs on one node (preflight is the multi-node job)")
    if not rest:
        p.error(f"{a.kind} needs its arguments after --")
    return a, rest


def submit(a: argparse.Namespace, rest: list[str]):
    """Submit the job through submitit; returns the submitit Job."""
    import submitit

    profile = profile_options(a.cluster)
    module, lead = KINDS[a.kind]
    task = Task(module=module, args=(*lead, *rest), per_node_out=a.kind == "preflight")
    executor = submitit.SlurmExecutor(folder=a.folder, python=profile.get("python") or sys.executable)
    executor.update_parameters(**executor_parameters(a, profile))
    return executor.submit(task)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a, rest = parse(sys.argv[2:] if argv is None else argv)
    job = submit(a, rest)
    print(f"slurmrl submit {a.kind}: job {job.job_id} ({a.nodes} node(s)); submitit folder {job.paths.folder}",
          flush=True)
    if a.no_wait:
        return 0
    try:
        results = job.results()
    except Exception as e:  # submitit's FailedJobError / UncompletedJobError carry the task's traceback
        print(f"slurmrl submit {a.kind}: job {job.job_id} failed ({job.state}): {e}", file=sys.stderr)
        return 1
    for r in results:
        print(f"--- {r['node']} (exit {r['returncode']})\n{r['output']}")
    print(f"slurmrl submit {a.kind}: job {job.job_id} {job.state}")
    return 0
