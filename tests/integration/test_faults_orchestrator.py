"""Orchestrator SIGKILLed mid-run: the launcher restarts it, it resumes from its ledger
(next step after the last batch, pending groups re-run with the same ids and tasks) and
never hands the trainer a group twice."""
from __future__ import annotations

import json

from benchmarks.chaos import run_chaos


def test_orchestrator_killed_resumes_without_duplicates(tmp_path):
    r = run_chaos(tmp_path / "run", num_steps=8, timeout_s=240, schedule=[(3, "orchestrator[0]", "KILL")])
    assert r["launcher_exit"] == 0 and r["finished"], r
    assert r["ledger"]["orchestrator_restarts"] == 1, r["ledger"]
    assert r["rollouts_lost"] == 0 and r["rollouts_trained_twice"] == 0, r["ledger"]
    assert r["steps_missing_in_metrics"] == 0 and r["steps_duplicated_in_metrics"] == 0
    events = [json.loads(line) for line in (tmp_path / "run" / "orchestrator_ledger.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in events if e["ev"] == "batch"]
    assert steps == list(range(1, 9)), steps  # each batch written once, in order, across both incarnations
    restart = next(i for i, e in enumerate(events) if e["ev"] == "restart")
    before = {e["gid"]: e["task_id"] for e in events[:restart] if e["ev"] == "launch"}
    rerun = [e for e in events[restart:] if e["ev"] == "resubmit"]
    assert all(e["gid"] in before for e in rerun)
    relaunched = [e for e in events[restart:] if e["ev"] == "launch" and e["gid"] in before]
    assert not relaunched, "a restarted orchestrator must not reuse group ids for new tasks"


def test_security_of_a_run_with_restarts(tmp_path):
    """Admin token mode 600; it never reaches a log (also across restarts); servers bind the
    planned address (cfg.inference.host = 127.0.0.1), not 0.0.0.0."""
    run = tmp_path / "run"
    r = run_chaos(run, num_steps=4, timeout_s=200, schedule=[(1, "inference[1]", "KILL")])
    assert r["launcher_exit"] == 0, r
    token_file = run / "admin_token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32
    leaks = [str(p) for p in [*run.rglob("*"), tmp_path / "run.launcher.log"] if p.is_file() and p != token_file
             and token.encode() in p.read_bytes()]
    assert leaks == [], f"admin token written to {leaks}"
    for log in (run / "logs").glob("inference_*.log"):
        serving = [line for line in log.read_text().splitlines() if "serving on" in line]
        assert serving and all("http://127.0.0.1:" in line for line in serving), serving
