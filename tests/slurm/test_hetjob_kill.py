"""With cluster.server_respawns=0, killing one component's step ends the whole slurmrl hetjob
promptly, with no process left.

The job is submitted with launcher.follow=false and a step count it would take minutes to
finish; once training runs, one inference worker is hit: either its step is cancelled with
scancel (what an admin or a node failure does) or its process is SIGKILLed (an OOM kill).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher import submit
from tests.slurm.conftest import wait_until
from tests.slurm.conftest import SMALL, sacct_final, slurmrl

pytestmark = pytest.mark.slurm


def processes_of(run_dir: Path) -> dict[int, dict[str, str]]:
    """Live (non-zombie) processes whose environment points at run_dir, by PID: ours only."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if env.get("SLURMRL_RUN_DIR") == str(run_dir) and state not in "ZX":
            found[int(entry.name)] = env
    return found


def wait_for_training(run_dir: Path, job_id: str, num_steps: int = 1, timeout: float = 120) -> None:
    """Until metrics.jsonl has num_steps records; fail at once (with the batch log) if the job ended."""
    metrics = run_dir / "metrics.jsonl"
    log = run_dir / "logs" / f"slurm-{job_id}.out"

    def probe():
        if metrics.exists() and len(metrics.read_text().splitlines()) >= num_steps:
            return True
        if not any(c.state in submit.ACTIVE for c in submit.components(job_id)):
            pytest.fail(f"job {job_id} ended before {num_steps} trainer steps:\n{log.read_text()[-3000:]}", pytrace=False)
        return False

    wait_until(f"{num_steps} trainer steps", timeout, probe)


@pytest.mark.parametrize("how", ["scancel_step", "kill_task"])
def test_killing_one_step_ends_the_job(slurm_cluster, tmp_path, how):
    run_dir = tmp_path / "run"
    res = slurmrl(["cluster=local_slurm", *SMALL, "trainer.num_steps=1000", "launcher.follow=false",
                   "cluster.server_respawns=0",  # fail-fast (test_server_respawn.py: the respawn)
                   f"launcher.run_dir={run_dir}"], tmp_path, timeout=120)
    assert res.returncode == 0
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    try:
        wait_for_training(run_dir, job_id, num_steps=2)
        comps = submit.components(job_id)
        assert [c.state for c in comps] == ["RUNNING"] * 3
        if how == "scancel_step":
            # Steps are named by the component's own id ("<L+1>.S"; "L+1.S" cancels but scancel exits 225).
            steps = subprocess.run(["squeue", "-h", "-s", "-j", comps[1].job_id, "-o", "%i %j"], capture_output=True,
                                   text=True, timeout=30).stdout.split("\n")
            (step,) = [s.split()[0] for s in steps if s.endswith(" inference")]
            subprocess.run(["scancel", step], check=True, timeout=30)
        else:
            victims = [p for p, env in processes_of(run_dir).items()
                       if env.get("SLURMRL_ROLE") == "inference" and env.get("SLURM_PROCID") == "1"]
            assert len(victims) == 1, victims
            os.kill(victims[0], signal.SIGKILL)
        t0 = time.monotonic()
        wait_until("the whole hetjob to end", 60,
                   lambda: not any(c.state in submit.ACTIVE for c in submit.components(job_id)))
        elapsed = time.monotonic() - t0
    except BaseException:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        raise
    wait_until("every process of the run to exit", 30, lambda: not processes_of(run_dir))
    rows = sacct_final(job_id, num_parts=3, num_steps=3)
    assert rows[f"{job_id}+0"] == "FAILED" and "COMPLETED" not in {rows[f"{job_id}+{k}"] for k in range(3)}, rows
    log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "inference exited with status" in log and "a role failed: stopping the whole job" in log, log
    assert elapsed < 30, f"the job took {elapsed:.1f}s to end after the step died"
    print(f"{how}: job ended {elapsed:.1f}s after the kill")
