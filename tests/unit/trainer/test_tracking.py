"""tracking.wandb (workers/trainer/tracking.py): the plan refuses it without wandb installed; a tracker
failure turns tracking off, never training (the fake: a failure the real package cannot be made to
produce here). What reaches the real package offline: test_tracking_wandb.py."""
from __future__ import annotations

import importlib.util
import json
import logging

import pytest

from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from tests.fakes.fake_wandb import FakeWandb
from workers.common.protocol import RunPaths
from workers.common.metrics import MetricsWriter
from workers.trainer.tracking import make_tracker


def test_plan_refuses_wandb_when_it_is_not_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(PlanError, match=r"tracking.wandb=true needs the wandb package.*pip install wandb"):
        build_plan(compose(["tracking.wandb=true"]))
    assert build_plan(compose(["tracking.wandb=false"])).roles
    with pytest.raises(Exception, match="wandb_mode"):
        build_plan(compose(["tracking.wandb_mode=sometimes"]))


def test_a_failing_tracker_turns_itself_off(tmp_path, monkeypatch, caplog):
    fake = FakeWandb()
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    cfg = compose([])
    cfg.tracking.wandb = True
    paths = RunPaths(tmp_path / "run").ensure()
    writer = MetricsWriter(paths, tensorboard=False, tracker=make_tracker(cfg, paths, log=logging.getLogger("t.trk")))
    fake.runs[0].fail_next_log = ConnectionError("no route to host")
    with caplog.at_level(logging.ERROR, logger="t.trk"):
        writer.write({"step": 1, "reward_mean": 0.5})
        writer.write({"step": 2, "reward_mean": 0.6})
    writer.close()
    assert "wandb: logging failed (ConnectionError: no route to host)" in caplog.text
    assert fake.runs[0].logged == [] and len(paths.metrics.read_text().splitlines()) == 2  # metrics.jsonl goes on


def test_sample_completions_reach_metrics_and_tensorboard(tmp_path):
    """orchestrator.log_samples_every_steps: the rows log_samples returns ride in the batch's record
    (``samples``) to metrics.jsonl and a TensorBoard text summary at the same step (the wandb.Table:
    test_tracking_wandb.py, with the real package)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    paths = RunPaths(tmp_path / "run").ensure()
    writer = MetricsWriter(paths)
    rows = [{"rank": "best", "reward": 1.0, "prompt": "2+2=", "completion": "4|ok"},
            {"rank": "worst", "reward": 0.0, "prompt": "3+3=", "completion": "7"}]
    writer.write({"step": 1, "time": 1.0, "reward_mean": 0.5})
    writer.write({"step": 2, "time": 2.0, "reward_mean": 0.6, "samples": rows})
    writer.close()
    recs = [json.loads(x) for x in paths.metrics.read_text().splitlines()]
    assert "samples" not in recs[0] and recs[1]["samples"] == rows
    events = EventAccumulator(str(paths.tb_dir), size_guidance={"tensors": 0}).Reload()
    (text,) = events.Tensors("samples/text_summary")
    body = text.tensor_proto.string_val[0].decode()
    assert text.step == 2 and "| best | 1.000 | 2+2= | 4\\|ok |" in body and "| worst | 0.000 | 3+3= | 7 |" in body
