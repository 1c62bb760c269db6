"""Sweeps: a dry run renders every point and submits nothing; each sweep has its own directory and
manifest; each point's job name carries a short hash and the swept values."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launcher.sweep import job_name
from tests.conftest import REPO


def _sweep(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI with a fake ``sbatch`` first on PATH that records the call and fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "sbatch"
    fake.write_text(f"#!/bin/sh\necho called >> {tmp_path}/sbatch_called\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "launcher", "-m", *args, f"cluster.runs_root={tmp_path / 'runs'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_dry_run_sweep_renders_every_point_and_submits_nothing(tmp_path):
    res = _sweep(tmp_path, "trainer.lr=1e-4,3e-4", "experiment=glm5_swe_28xh200", "cluster=h200_ib",
                 "launcher.dry_run=true")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (tmp_path / "sbatch_called").exists(), "a dry run called sbatch"
    manifests = list((tmp_path / "runs" / "multirun").glob("*/sweep.json"))
    assert len(manifests) == 1
    man = json.loads(manifests[0].read_text())
    assert man["dry_run"] is True and len(man["points"]) == 2
    names = [p["job_name"] for p in man["points"]]
    assert len(set(names)) == 2 and all(n.startswith("slurmrl-glm5_swe_28xh200-") for n in names)
    assert any("lr=0.0001" in n or "lr=1e-4" in n for n in names), names
    for p in man["points"]:
        script = Path(p["script"]).read_text()
        assert f"#SBATCH --job-name={p['job_name']}" in script
        assert p["job_id"] is None


def test_each_sweep_gets_its_own_manifest(tmp_path):
    for _ in range(2):
        assert _sweep(tmp_path, "trainer.lr=1e-4,2e-4", "experiment=glm5_swe_28xh200", "cluster=h200_ib",
                      "launcher.dry_run=true").returncode == 0
        time.sleep(1.1)  # the sweep directory is named by the second
    assert len(list((tmp_path / "runs" / "multirun").glob("*/sweep.json"))) == 2


def test_job_name_hash_tells_apart_points_whose_values_are_cut():
    a = job_name("exp", ["trainer.lr=1e-4", "env.path=/" + "a" * 200])
    b = job_name("exp", ["trainer.lr=1e-4", "env.path=/" + "a" * 199 + "b"])
    assert a != b and len(a) < 100 and a.startswith("slurmrl-exp-")
    assert job_name("exp", []).startswith("slurmrl-exp-") and job_name("exp", []) != job_name("exp", ["x=1"])


def test_help_lists_the_subcommands():
    res = subprocess.run([sys.executable, "-m", "launcher", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0
    for word in ("status --all", "cancel", "launcher.resume=", "slurmrl-preflight", "launcher.dry_run=true"):
        assert word in res.stdout, word


def test_status_all_lists_runs_with_step_reward_and_slurm_state(tmp_path):
    """One fake squeue for every submitted run (a pending reason shown), local runs from their files."""
    root = tmp_path / "runs"
    for name, job, rewards in (("a-sweep-p0", "101", [0.1, 0.25]), ("b-local", None, [0.5]), ("c-empty", None, [])):
        d = root / name
        (d / "config").mkdir(parents=True)
        (d / "config" / "run.yaml").write_text("x: 1\n")
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward_mean": r}) + "\n"
                                                 for i, r in enumerate(rewards)))
        if job:
            (d / "slurm").mkdir()
            (d / "slurm" / "job_id").write_text(job + "\n")
    (root / "b-local" / "TRAINER_DONE").write_text("{}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/squeue_calls\n"
                                    "echo '101+0|PENDING|Resources'\necho '101+1|PENDING|Resources'\n")
    (bin_dir / "squeue").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-m", "launcher", "status", "--all", str(root)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = {ln.split()[0]: ln.split() for ln in res.stdout.splitlines()[1:]}
    assert lines["a-sweep-p0"][1:6] == ["101", "PENDING", "2", "0.250", "Resources"]
    assert lines["b-local"][2:5] == ["FINISHED", "1", "0.500"]
    assert lines["c-empty"][2:4] == ["NOT", "STARTED"]
    assert len((tmp_path / "squeue_calls").read_text().splitlines()) == 1  # one call for all runs
