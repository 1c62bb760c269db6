"""``slurmrl ... launcher.dry_run=true`` end to end through the CLI, on a PATH without Slurm.

The dry run renders the sbatch script and every role's resolved config into the run dir and
prints the script and the sbatch command; bad input fails before anything is written.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.unit.conftest import sbatch_blocks
from workers.common.config import load_run_config
from tests.unit.conftest import slurmrl

REPO = Path(__file__).resolve().parents[3]


def test_glm5_dry_run_without_slurm(tmp_path):
    res = slurmrl(["experiment=glm5_swe_28xh200", "cluster=h200_ib", "launcher.dry_run=true"], tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "#!/bin/bash" in out and "GPU nodes: prefill 4 + decode 8 + trainer 16 = 28" in out
    blocks = sbatch_blocks(out)
    gpu_nodes = [int(f.split("=")[1]) for b in blocks if "--gpus-per-node=8" in b for f in b if f.startswith("--nodes=")]
    assert sum(gpu_nodes) == 28
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.name != "latest"]
    script = run_dir / "slurm" / "job.sbatch"
    assert script.read_text() in out
    assert f"submit with: sbatch --parsable {script}" in out
    assert not (run_dir / "slurm" / "job_id").exists()  # nothing submitted
    names = {p.name for p in (run_dir / "config").iterdir()}
    assert names >= {"run.yaml", "plan.json", "trainer.yaml", "prefill.yaml", "decode.yaml", "orchestrator.yaml",
                     "router.yaml"}
    cfg = load_run_config(str(run_dir / "config" / "trainer.yaml"))
    assert (cfg.launcher.run_dir, cfg.trainer.num_ranks, cfg.model.num_experts) == (str(run_dir), 128, 256)
    plan = json.loads((run_dir / "config" / "plan.json").read_text())
    assert [c["num_nodes"] for c in plan["components"]] == [4, 8, 16]  # control on the trainer node


def test_local_slurm_dry_run(tmp_path):
    res = slurmrl(["cluster=local_slurm", "launcher.dry_run=true", "trainer.num_steps=3"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "srun \\\n    --cpus-per-task=1" in res.stdout and "#SBATCH hetjob" in res.stdout


def test_bad_input_fails_before_writing(tmp_path):
    res = slurmrl(["cluster=local_slurm", "trainer.parallel.ep=3", "trainer.num_ranks=3"], tmp_path)
    assert res.returncode == 2
    assert "trainer.parallel.ep(3) must divide model.num_experts(8)" in res.stderr
    assert not (tmp_path / "runs").exists()


def test_status_of_a_run_that_was_never_submitted(tmp_path):
    (tmp_path / "r").mkdir()
    res = subprocess.run([sys.executable, "-m", "launcher", "status", str(tmp_path / "r")], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "was not submitted to Slurm" in res.stdout
