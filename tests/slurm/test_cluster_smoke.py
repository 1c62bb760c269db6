"""Smoke tests of the local Slurm cluster: the hetjob behaviour slurmrl relies on.

Facts these tests pin down (Slurm 22.05, see tests/slurm/README.md):
- sbatch --parsable prints the leader id L; components are separate jobs L, L+1, ...
  (SLURM_JOB_ID_HET_GROUP_K) that sacct shows as "L+K".
- Step numbers are shared by the whole hetjob: group K's step is "L+K.S" in sacct and
  "<SLURM_JOB_ID_HET_GROUP_K>.S" for scancel/squeue, with S in launch order, not K.
- sacct lags slurmctld by 1-5 s (components show up late): poll it.
"""

import os
import signal
import subprocess
import time

import pytest

from tests.slurm.conftest import ACTIVE, wait_until

pytestmark = pytest.mark.slurm



def sh(*cmd, timeout=30):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res.stdout


def sbatch(script):
    # --parsable prints "id" or "id;cluster".
    return int(sh("sbatch", "--parsable", str(script)).strip().split(";")[0])


def components(jobid):
    """scontrol's fields of every het component (one "JobId=" record each), in order."""
    out = sh("scontrol", "show", "job", "-o", str(jobid))
    recs = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.splitlines()]
    return sorted(recs, key=lambda r: int(r.get("HetJobOffset", 0)))


def component_states(jobid):
    return [r["JobState"] for r in components(jobid)]


def sacct(jobid):
    out = sh("sacct", "-j", str(jobid), "--format=JobID,State", "-P", "-n")
    return dict(line.split("|", 1) for line in out.splitlines() if line)


def sacct_final(jobid, nsteps=None):
    """sacct rows once every part (and nsteps srun steps) is recorded in a final state."""
    rows = sacct(jobid)
    parts = [f"{jobid}+{k}" for k in range(len(GROUPS))]
    steps = [r for r in rows if "." in r and not r.endswith((".batch", ".extern"))]
    if not all(p in rows for p in parts) or f"{jobid}+0.batch" not in rows:
        return None  # right after the job ends sacct may still show just "L"
    if nsteps is not None and len(steps) != nsteps:
        return None
    return None if ACTIVE.intersection(rows.values()) else rows


def cancel_on_failure(jobid):
    subprocess.run(["scancel", str(jobid)], capture_output=True, timeout=30)


def read_env(path):
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


# Three components of different shapes: 1 task, 2 tasks on 1 node, 2 tasks on 2 nodes.
GROUPS = [("-N1 -n1", 1), ("-N1 -n2", 2), ("-N2 -n2", 2)]


def hetjob_header(name, out_dir):
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name} --output={out_dir}/batch-%j.out"]
    for k, (shape, _) in enumerate(GROUPS):
        if k:
            lines.append("#SBATCH hetjob")
        lines.append(f"#SBATCH {shape}")
    return "\n".join(lines) + "\n"


def test_hetjob_three_components_complete(slurm_cluster, tmp_path):
    # Tasks write their env to files: srun --output patterns break in groups > 0, and
    # no env var names the task's own het group, so the script passes K explicitly.
    script = tmp_path / "het.sh"
    script.write_text(hetjob_header("smoke-het", tmp_path) + f"""
for k in 0 1 2; do
  srun --het-group=$k bash -c "env | grep ^SLURM_ > {tmp_path}/g${{k}}_\\$SLURM_PROCID.env" &
done
wait
""")
    jobid = sbatch(script)
    try:
        wait_until("the hetjob to finish", 60,
                   lambda: not ACTIVE.intersection(component_states(jobid)))
    except BaseException:
        cancel_on_failure(jobid)
        raise
    comps = components(jobid)
    assert [c["JobState"] for c in comps] == ["COMPLETED"] * 3, \
        (tmp_path / f"batch-{jobid}.out").read_text()

    rows = wait_until("sacct to record all parts", 30, lambda: sacct_final(jobid, nsteps=3))
    assert set(rows.values()) == {"COMPLETED"}, rows

    for k, (_, ntasks) in enumerate(GROUPS):
        envs = [read_env(tmp_path / f"g{k}_{rank}.env") for rank in range(ntasks)]
        for env in envs:
            assert env["SLURM_HET_SIZE"] == "3"
            assert env["SLURM_JOB_ID"] == str(jobid)  # the leader's, in every group
            # The group's own allocation is both the plain and the indexed variable.
            assert env["SLURM_JOB_NODELIST"] == env[f"SLURM_JOB_NODELIST_HET_GROUP_{k}"]
            assert env["SLURM_NTASKS"] == str(ntasks)
            assert env[f"SLURM_JOB_NODELIST_HET_GROUP_{k}"] == comps[k]["NodeList"]
            assert env[f"SLURM_JOB_ID_HET_GROUP_{k}"] == comps[k]["JobId"]
        assert sorted(int(e["SLURM_PROCID"]) for e in envs) == list(range(ntasks))


@pytest.mark.parametrize("how", ["scancel_step", "kill_task"])
def test_hetjob_one_failing_step_ends_job(slurm_cluster, tmp_path, how):
    # The pattern slurmrl uses: each group is one srun; the first to end, for any reason,
    # makes the batch script exit, and its EXIT trap stops the other sruns.
    script = tmp_path / "kill.sh"
    script.write_text(hetjob_header("smoke-kill", tmp_path) + f"""
pids=()
trap 'kill "${{pids[@]}}" 2>/dev/null; wait' EXIT
trap 'exit 143' TERM
for k in 0 1 2; do
  srun --het-group=$k --kill-on-bad-exit=1 bash -c \\
    'echo "$$ $SLURM_JOB_ID_HET_GROUP_'$k'.$SLURM_STEP_ID" > {tmp_path}/pid_'$k'_$SLURM_PROCID; exec sleep 600' &
  pids+=($!)
done
wait -n
echo "a step ended (rc=$?), stopping the rest"
exit 1
""")
    jobid = sbatch(script)
    try:
        pidfiles = [tmp_path / f"pid_{k}_{r}" for k, (_, n) in enumerate(GROUPS) for r in range(n)]
        wait_until("all tasks to start", 60,
                   lambda: all(p.exists() and p.read_text().strip() for p in pidfiles))
        tasks = {p.name: p.read_text().split() for p in pidfiles}  # name -> [pid, step]
        assert set(component_states(jobid)) == {"RUNNING"}

        victim_pid, victim_step = tasks["pid_1_0"]
        if how == "scancel_step":
            # The component's own id: "L+1.S" cancels too but scancel then exits non-zero.
            sh("scancel", victim_step)
        else:
            os.kill(int(victim_pid), signal.SIGKILL)
        t0 = time.monotonic()
        wait_until("the whole hetjob to stop running", 30,
                   lambda: "RUNNING" not in component_states(jobid))
        elapsed = time.monotonic() - t0
    except BaseException:
        cancel_on_failure(jobid)
        raise

    def gone(pid):
        # Zombies count as gone: orphans wait for PID 1, which may reap them late.
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
        except FileNotFoundError:
            return True

    # All nodes are this host, so every task's process must be gone too.
    wait_until("all task processes to exit", 30, lambda: all(gone(p) for p, _ in tasks.values()))
    rows = wait_until("sacct to record all parts", 30, lambda: sacct_final(jobid))
    assert "COMPLETED" not in rows.values(), rows
    assert elapsed < 30
