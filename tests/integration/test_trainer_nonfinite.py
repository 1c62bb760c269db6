"""Two real trainer ranks (gloo) whose optimizer diverges (issue 22): the step whose weights
hold NaN/inf is never published. By default both ranks stop with one error line naming the
tensor and the step and exit 1 (no traceback); with ``weights.skip_nonfinite=true`` they
skip such steps, finish, and inference keeps the last finite step.
"""
from __future__ import annotations

import re

import yaml

from workers.common.protocol import STABLE
from workers.weights.filesystem.receiver import load_step
from tests.netutil import free_port
from tests.integration.conftest import make_batch, publish_batch, start_rank, write_ranks_run

NUM_STEPS = 4


def diverging_run(tmp_path, skip: bool):
    paths = write_ranks_run(tmp_path, num_steps=NUM_STEPS, num_ranks=2)
    cfg = yaml.safe_load(paths.run_config.read_text())
    cfg["trainer"]["lr"] = 1.0e36  # every Adam step moves weights by ~lr: they overflow within a step or two
    cfg["weights"]["skip_nonfinite"] = skip
    paths.run_config.write_text(yaml.safe_dump(cfg))
    for step in range(1, NUM_STEPS + 1):
        publish_batch(paths, step, *make_batch(step))
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


def test_a_nonfinite_step_stops_every_rank_naming_tensor_and_step(tmp_path):
    paths, codes, logs, published = diverging_run(tmp_path, skip=False)
    assert codes == [1, 1], logs
    for log in logs:
        line = next(ln for ln in log.splitlines() if "not published" in ln)
        assert re.search(r"ERROR stopping: weights step (\d+) not published: tensor \S+ holds NaN or inf", line), line
        assert "Traceback" not in log
    bad_step = int(re.search(r"weights step (\d+) not published", logs[0]).group(1))
    assert published == list(range(bad_step))  # every earlier step, none from the bad one on
    load_step(paths.root / "weights" / f"step_{published[-1]:06d}")  # the last one published is intact
    assert not list((paths.root / "weights").glob(".step_*.tmp"))


def test_skip_nonfinite_skips_such_steps_and_finishes(tmp_path):
    paths, codes, logs, published = diverging_run(tmp_path, skip=True)
    assert codes == [0, 0], logs
    assert "(skipped: weights.skip_nonfinite=true)" in logs[0]
    assert published and published[-1] < NUM_STEPS
    load_step(paths.root / "weights" / f"step_{published[-1]:06d}")
