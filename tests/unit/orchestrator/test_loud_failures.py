"""Failures that are shown, not hidden: the reward failure share and timeouts on the progress line,
a run whose every reward call fails for orchestrator.max_failed_reward_steps consecutive steps
stops with the first exception (an exit code the launchers do not restart), skipped dataset rows
on the line; elapsed time and ETA; an eval on its own line under the step whose weights it scored."""
from __future__ import annotations

import json
import types

import pytest

from launcher.progress import ProgressPrinter, duration, format_step
from workers.common.protocol import USER_ERROR_EXIT, RunPaths
from workers.orchestrator.batch_writer import BatchWriter, RewardsFailing


def orch(limit: int, first: str = "reward failed for train.jsonl line 1 (0:0:0): score: raised KeyError: 'x'"):
    cfg = types.SimpleNamespace(orchestrator=types.SimpleNamespace(max_failed_reward_steps=limit))
    return types.SimpleNamespace(cfg=cfg, failed_reward_steps=0, env=types.SimpleNamespace(first_failure=first))


def test_consecutive_all_failed_steps_stop_with_the_first_failure():
    o = orch(3)
    all_failed, some = {"reward_calls": 8, "reward_failures": 8}, {"reward_calls": 8, "reward_failures": 7}
    for m in (all_failed, all_failed, some, all_failed, all_failed):  # a step with one success resets the count
        BatchWriter.check_reward_failures(o, m)
    with pytest.raises(RewardsFailing, match=r"every reward call failed for 3 consecutive steps \(orchestrator."
                                             r"max_failed_reward_steps=3.*the first failure: reward failed for "
                                             r"train.jsonl line 1.*KeyError"):
        BatchWriter.check_reward_failures(o, all_failed)
    never = orch(0)
    for _ in range(10):
        BatchWriter.check_reward_failures(never, all_failed)
    assert never.failed_reward_steps == 10
    BatchWriter.check_reward_failures(orch(1), {"reward_mean": 0.0})  # envs without reward calls: never stops
    assert USER_ERROR_EXIT == 78


def test_progress_line_shows_failures_parts_skips_and_the_mismatch_by_its_name():
    rec = {"step": 3, "reward_mean": 0.25, "reward/correct": 0.2, "reward/format": 0.05, "reward_failures": 3,
           "reward_timeouts": 1, "reward_failure_frac": 0.1875, "data/prompts_skipped_too_long": 2, "max_staleness": 1,
           "samples_dropped_stale": 0, "mismatch_kl": 3e-14, "step_time_s": 0.5}
    line = format_step(rec, 10, elapsed_s=65, eta_s=241)
    assert line.startswith("step   3/10 | reward 0.250 (correct 0.200, format 0.050) | fail 19% (1 timeouts) | "
                           "skipped 2 | stale max 1 | dropped 0 | mismatch 3.0e-14 |"), line
    assert line.endswith("| 0.50 s | 1m05s elapsed, ETA 4m01s") and " kl " not in line
    clean = format_step({"step": 1, "reward_mean": 0.5, "reward_failures": 0}, 2)
    assert "fail" not in clean and "skipped" not in clean and "elapsed" not in clean
    assert (duration(42), duration(185), duration(7440)) == ("42s", "3m05s", "2h04m")


def test_printer_eta_and_eval_lines(tmp_path, capsys):
    paths = RunPaths(tmp_path).ensure()
    # started at 100; 30 s of start-up, then steps every 10 s (start-up does not count in the ETA)
    recs = [{"step": s, "time": t, "reward_mean": 0.1 * s, "step_time_s": 8.0} for s, t in ((1, 140.0), (2, 150.0))]
    recs[1].update({"eval/reward": 0.5, "eval/weights_step": 1, "eval/pass@1": 0.5, "eval/num_samples": 4})
    paths.metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))
    p = ProgressPrinter(paths, 4, started=100.0)
    p.poll()
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("| 40s elapsed, ETA 24s")  # first step: its step time x 3 steps left
    assert out[1].endswith("| 50s elapsed, ETA 20s")  # then the measured rate: 10 s per step x 2 left
    assert out[2] == "step   1/4 eval | reward 0.500 | pass@1 0.500 | 4 answers (weights of step 1, reported at step 2)"
    assert "eval 0.500 (weights of step 1)" in p.summary()
    with open(paths.metrics, "a") as fh:  # the final weights' eval (orchestrator/final_eval.py): its eval line only
        fh.write(json.dumps({"step": 4, "final_eval": True, "eval/reward": 0.75, "eval/weights_step": 4}) + "\n")
    p.poll()
    assert capsys.readouterr().out == "step   4/4 eval | reward 0.750 (weights of step 4, reported at step 4)\n"
    assert "eval 0.750 (weights of step 4)" in p.summary()
