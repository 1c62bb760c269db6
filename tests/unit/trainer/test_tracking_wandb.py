"""tracking.wandb with the real wandb package (the ``tracking`` extra, installed by ``make test``),
offline (WANDB_MODE=offline, as on a cluster without internet): a short run's records reach wandb's
own run files at their steps, named after the run directory, the resolved config attached, sample
completions as a table; a resumed trainer writes to the same run id. The fake (tests/fakes/
fake_wandb.py) stays for the failure paths only (test_tracking.py)."""
from __future__ import annotations

import importlib.util
import json
import logging

import pytest

from tests.conftest import compose
from tests.helpers.wandb_files import read_run
from workers.common.protocol import RunPaths
from workers.common.metrics import MetricsWriter
from workers.trainer.tracking import make_tracker



def short_run(paths: RunPaths, cfg, steps: range) -> None:
    writer = MetricsWriter(paths, tensorboard=False, tracker=make_tracker(cfg, paths, log=logging.getLogger("t.wb")))
    for step in steps:
        rec = {"step": step, "time": 1.0 + step, "reward_mean": 0.25 * step, "loss/x": 1.0 / step, "eval/reward": 0.5,
               "loss": float("nan"), "note": "text is not logged", "weight_updates_verified": True}
        if step == 2:
            rec["samples"] = [{"rank": "best", "reward": 1.0, "prompt": "2+2=", "completion": "4"}]
        writer.write(rec)
    writer.close()


def test_a_short_run_lands_in_real_wandb_offline_files(tmp_path, monkeypatch):
    if importlib.util.find_spec("wandb") is None:  # a failure, not a skip: make test installs it
        pytest.fail("wandb is not installed: `make test` installs the tracking extra (pip install -e '.[tracking]')",
                    pytrace=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose(["name=wb-run"])
    cfg.tracking.wandb = True
    paths = RunPaths(tmp_path / "wb-run").ensure()
    short_run(paths, cfg, range(1, 4))
    (run_dir,) = (paths.root / "wandb").glob("offline-run-*")
    got = read_run(run_dir)
    assert got["run"].display_name == "wb-run" and got["run"].project == "slurmrl-tiny_local"
    history = [h for h in got["history"] if "reward_mean" in h]
    assert [h["_step"] for h in history] == [1, 2, 3] and [h["reward_mean"] for h in history] == [0.25, 0.5, 0.75]
    assert all("loss" not in h and "note" not in h and "weight_updates_verified" not in h for h in history)
    assert history[1]["samples/_type"] == "table-file" and history[1]["samples/nrows"] == 1  # the sample completions as a wandb.Table
    (table,) = (run_dir / "files" / "media" / "table").glob("samples_*.table.json")
    table = json.loads(table.read_text())
    assert table["columns"] == ["rank", "reward", "prompt", "completion"] and table["data"] == [["best", 1.0, "2+2=", "4"]]
    assert got["config"]["trainer"]["num_steps"] == cfg.trainer.num_steps and got["config"]["name"] == "wb-run"
    # a resumed trainer (same run directory) continues the same W&B run id
    short_run(paths, cfg, range(4, 5))
    ids = {read_run(d)["run"].run_id for d in (paths.root / "wandb").glob("offline-run-*")}
    assert len(ids) == 1
