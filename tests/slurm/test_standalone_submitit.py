"""Standalone jobs submitted through submitit (launcher/standalone.py) on the real local cluster:
``slurmrl submit preflight`` across 2 nodes (one report per node), ``slurmrl submit export`` of
a delta step into a self-contained HF directory, a failing export reported with the task's
output, ``slurmrl submit eval`` of a published step, and ``slurmrl status --all``'s batched
sacct watcher reading those jobs' states."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from launcher.runs_list import HetjobWatcher, slurm_states
from tests.slurm.conftest import REPO

pytestmark = pytest.mark.slurm


def submit(args: list[str], timeout: float = 300) -> tuple[subprocess.CompletedProcess, str]:
    res = subprocess.run([sys.executable, "-m", "launcher", "submit", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=timeout)
    print(res.stdout[-3000:], res.stderr[-3000:])
    m = re.search(r": job (\d+) ", res.stdout)
    assert m, res.stdout + res.stderr
    return res, m.group(1)


def settled_states(jobs: list[str], *, deadline_s: float = 60.0) -> dict:
    """sacct's states once no job is RUNNING or COMPLETING: submitit hands back a task's result as soon as
    the task wrote it, and slurmctld records the job's end a moment later (seconds on a loaded machine)."""
    end = time.monotonic() + deadline_s
    while True:
        watcher = HetjobWatcher(delay_s=0)
        states = slurm_states(jobs, watcher=watcher)
        assert watcher.num_calls == 1  # one sacct for every registered job
        if all(s not in ("RUNNING", "COMPLETING") for s, _ in states.values()) or time.monotonic() > end:
            return states
        time.sleep(1.0)


def test_preflight_across_two_nodes(slurm_cluster, tmp_path):
    out = tmp_path / "pre"
    res, job = submit(["preflight", "--nodes", "2", "--cluster", "local_slurm", "--cpus-per-task", "2",
                       "--folder", str(tmp_path / "submitit" / "%j"), "--",
                       "--out", str(out), "max_bytes=65536", "num_iters=2", "num_warmup_iters=1"])
    assert res.returncode == 0, res.stderr
    nodes = sorted(p.name for p in out.iterdir())
    assert len(nodes) == 2 and all(n.startswith("node") for n in nodes), nodes  # a report per node, by node name
    for n in nodes:
        summary = json.loads((out / n / "summary.json").read_text())
        assert summary, n
    assert settled_states([job]) == {job: ("COMPLETED", "")}


def test_export_a_delta_step_and_a_failing_one(slurm_cluster, tmp_path):
    from tests.unit.weights.test_weights_hf_layout import cfg_of, publish
    from tests.models.hf_dirs import llama_dir
    from workers.models.tiny_moe.model import init

    cfg = cfg_of(llama_dir(tmp_path / "src", tokenizer_vocab=100))
    st = init(cfg, torch.float32).state_dict()
    publish(tmp_path / "w", cfg, [st, {k: t + 0.5 if ".layers.0." in k else t for k, t in st.items()}], delta=True,
            full_every=10)
    folder = str(tmp_path / "submitit" / "%j")
    res, job = submit(["export", "--cluster", "local_slurm", "--folder", folder, "--",
                       str(tmp_path / "w" / "step_000001"), str(tmp_path / "full")])
    assert res.returncode == 0, res.stderr
    weight_map = json.loads((tmp_path / "full" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == {"model.safetensors"} and (tmp_path / "full" / "config.json").exists()

    bad, bad_job = submit(["export", "--cluster", "local_slurm", "--folder", folder, "--",
                           str(tmp_path / "w" / "step_000009"), str(tmp_path / "x")])
    assert bad.returncode == 1 and "exited with 2" in bad.stderr and "step_000009" in bad.stderr, bad.stderr
    states = settled_states([job, bad_job])
    assert states == {job: ("COMPLETED", ""), bad_job: ("FAILED", "")}, states


def test_eval_of_a_published_step(slurm_cluster, tmp_path):
    """``slurmrl submit eval``: slurmrl-eval of step 1 of a short local run of the bring-your-own-task
    example (its own embedded server on the Slurm node), pass@k written where asked."""
    byot = REPO / "docs" / "examples" / "byot"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{byot}", "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"
    train = subprocess.run([sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", "env=dataset",
                            f"env.path={byot / 'train.jsonl'}", "env.prompt_key=question", "env.reward_fn=my_rewards:REWARDS",
                            f"env.eval_path={byot / 'eval.jsonl'}", "model.vocab_size=264", "model.max_position_embeddings=128",
                            "env.max_new_tokens=4", "orchestrator.num_prompts_per_step=4", "trainer.num_steps=2",
                            f"launcher.run_dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    out = tmp_path / "eval.json"
    res = subprocess.run([sys.executable, "-m", "launcher", "submit", "eval", "--cluster", "local_slurm", "--folder",
                          str(tmp_path / "submitit" / "%j"), "--", str(run_dir / "weights" / "step_000001"),
                          "--num-samples", "3", "--k", "2", "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    print(res.stdout[-3000:], res.stderr[-3000:])
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    assert result["step"] == 1 and {"eval/reward", "eval/pass@1", "eval/pass@2"} <= set(result), result
