"""Two real trainer ranks (gloo) whose optimizer diverges (issues 22 and 35): the step whose
weights hold NaN/inf is never published. By default both ranks stop with one error line naming
the tensor and the step and exit EXIT_FATAL (no traceback; the launcher does not restart it).
With ``weights.skip_nonfinite=true`` a non-finite step restores the newest checkpoint (one is
saved before step 1), warns every time and publishes that finite state; one bad batch is
absorbed and the run finishes, while a diverging run (trainer.lr=1e36) stops with the reason
after ``weights.max_nonfinite_skips`` steps in a row. No checkpoint ever holds NaN/inf.
"""
from __future__ import annotations

import json
import re

import numpy as np

import yaml

from workers.common.exits import EXIT_FATAL
from workers.common.protocol import STABLE
from workers.weights.filesystem.receiver import load_step
from tests.helpers.netutil import free_port
from tests.integration.conftest import make_batch, publish_batch, start_rank, write_ranks_run

NUM_STEPS = 4


def diverging_run(tmp_path, skip: bool, *, lr: float = 1.0e36, poison_step: int = 0, max_skips: int = 3,
                  every: int = 0):
    """``lr=1e36``: every Adam step moves weights by ~lr, they overflow within a step or two.
    ``poison_step``: that batch's advantages are NaN (one bad batch in a healthy run)."""
    paths = write_ranks_run(tmp_path, num_steps=NUM_STEPS, num_ranks=2)
    cfg = yaml.safe_load(paths.run_config.read_text())
    cfg["trainer"]["lr"] = lr
    cfg["trainer"]["checkpoint_every_steps"] = every
    cfg["weights"]["skip_nonfinite"] = skip
    cfg["weights"]["max_nonfinite_skips"] = max_skips
    paths.run_config.write_text(yaml.safe_dump(cfg))
    for step in range(1, NUM_STEPS + 1):
        tensors, meta = make_batch(step)
        if step == poison_step:
            tensors["advantages"] = np.full_like(tensors["advantages"], np.nan)
        publish_batch(paths, step, tensors, meta)
    port = free_port()
    procs = [start_rank(paths, r, 2, port) for r in range(2)]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(120))
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(paths.logs_dir / f"trainer_{r}.log").read_text() for r in range(2)]
    published = sorted(int(d.name[5:]) for d in (paths.root / "weights").glob("step_*") if (d / STABLE).exists())
    return paths, codes, logs, published


def checkpoints_are_finite(paths) -> list[int]:
    """Steps of the complete checkpoints; each one's tensors are all finite (DCP or per-rank files)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    steps = []
    for d in sorted((paths.root / "checkpoints").glob("step_*")):
        if not (d / "COMPLETE").exists():
            continue
        state: dict = {}
        files = sorted(d.glob("rank_*.pt"))
        if files:
            for f in files:
                state[f.name] = torch.load(f, map_location="cpu", weights_only=False)
        else:  # DCP (the FSDP plan): every tensor by its global name
            dcp_to_torch_save(d / "dcp", d.parent / f"{d.name}.pt")
            state = torch.load(d.parent / f"{d.name}.pt", map_location="cpu", weights_only=False)
            (d.parent / f"{d.name}.pt").unlink()
        flat = []

        def walk(x):
            if torch.is_tensor(x):
                flat.append(x)
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)
        walk(state)
        assert flat, d
        bad = [i for i, t in enumerate(flat) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        assert not bad, f"checkpoint {d.name} holds NaN/inf"
        steps.append(int(d.name[5:]))
    return steps


def test_a_nonfinite_step_stops_every_rank_naming_tensor_and_step(tmp_path):
    paths, codes, logs, published = diverging_run(tmp_path, skip=False)
    assert codes == [EXIT_FATAL, EXIT_FATAL], logs
    for log in logs:
        line = next(ln for ln in log.splitlines() if "not published" in ln)
        assert re.search(r"ERROR stopping: weights step (\d+) not published: tensor \S+ holds NaN or inf", line), line
        assert "Traceback" not in log
    bad_step = int(re.search(r"weights step (\d+) not published", logs[0]).group(1))
    assert published == list(range(bad_step))  # every earlier step, none from the bad one on
    load_step(paths.root / "weights" / f"step_{published[-1]:06d}")  # the last one published is intact
    assert not list((paths.root / "weights").glob(".step_*.tmp"))


def test_skip_nonfinite_absorbs_one_bad_batch_and_finishes(tmp_path):
    paths, codes, logs, published = diverging_run(tmp_path, skip=True, lr=3e-3, poison_step=2, every=1)
    assert codes == [0, 0], logs
    warnings = [ln for ln in logs[0].splitlines() if "holds NaN or inf after the optimizer step" in ln]
    assert len(warnings) == 1 and "step 2:" in warnings[0] and "restored checkpoint step 1" in warnings[0], warnings
    assert published == list(range(NUM_STEPS + 1))  # the restored state stands in for v2: nothing stalls
    for v in published:
        load_step(paths.root / "weights" / f"step_{v:06d}")  # every published step is intact and finite
    records = [json.loads(x) for x in (paths.root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
    assert [r.get("nonfinite_skipped") for r in records] == [0, 1, 0, 0] and records[1]["restored_step"] == 1
    assert checkpoints_are_finite(paths)


def test_skip_nonfinite_stops_a_diverging_run_with_the_reason(tmp_path):
    paths, codes, logs, published = diverging_run(tmp_path, skip=True, max_skips=1)
    assert codes == [EXIT_FATAL, EXIT_FATAL], logs
    warnings = [ln for ln in logs[0].splitlines() if "holds NaN or inf after the optimizer step" in ln]
    assert len(warnings) == 1, logs[0]  # said every time
    stop = next(ln for ln in logs[0].splitlines() if "ERROR stopping" in ln)
    assert "2th non-finite step" in stop and "the run diverges" in stop and "trainer.lr" in stop, stop
    assert "Traceback" not in logs[0] + logs[1]
    for v in published:
        load_step(paths.root / "weights" / f"step_{v:06d}")
    assert checkpoints_are_finite(paths) == [0]  # the restore point; nothing non-finite saved after it
