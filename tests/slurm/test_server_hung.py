"""A hung inference server on Slurm (alive, not answering) is killed as its srun step and respawned.

Issue 35 item 4 on the real cluster: one of the two embedded servers is SIGSTOPped mid-run. The
orchestrator marks it dead (health checks) and lists it in ``run_dir/inference_health.json``; after
``launcher.hung_worker_kill_s`` the Slurm supervisor (launcher/supervisor.py ``kill_hung``) finds the
server step by name with ``squeue -s`` and ends it with ``scancel --signal=KILL`` (a stopped process
still dies of SIGKILL), then respawns it like any failed server step. The run ends COMPLETED with every
group trained once. tests/integration/test_hung_worker.py covers the local backend and the
supervisor's fallback (killing srun itself) without Slurm.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from benchmarks.chaos import measure
from launcher import submit
from tests.slurm.conftest import SMALL, sacct, slurmrl, wait_until
from tests.slurm.test_hetjob_kill import wait_for_training

pytestmark = pytest.mark.slurm
NUM_STEPS = 16


def server_pid(run_dir: Path, procid: int) -> int:
    """The PID of this run's inference server task ``procid`` (every virtual node is this host)."""
    want = {f"SLURMRL_RUN_DIR={run_dir}".encode(), b"SLURMRL_ROLE=inference", f"SLURM_PROCID={procid}".encode()}
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd, env = (p / "cmdline").read_bytes(), set((p / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if b"workers.inference" in cmd and want <= env:
            found.append(int(p.name))
    assert len(found) == 1, f"server task {procid} of {run_dir}: {found}"
    return found[0]


def test_a_sigstopped_server_is_killed_as_its_step_and_respawned(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    res = slurmrl(["cluster=local_slurm", *SMALL, f"trainer.num_steps={NUM_STEPS}", "launcher.follow=false",
                   f"launcher.run_dir={run_dir}", "cluster.respawn_backoff_s=1", "trainer.simulated_step_delay_s=1.5",
                   "launcher.hung_worker_kill_s=3", "orchestrator.max_off_policy_steps=1"], tmp_path, timeout=120)
    assert res.returncode == 0
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    log = run_dir / "logs" / f"slurm-{job_id}.out"
    stopped = None
    try:
        wait_for_training(run_dir, job_id, num_steps=2)
        stopped = server_pid(run_dir, 1)
        t_stop = time.time()
        os.kill(stopped, signal.SIGSTOP)
        wait_until("the job to end", 300, lambda: not any(c.state in submit.ACTIVE for c in submit.components(job_id)))
    except BaseException:
        import subprocess

        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        print(log.read_text()[-4000:] if log.exists() else "(no batch log)")
        raise
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)  # only if it somehow survived: never leave it stopped
            except ProcessLookupError:
                pass
    text = log.read_text()
    assert "was marked dead" in text and "its step still runs (hung): killing the step" in text, text[-3000:]
    assert "respawning inference as a new step on het group 1" in text, text[-3000:]
    assert "trainer and orchestrator finished: stopping the servers" in text, text[-3000:]
    with pytest.raises(ProcessLookupError):
        os.kill(stopped, 0)  # the stopped process is gone (SIGKILL through scancel)
    restarts = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(r["child"], r["het_group"]) for r in restarts] == [("inference", 1)], restarts
    r = measure(run_dir, [{"time": t_stop, "child": "inference[1]"}], NUM_STEPS)
    assert r["finished"] and r["rollouts_lost"] == 0 and r["rollouts_trained_twice"] == 0, r["ledger"]
    assert r["steps_missing_in_metrics"] == 0 and r["steps_duplicated_in_metrics"] == 0, r
    deadline = time.monotonic() + 60
    while (rows := sacct(job_id)).get(f"{job_id}+0") != "COMPLETED" and time.monotonic() < deadline:
        time.sleep(0.5)  # sacct lags slurmctld for hetjobs
    assert rows[f"{job_id}+0"] == "COMPLETED", rows
    print(f"hung server step killed and respawned; recovery {r['recovery_s_median']}s")
