"""tracking.wandb (workers/trainer/tracking.py): the plan refuses it without wandb installed, and with
it every metrics.jsonl record goes to the tracker at the same step (offline by default, named after
the run, the resolved config attached); a tracker failure turns tracking off, never training."""
from __future__ import annotations

import importlib.util
import json
import logging

import pytest

from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from tests.fakes.fake_wandb import FakeWandb
from workers.common.protocol import RunPaths
from workers.trainer.metrics import MetricsWriter
from workers.trainer.tracking import make_tracker


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_plan_refuses_wandb_when_it_is_not_installed():
    with pytest.raises(PlanError, match=r"tracking.wandb=true needs the wandb package.*pip install wandb"):
        build_plan(compose(["tracking.wandb=true"]))
    assert build_plan(compose(["tracking.wandb=false"])).roles
    with pytest.raises(Exception, match="wandb_mode"):
        build_plan(compose(["tracking.wandb_mode=sometimes"]))


def test_every_record_goes_to_the_tracker_at_its_step(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    cfg = compose([])
    cfg.tracking.wandb = True
    paths = RunPaths(tmp_path / "run-1").ensure()
    log = logging.getLogger("test.tracking")
    writer = MetricsWriter(paths, tensorboard=False, tracker=make_tracker(cfg, paths, log=log))
    for step in range(1, 4):  # 1-based, as the trainer writes them
        writer.write({"step": step, "time": 1.0, "reward_mean": 0.1 * step, "eval/reward": 0.5, "loss": float("nan"),
                      "env/swe/sandbox_mode": "userns", "weight_updates_verified": True})
    writer.close()
    run = fake.runs[0]
    assert run.init["mode"] == "offline" and run.init["project"] == "slurmrl-tiny_local" and run.init["name"] == "run-1"
    assert run.init["config"]["trainer"]["num_steps"] == cfg.trainer.num_steps and run.init["resume"] == "allow"
    assert [s for s, _ in run.logged] == [1, 2, 3] and run.finished
    assert run.logged[0][1] == {"reward_mean": 0.1, "eval/reward": 0.5}  # numbers only; NaN, text, bools left out
    assert [json.loads(x)["step"] for x in paths.metrics.read_text().splitlines()] == [1, 2, 3]  # same steps
    # a resumed trainer (same run dir) continues the same W&B run
    again = make_tracker(cfg, paths, log=log)
    assert fake.runs[1].init["id"] == run.init["id"]
    again.close()


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


def test_sample_completions_reach_metrics_tensorboard_and_a_wandb_table(tmp_path, monkeypatch):
    """orchestrator.log_samples_every_steps: the rows log_samples returns ride in the batch's record
    (``samples``) to metrics.jsonl, a TensorBoard text summary and a wandb.Table at the same step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fake = FakeWandb()
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    cfg = compose([])
    cfg.tracking.wandb = True
    paths = RunPaths(tmp_path / "run").ensure()
    writer = MetricsWriter(paths, tracker=make_tracker(cfg, paths, log=logging.getLogger("t.samples")))
    rows = [{"rank": "best", "reward": 1.0, "prompt": "2+2=", "completion": "4|ok"},
            {"rank": "worst", "reward": 0.0, "prompt": "3+3=", "completion": "7"}]
    writer.write({"step": 1, "time": 1.0, "reward_mean": 0.5})
    writer.write({"step": 2, "time": 2.0, "reward_mean": 0.6, "samples": rows})
    writer.close()
    recs = [json.loads(x) for x in paths.metrics.read_text().splitlines()]
    assert "samples" not in recs[0] and recs[1]["samples"] == rows
    (table_step, logged), = [(s, d) for s, d in fake.runs[0].logged if "samples" in d]
    assert table_step == 2 and logged["samples"].columns == ["rank", "reward", "prompt", "completion"]
    assert logged["samples"].data == [["best", 1.0, "2+2=", "4|ok"], ["worst", 0.0, "3+3=", "7"]]
    events = EventAccumulator(str(paths.tb_dir), size_guidance={"tensors": 0}).Reload()
    (text,) = events.Tensors("samples/text_summary")
    body = text.tensor_proto.string_val[0].decode()
    assert text.step == 2 and "| best | 1.000 | 2+2= | 4\\|ok |" in body and "| worst | 0.000 | 3+3= | 7 |" in body
