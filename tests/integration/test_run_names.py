"""Run names (issue 47 item 15): a dry run does not take the name of the run it previews; a re-used
sweep name is suffixed, not refused; a bring-your-own run of the default bundle is labelled by what
it trains (run name, Slurm job name, W&B project), not ``tiny_local``; an offline W&B run's finish
lines print the ``wandb sync`` command. Dry runs for the names, one real run for the rest."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import REPO
from tests.integration.conftest import SMALL

BYOT = REPO / "docs" / "examples" / "byot"
DATASET = ["env=dataset", f"env.path={BYOT / 'train.jsonl'}", "env.prompt_key=question",
           "env.reward_fn=my_rewards:REWARDS", "env.max_new_tokens=4", "model.vocab_size=264"]
TINY = ["model.max_position_embeddings=64", "model.hidden_size=32", "model.num_layers=1",
        "model.expert_intermediate_size=32"]


def cli(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{BYOT}", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "launcher", *args, f"cluster.runs_root={tmp_path / 'runs'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_reused_sweep_name_is_suffixed_and_a_local_dry_sweep_writes_its_manifest(tmp_path):
    """Also issue 47 item 16: no stray Hydra ``#1 :`` line, and sweep.json for a local dry sweep."""
    for attempt in range(2):
        out = cli(tmp_path, "-m", "trainer.lr=1e-4,3e-4", "name=sw", "launcher.dry_run=true")
        assert out.returncode == 0, out.stderr[-3000:]
        assert "#1 :" not in out.stdout + out.stderr and "#0 :" not in out.stdout + out.stderr
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir() if p.name.startswith("sw")) == ["sw-p0", "sw-p1"]  # previews replaced
    (runs / "sw-p0" / "metrics.jsonl").write_text('{"step": 1}\n')  # as if the sweep had run
    (runs / "sw-p1" / "metrics.jsonl").write_text('{"step": 1}\n')
    out = cli(tmp_path, "-m", "trainer.lr=1e-4,3e-4", "name=sw", "launcher.dry_run=true")
    assert out.returncode == 0, out.stderr[-3000:]  # used to be "already holds a run"
    assert (runs / "sw-p0-2" / "config" / "run.yaml").exists() and (runs / "sw-p1-2" / "config" / "run.yaml").exists()
    manifests = sorted((runs / "multirun").glob("*/sweep.json"))
    assert manifests, "a local dry sweep wrote no sweep.json"
    man = json.loads(manifests[-1].read_text())
    assert man["dry_run"] is True and man["backend"] == "local"
    assert [p["run_dir"] for p in man["points"]] == [str(runs / "sw-p0-2"), str(runs / "sw-p1-2")]


def test_a_bring_your_own_run_is_labelled_by_its_model_and_env(tmp_path):
    out = cli(tmp_path, *DATASET, "launcher.dry_run=true")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "experiment tiny_local (this run: tiny_moe-dataset)" in out.stdout
    names = [p.name for p in (tmp_path / "runs").iterdir()]
    assert len(names) == 1 and names[0].startswith("tiny_moe-dataset-"), names
    slurm = cli(tmp_path, *DATASET, "cluster=local_slurm", "name=", "launcher.dry_run=true")
    assert "#SBATCH --job-name=slurmrl-tiny_moe-dataset" in slurm.stdout, slurm.stdout[-2000:] + slurm.stderr[-2000:]
    plain = cli(tmp_path, "launcher.dry_run=true")  # the default toy keeps its experiment's name
    assert "experiment tiny_local: " in plain.stdout and "this run:" not in plain.stdout


@pytest.mark.slow
def test_a_real_run_takes_its_dry_runs_name_and_prints_wandb_sync(tmp_path):
    dry = cli(tmp_path, "name=mine", "launcher.dry_run=true")
    assert dry.returncode == 0 and (tmp_path / "runs" / "mine" / "DRY_RUN").exists()
    out = cli(tmp_path, *SMALL, *TINY, *DATASET, "trainer.num_steps=1", "name=mine", "tracking.wandb=true",
              timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "runs" / "mine"
    assert not (tmp_path / "runs" / "mine-2").exists() and not (run / "DRY_RUN").exists()
    assert f"run dir {run}" in out.stdout
    cfg = OmegaConf.load(run / "config" / "run.yaml")
    assert cfg.tracking.wandb_project == "slurmrl-tiny_moe-dataset"
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert offline and f"wandb sync {offline[-1]}" in out.stdout, out.stdout[-2000:]
