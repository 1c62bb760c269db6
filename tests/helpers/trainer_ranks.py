"""Trainer ranks on a hand-made run directory, batches published by the test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf
from safetensors.numpy import save_file

from tests.helpers.configs import REPO
from workers.common.config import ClusterConfig, RunConfig, TrainerConfig, WeightsConfig
from workers.common.atomic_dir import publish_dir
from workers.common.protocol import READY, RunPaths
from workers.models.tiny_moe.config import TinyMoeConfig
from workers.orchestrator.envs.reverse_digits import ReverseDigitsConfig



RANKS_MODEL = dict(name="tiny_moe", vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
             expert_intermediate_size=32, init_seed=5)


def write_ranks_run(root: Path, *, num_steps: int, num_ranks: int = 1, router_replay: bool = True, env=None,
                    **trainer) -> RunPaths:
    paths = RunPaths(root).ensure()
    cfg = RunConfig(cluster=ClusterConfig(name="local"), model=TinyMoeConfig(**RANKS_MODEL),
                    env=env if env is not None else ReverseDigitsConfig(),
                    trainer=TrainerConfig(num_ranks=num_ranks, num_steps=num_steps, lr=3e-3, router_replay=router_replay,
                                          batch_timeout_s=60.0, **trainer),
                    weights=WeightsConfig(keep_last=5))
    paths.run_config.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return paths


def make_batch(step: int, *, rows: int = 12, length: int = 10, seed: int = 0) -> tuple[dict, dict]:
    """A batch in the protocol.py format for (1-based) step ``step``: prompts of 2-4 tokens, completions of varying length."""
    rng = np.random.default_rng(seed + 1000 * (step - 1))  # steps are 1-based; the data of batch 1 is seed + 0
    L, k, E = RANKS_MODEL["num_layers"], RANKS_MODEL["top_k"], RANKS_MODEL["num_experts"]
    ids = rng.integers(0, RANKS_MODEL["vocab_size"], (rows, length)).astype(np.int64)
    attn = np.zeros((rows, length), np.uint8)
    loss = np.zeros((rows, length), np.uint8)
    for r in range(rows):
        p, total = int(rng.integers(2, 5)), int(rng.integers(5, length + 1))
        attn[r, :total] = 1
        loss[r, p:total] = 1
    ids[attn == 0] = 0
    # near-uniform initial policy: logp ~ -log(16); a few far-off tokens exercise the masks
    logp = np.where(loss == 1, -np.log(16) + rng.normal(0, 0.3, (rows, length)), 0).astype(np.float32)
    logp[0, 4], logp[1, 4] = -0.2, -6.0
    versions = np.where(loss == 1, max(step - 2, 0), -1).astype(np.int32)  # 1-based step: one behind from step 2
    experts = np.stack([rng.permutation(E)[:k] for _ in range(rows * length * L)]).reshape(rows, length, L, k)
    routed_mask = attn.copy()
    routed_mask[np.arange(rows), attn.sum(1) - 1] = 0  # the last sampled token has no routing
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    tensors = dict(input_ids=ids, attention_mask=attn, loss_mask=loss, inference_logprobs=logp,
                   advantages=(rewards - rewards.mean()).astype(np.float32), rewards=rewards, token_versions=versions,
                   routed_experts=(experts * routed_mask[:, :, None, None]).astype(np.uint8), routed_mask=routed_mask)
    meta = {"step": step, "temperature": 1.0,
            "orchestrator_metrics": {"reward_mean": float(rewards.mean()), "max_staleness": 1 if step > 1 else 0,
                                     "samples_dropped_stale": 0}}
    return tensors, meta


def publish_batch(paths: RunPaths, step: int, tensors: dict, meta: dict) -> None:
    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "batch.safetensors"))
        (tmp / "meta.json").write_text(json.dumps(meta))

    publish_dir(paths.rollouts(step), write, READY)


def start_rank(paths: RunPaths, rank: int, world: int, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(SLURMRL_ROLE="trainer", SLURMRL_RUN_DIR=str(paths.root), RANK=str(rank), WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SLURMRL_LOCAL="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    log = open(paths.logs_dir / f"trainer_{rank}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "workers.trainer"], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def wait_all(procs: list[subprocess.Popen], paths: list[RunPaths], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join(f.read_text() for pt in paths for f in sorted(pt.logs_dir.glob("trainer_*.log")))
    assert all(p.returncode == 0 for p in procs), f"exit codes {[p.returncode for p in procs]}\n{logs}"
