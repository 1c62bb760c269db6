"""A dead inference server step on Slurm is respawned and re-admitted: nothing is lost.

The job runs with launcher.follow=false and slow trainer steps; once training runs, the
inference step (both servers: one srun step per role) is cancelled with ``scancel JOB.STEP``.
launcher/supervisor.py starts the same srun line again as a new step on het group 1's nodes
after cluster.respawn_backoff_s; the orchestrator resubmits the groups the dead servers had
(same ids), re-admits the new servers at its current weights (worker_back), and the run ends
COMPLETED with every group trained exactly once (benchmarks/chaos.py's measure, as the local
fault tests use). With weights=broadcast the weight group is re-formed with the new servers
(workers/weights/broadcast/coordinator.py), which are readmitted by the next update.
"""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from benchmarks.chaos import measure
from launcher import submit
from tests.slurm.conftest import SMALL, sacct, slurmrl, wait_until
from tests.slurm.test_hetjob_kill import wait_for_training

pytestmark = pytest.mark.slurm
NUM_STEPS = 12


@pytest.mark.parametrize("weights", ["filesystem", "broadcast"])
def test_cancelled_server_step_is_respawned_and_nothing_is_lost(slurm_cluster, tmp_path, weights):
    run_dir = tmp_path / "run"
    res = slurmrl(["cluster=local_slurm", *SMALL, f"weights={weights}", f"trainer.num_steps={NUM_STEPS}", "launcher.follow=false",
                   f"launcher.run_dir={run_dir}", "cluster.respawn_backoff_s=1", "trainer.simulated_step_delay_s=1.5",
                   # one step of staleness: the orchestrator waits for the trainer, so it still needs
                   # servers after the kill (a wide window would let it finish every batch first)
                   "orchestrator.max_off_policy_steps=1"],
                  tmp_path, timeout=120)
    assert res.returncode == 0
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    log = run_dir / "logs" / f"slurm-{job_id}.out"
    try:
        wait_for_training(run_dir, job_id, num_steps=2)
        comps = submit.components(job_id)
        steps = subprocess.run(["squeue", "-h", "-s", "-j", comps[1].job_id, "-o", "%i %j"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
        (step,) = [s.split()[0] for s in steps if s.endswith(" inference")]
        t_kill = time.time()
        subprocess.run(["scancel", step], check=True, timeout=30)
        wait_until("the job to end", 300, lambda: not any(c.state in submit.ACTIVE for c in submit.components(job_id)))
    except BaseException:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        print(log.read_text()[-4000:] if log.exists() else "(no batch log)")
        raise
    text = log.read_text()
    assert "respawning inference as a new step on het group 1" in text, text[-3000:]
    assert "trainer and orchestrator finished: stopping the servers" in text, text[-3000:]
    restarts = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(r["child"], r["het_group"], r["restart"]) for r in restarts] == [("inference", 1, 1)]
    r = measure(run_dir, [{"time": t_kill, "child": "inference[0]"}], NUM_STEPS)
    assert r["finished"] and r["rollouts_lost"] == 0 and r["rollouts_trained_twice"] == 0, r["ledger"]
    assert r["steps_missing_in_metrics"] == 0 and r["steps_duplicated_in_metrics"] == 0, r
    events = [json.loads(line) for line in (run_dir / "orchestrator_ledger.jsonl").read_text().splitlines()]
    back = {e["worker"] for e in events if e["ev"] == "worker_back" and e["t"] > t_kill}
    assert back == {0, 1}, "both respawned servers were re-admitted"
    if weights == "broadcast":  # the group was re-formed with both new servers (one generation for both)
        group = json.loads((run_dir / "weights" / "broadcast" / "group.json").read_text())
        assert group["generation"] == 1, group
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        assert last["weight_updates_mismatched"] == 0, last
    deadline = time.monotonic() + 60
    while (rows := sacct(job_id)).get(f"{job_id}+0") != "COMPLETED" and time.monotonic() < deadline:
        time.sleep(0.5)  # sacct lags slurmctld for hetjobs
    assert rows[f"{job_id}+0"] == "COMPLETED", rows
    print(f"server step respawned; recovery {r['recovery_s_median']}s; ledger {r['ledger']}")
