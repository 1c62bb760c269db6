"""``launcher.resume`` through the CLI without starting roles: the Slurm path (a new job for the same
run dir) against fake ``sbatch``/``scontrol``/``sacct`` on PATH (the boundary: no cluster here; they
record the script and answer like Slurm), and the refusals, each before anything is written or
started. The local path with real processes: tests/integration/test_resume_run.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from workers.common.config import LauncherConfig, load_run_config

FAKE_SBATCH = """#!/bin/bash
# fake sbatch --parsable SCRIPT: keep the script, print the next job id
n=$(ls "$FAKE_SLURM_DIR"/job_*.sbatch 2>/dev/null | wc -l)
id=$((1001 + n))
cp "$2" "$FAKE_SLURM_DIR/job_$id.sbatch"
echo "$id"
"""
FAKE_SCONTROL = """#!/bin/bash
# fake scontrol show job -o ID: RUNNING while $FAKE_SLURM_DIR/running names the id, else forgotten
if [ "$(cat "$FAKE_SLURM_DIR/running" 2>/dev/null)" = "$4" ]; then
  echo "JobId=$4 HetJobOffset=0 JobState=RUNNING NodeList=n1"; exit 0
fi
echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1
"""
FAKE_SACCT = "#!/bin/bash\nexit 0\n"  # no accounting: the job is unknown


def _fake_slurm(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("scontrol", FAKE_SCONTROL), ("sacct", FAKE_SACCT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "FAKE_SLURM_DIR": str(tmp_path), "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"}


def _cli(args: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    flags = [a for a in args if a.startswith("-")]  # Hydra's flags (-m) before the overrides
    overrides = [f"cluster.runs_root={tmp_path / 'runs'}", *(a for a in args if not a.startswith("-"))]
    return subprocess.run([sys.executable, "-m", "launcher", *flags, *overrides], cwd=REPO,
                          env=env or dict(os.environ), capture_output=True, text=True, timeout=120)


def test_slurm_resume_submits_a_new_job_for_the_same_run_dir(tmp_path):
    env, run_dir = _fake_slurm(tmp_path), tmp_path / "run"
    first = _cli(["cluster=local_slurm", "trainer.num_steps=4", "launcher.follow=false",
                  f"launcher.run_dir={run_dir}"], tmp_path, env)
    assert first.returncode == 0, first.stderr
    assert (run_dir / "slurm" / "job_id").read_text().strip() == "1001"

    (tmp_path / "running").write_text("1001")  # the job is still active: refused, nothing submitted
    busy = _cli([f"launcher.resume={run_dir}", "launcher.follow=false"], tmp_path, env)
    assert busy.returncode == 2 and "job 1001" in busy.stderr and "RUNNING" in busy.stderr, busy.stderr
    assert not (tmp_path / "job_1002.sbatch").exists()

    (tmp_path / "running").unlink()
    res = _cli([f"launcher.resume={run_dir}", "launcher.follow=false", "trainer.num_steps=6"], tmp_path, env)
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stdout and "submitted job 1002" in res.stdout
    assert (run_dir / "slurm" / "job_id").read_text().strip() == "1002"
    script = (tmp_path / "job_1002.sbatch").read_text()
    assert str(run_dir) in script and script == (run_dir / "slurm" / "job.sbatch").read_text()
    cfg = load_run_config(str(run_dir / "config" / "run.yaml"))
    assert (cfg.trainer.num_steps, cfg.launcher.resume, cfg.launcher.run_dir) == (6, None, str(run_dir))
    assert load_run_config(str(run_dir / "config" / "trainer.yaml")).trainer.num_steps == 6


def test_resume_refusals_write_nothing(tmp_path):
    run_dir = tmp_path / "run"
    res = _cli([f"launcher.resume={tmp_path / 'nothing'}"], tmp_path)
    assert res.returncode == 2 and "holds no run" in res.stderr and "Traceback" not in res.stderr, res.stderr

    dry = _cli(["launcher.dry_run=true", "trainer.num_steps=4", f"launcher.run_dir={run_dir}"], tmp_path)
    assert dry.returncode == 0, dry.stderr
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    for override, key in [("model.hidden_size=64", "model.hidden_size"), ("env=code_repair", "env"),
                          ("inference.num_workers=3", "inference.num_workers"), ("+launcher.x=1", "launcher.x"),
                          ("trainer.num_steps=2", "trainer.num_steps")]:
        res = _cli([f"launcher.resume={run_dir}", override], tmp_path)
        assert res.returncode == 2 and key in res.stderr and "Traceback" not in res.stderr, (override, res.stderr)
    res = _cli([f"launcher.resume={run_dir}", "launcher.dry_run=true", "trainer.num_steps=5"], tmp_path)
    assert res.returncode == 0 and "would resume" in res.stdout, res.stderr
    res = _cli(["-m", f"launcher.resume={run_dir}", "trainer.num_steps=5,6"], tmp_path)
    assert res.returncode == 2 and "cannot be swept" in res.stderr, res.stderr

    fake_launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "launcher"])
    try:
        (run_dir / "pids.json").write_text(json.dumps({"launcher": fake_launcher.pid, "children": {}}))
        res = _cli([f"launcher.resume={run_dir}"], tmp_path)
        assert res.returncode == 2 and f"launcher pid {fake_launcher.pid}" in res.stderr, res.stderr
    finally:
        fake_launcher.kill()
        fake_launcher.wait()
    (run_dir / "pids.json").unlink()
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


def test_max_restarts_default_and_documented():
    assert LauncherConfig().max_restarts >= 2
    readme = (REPO / "README.md").read_text()
    assert "launcher.max_restarts" in readme and "launcher.resume" in readme
