"""``launcher.control_placement=trainer`` on the real local cluster: no control het group; the
orchestrator runs as an ``srun --overlap`` step on the trainer group's first node, finds the
inference workers and the trainer through the run-time topology, and the job completes."""
from __future__ import annotations

import pytest

from tests.slurm.conftest import SMALL, metrics, sacct_final, slurmrl

pytestmark = pytest.mark.slurm


def test_orchestrator_overlaps_the_trainer_node_and_the_job_completes(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    res = slurmrl(["cluster=local_slurm", *SMALL, "trainer.num_steps=3", "launcher.control_placement=trainer",
                   f"launcher.run_dir={run_dir}"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:]
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    rows = sacct_final(job_id, num_parts=2, num_steps=3)  # inference + trainer groups only
    assert set(rows.values()) == {"COMPLETED"}, rows
    assert len([r for r in rows if "." not in r]) == 2
    script = (run_dir / "slurm" / "job.sbatch").read_text()
    assert "--overlap" in script and script.count("#SBATCH hetjob") == 1
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
