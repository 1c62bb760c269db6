"""Runs you can find (launcher/run_status.py, run_dir.py, sweep.py): ``name=`` names the run
directory and the Slurm job; a dry run is marked and leaves runs/latest alone; ``slurmrl status``
describes a local or dry run from its directory; a sweep ends with a table of its points."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from launcher.run_status import describe_local, local_state, next_commands
from tests.conftest import REPO, plan, plan_error


def cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_name_is_the_run_directory_and_the_job_name(tmp_path):
    out = cli(tmp_path, "name=lr-test", "launcher.dry_run=true")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "runs" / "lr-test" / "config" / "run.yaml").exists()
    again = cli(tmp_path, "name=lr-test", "launcher.dry_run=true")  # a dry run is a preview: it takes no name
    assert again.returncode == 0 and not (tmp_path / "runs" / "lr-test-2").exists()
    (tmp_path / "runs" / "lr-test" / "metrics.jsonl").write_text('{"step": 1}\n')  # a run that ran keeps it
    third = cli(tmp_path, "name=lr-test", "launcher.dry_run=true")
    assert third.returncode == 0 and (tmp_path / "runs" / "lr-test-2" / "config" / "run.yaml").exists()
    assert (tmp_path / "runs" / "lr-test" / "metrics.jsonl").exists()
    assert plan(["name=lr-test", "cluster=local_slurm"]).slurm.job_name == "slurmrl-lr-test"
    assert plan_error(["name=../x"]).startswith("name='../x' must be \"\" or a directory name")


def test_dry_run_keeps_latest_and_is_listed_as_a_dry_run(tmp_path):
    runs = tmp_path / "runs"
    (runs / "real" / "config").mkdir(parents=True)
    (runs / "real" / "config" / "run.yaml").write_text("trainer:\n  num_steps: 4\n")
    os.symlink("real", runs / "latest")
    out = cli(tmp_path, "name=dry", "launcher.dry_run=true")
    assert out.returncode == 0, out.stderr[-2000:]
    assert os.readlink(runs / "latest") == "real"  # slurmrl-eval runs/latest/... still means the real run
    assert local_state(runs / "dry", 0) == "DRY RUN"
    status = cli(tmp_path, "status", str(runs / "dry"))
    assert status.returncode == 0 and "DRY RUN" in status.stdout, status.stdout + status.stderr
    listing = cli(tmp_path, "status", "--all", str(runs))
    assert "DRY RUN" in listing.stdout and "NOT STARTED" in listing.stdout, listing.stdout


def test_status_of_a_local_run_reads_its_directory(tmp_path):
    root = tmp_path / "runs" / "mine"
    (root / "config").mkdir(parents=True)
    (root / "config" / "run.yaml").write_text("experiment: tiny_local\ntrainer:\n  lr: 0.001\n  num_steps: 10\n")
    recs = [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.3, "eval/reward": 0.5, "eval/weights_step": 1}]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (root / "weights" / "step_000002").mkdir(parents=True)
    (root / "weights" / "step_000002" / "STABLE").write_text("")
    lines = describe_local(root)
    assert lines[0] == f"run {root}: STOPPED (not submitted to Slurm)"
    assert "  step 2/10, last reward 0.300" in lines and "  last eval 0.500 (weights of step 1)" in lines
    text = "\n".join(lines)
    assert f"slurmrl resume {root}" in text and f"slurmrl-eval {root}/weights/step_000002" in text
    assert f"slurmrl plot {root}" in text and "tensorboard --logdir" in text
    (root / "TRAINER_DONE").write_text("")
    assert local_state(root, 2) == "FINISHED" and not any("resume" in c for c in next_commands(root, finished=True))
    out = cli(tmp_path, "status", str(root))
    assert out.returncode == 0 and "FINISHED" in out.stdout, out.stdout + out.stderr


def test_a_sweep_ends_with_a_table_of_its_points(tmp_path, capsys):
    import types

    from launcher.sweep import Point, results

    points = []
    for num, (lr, rewards) in enumerate([("1e-4", [0.1, 0.2]), ("3e-4", [0.2, 0.6])]):
        root = tmp_path / f"p{num}"
        root.mkdir()
        recs = [{"step": i + 1, "reward_mean": r} for i, r in enumerate(rewards)]
        recs[-1].update({"eval/reward": 0.25 * (num + 1), "eval/weights_step": 1})
        (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (root / "TRAINER_DONE").write_text("")
        points.append(Point(num=num, overrides=(f"trainer.lr={lr}", "env=dataset"),
                            prepared=types.SimpleNamespace(root=root), sweep_dir=str(tmp_path / "sweep")))
    text = results(points)
    assert text.splitlines()[0].split() == ["#", "SWEPT", "STATE", "STEPS", "FINAL", "REWARD", "EVAL", "RUN"]
    assert text.splitlines()[1].split()[:6] == ["0", "trainer.lr=1e-4", "FINISHED", "2", "0.150", "0.250"]
    assert text.splitlines()[2].split()[:6] == ["1", "trainer.lr=3e-4", "FINISHED", "2", "0.400", "0.500"]
    assert (tmp_path / "sweep" / "sweep_results.txt").read_text() == text + "\n"
    rows = json.loads((tmp_path / "sweep" / "sweep_results.json").read_text())
    assert rows[1]["final_reward"] == 0.4 and rows[1]["eval_weights_step"] == 1
    assert "sweep results" in capsys.readouterr().out


def test_a_cluster_profile_outside_the_repository_is_found_through_hydra_searchpath(tmp_path):
    """docs/guide/slurm_cluster.md's line (issue 47 item 16): a site's profile kept in its own directory."""
    (tmp_path / "conf" / "cluster").mkdir(parents=True)
    (tmp_path / "conf" / "cluster" / "mysite.yaml").write_text(
        (REPO / "hydra_conf" / "cluster" / "local.yaml").read_text())
    out = cli(tmp_path, f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "cluster=mysite", "name=site",
              "launcher.dry_run=true")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "runs" / "site" / "config" / "run.yaml").exists()
    assert "hydra.searchpath=[file://" in (REPO / "docs" / "guide" / "slurm_cluster.md").read_text()
