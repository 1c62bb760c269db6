"""The real trainer (``python -m workers.trainer``) as 2 gloo ranks vs a 1-rank reference.

Batches are written the way the orchestrator writes them (numpy + safetensors.numpy,
``READY`` last through atomic_dir.publish_dir). Both runs train the same 2 batches; the DP
run must publish the same weights as the 1-rank run. They agree to float32 rounding, not
bit for bit: the 1-rank run sums each gradient over all rows in one GEMM, the 2-rank run
sums two half-batch GEMMs and then adds them in the all-reduce, a different reduction
order. grad_norm (pre-clip, so scale-sensitive) must match too: it would be off by about
the dp degree if gradients were normalised per rank instead of by global token counts.
Also: the missing-peer error of the rendezvous, batch-format errors, rollout pruning.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from workers.common.protocol import STABLE, RunPaths
from workers.trainer.batch import BatchFormatError, load_batch, prune_rollouts
from workers.weights.filesystem.receiver import load_step
from tests.helpers.netutil import free_port
from tests.integration.conftest import RANKS_MODEL as MODEL, write_ranks_run as write_run, make_batch, publish_batch, start_rank, wait_all

REPO = Path(__file__).resolve().parents[2]
METRIC_KEYS = {"step", "reward_mean", "max_staleness", "samples_dropped_stale", "mismatch_kl", "trainer_idle_frac",
               "tokens_per_s", "step_time_s", "loss", "grad_norm", "entropy", "weight_sync_s", "weight_sync_gbps",
               "aux_loss", "routing_disagreement", "time"}


def test_two_gloo_ranks_match_one_rank_reference(tmp_path):
    steps = 2
    dp, ref = write_run(tmp_path / "dp", num_steps=steps, num_ranks=2), write_run(tmp_path / "ref", num_steps=steps)
    for s in range(1, steps + 1):
        tensors, meta = make_batch(s)
        publish_batch(dp, s, tensors, meta)
        publish_batch(ref, s, tensors, meta)
    port_dp, port_ref = free_port(), free_port()
    procs = [start_rank(dp, 0, 2, port_dp), start_rank(dp, 1, 2, port_dp), start_rank(ref, 0, 1, port_ref)]
    wait_all(procs, [dp, ref])

    for pt in (dp, ref):
        assert (pt.root / "TRAINER_DONE").exists()
        assert all((pt.weights(s) / STABLE).exists() for s in range(steps + 1))
    init = load_step(dp.weights(0))  # 2 ranks: 2 shards, each written by its rank
    for s in range(1, steps + 1):
        a = load_step(dp.weights(s))
        b = load_step(ref.weights(s))
        assert a.keys() == b.keys()
        worst = max(float((a[n] - b[n]).abs().max()) for n in a)
        assert worst < 1e-6, f"step {s}: DP weights differ from the 1-rank reference by {worst:.3g}"  # seen: 3.5e-7
        moved = max(float((a[n] - init[n]).abs().max()) for n in a)
        assert moved > 1e-3, "training did not change the weights"

    recs_dp = [json.loads(l) for l in dp.metrics.read_text().splitlines()]
    recs_ref = [json.loads(l) for l in ref.metrics.read_text().splitlines()]
    assert [r["step"] for r in recs_dp] == list(range(1, steps + 1))
    for rd, rr in zip(recs_dp, recs_ref):
        assert METRIC_KEYS <= rd.keys(), f"missing keys {sorted(METRIC_KEYS - rd.keys())}"
        for key in ("grad_norm", "loss", "mismatch_kl", "entropy", "aux_loss", "routing_disagreement",
                    "ratio_masked_frac", "num_loss_tokens"):
            assert rd[key] == pytest.approx(rr[key], rel=1e-5, abs=1e-7), key
        assert rd["ratio_masked_frac"] > 0 and rd["mismatch_kl"] > 0 and 0 <= rd["trainer_idle_frac"] <= 1
        assert rd["routing_disagreement"] > 0.5  # random "inference" routing vs the real router
    assert any((dp.tb_dir).glob("events.out.tfevents.*"))


def test_sigterm_exits_fast_and_cleanly(tmp_path):
    paths = write_run(tmp_path, num_steps=3)  # no batch ever comes: the rank sits waiting
    proc = start_rank(paths, 0, 1, free_port())
    deadline = time.monotonic() + 30
    while not (paths.weights(0) / STABLE).exists():
        assert proc.poll() is None and time.monotonic() < deadline, (paths.logs_dir / "trainer_0.log").read_text()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    # "promptly" = well inside the launcher's shutdown grace; no tighter timing (CI load varies)
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    log = (paths.logs_dir / "trainer_0.log").read_text()
    assert "SIGTERM" in log and "Traceback" not in log
    assert not (paths.root / "TRAINER_DONE").exists()


def test_rendezvous_names_the_missing_peer(tmp_path):
    code = ("from workers.common.topology import current_topology\n"
            "from workers.trainer.parallel.dims import ParallelDims\n"
            "ParallelDims.init(current_topology(), timeout_s=1.5)\n")
    env = dict(os.environ, SLURMRL_ROLE="trainer", SLURMRL_RUN_DIR=str(tmp_path), RANK="1", WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), SLURMRL_LOCAL="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "RendezvousError: trainer rank 1 could not reach trainer rank 0 at tcp://127.0.0.1:" in out.stderr


def test_batch_format_errors_name_the_tensor(tmp_path):
    paths = RunPaths(tmp_path).ensure()
    tensors, meta = make_batch(1)
    publish_batch(paths, 1, tensors, meta)
    facts = dict(num_layers=MODEL["num_layers"], top_k=MODEL["top_k"], num_experts=MODEL["num_experts"])
    batch = load_batch(paths.rollouts(1), step=1, **facts)
    assert batch.routed_experts.dtype == torch.int64 and batch.loss_mask.dtype == torch.bool
    with pytest.raises(BatchFormatError, match="says step 1 but sits in the directory of step 3"):
        load_batch(paths.rollouts(1), step=3, **facts)
    bad = dict(tensors, inference_logprobs=tensors["inference_logprobs"].astype(np.float64))
    publish_batch(paths, 2, bad, dict(meta, step=2))
    with pytest.raises(BatchFormatError, match="inference_logprobs is float64"):
        load_batch(paths.rollouts(2), step=2, **facts)
    with pytest.raises(BatchFormatError, match=r"num_layers\(3\)"):
        load_batch(paths.rollouts(1), step=1, **dict(facts, num_layers=3))


def test_prune_keeps_recent_and_unpublished(tmp_path):
    paths = RunPaths(tmp_path).ensure()
    for s in range(1, 6):
        publish_batch(paths, s, *make_batch(s, rows=2))
    tmp = paths.rollouts(1).parent / ".step_000006.tmp"
    tmp.mkdir()
    assert prune_rollouts(paths, newest=5) == [1, 2, 3]
    assert sorted(d.name for d in paths.rollouts(1).parent.iterdir()) == [".step_000006.tmp", "step_000004", "step_000005"]
