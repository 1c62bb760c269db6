"""Inference worker death mid-run: the orchestrator resubmits its groups elsewhere (same ids),
the launcher respawns it, it comes back at the orchestrator's current weights, and the run
ends with every group trained exactly once (benchmarks/chaos.py drives and measures)."""
from __future__ import annotations

import json

from benchmarks.chaos import run_chaos


def test_worker_killed_twice_nothing_lost_nothing_twice(tmp_path):
    r = run_chaos(tmp_path / "run", num_steps=12, timeout_s=240, overrides=["trainer.simulated_step_delay_s=1.5",
                         # every group spends ~1 s in its env after generating, and the staleness window
                         # spans the whole run, so the orchestrator keeps max_inflight_rollouts in flight
                         # until every group is launched. run_chaos kills a worker only while it runs
                         # requests (chaos.busy): groups in flight can all be in their env step, done with
                         # the worker, and then rightly finish with nothing resubmitted (1 run in 3 did).
                         # The second kill waits for the respawned worker to serve again; keyed to a late
                         # trainer step instead, it found every group generated already (the window lets
                         # the orchestrator run the whole run ahead of a slow trainer).
                         "orchestrator.max_off_policy_steps=12",
                         "env.latency=lognormal", "env.latency_median_s=1.0", "env.latency_p99_over_median=3"],
                  schedule=[(1, "inference[0]", "KILL"), (2, "inference[0]", "KILL")])
    assert r["launcher_exit"] == 0 and r["finished"], r
    assert [k["busy"] for k in r["kills"]] == [True, True], r["kills"]  # killed mid-generation: work to lose
    assert r["rollouts_lost"] == 0 and r["rollouts_trained_twice"] == 0, r["ledger"]
    assert r["steps_missing_in_metrics"] == 0 and r["steps_duplicated_in_metrics"] == 0
    assert [x["child"] for x in r["restarts"]] == ["inference[0]", "inference[0]"]
    events = [json.loads(line) for line in (tmp_path / "run" / "orchestrator_ledger.jsonl").read_text().splitlines()]
    dead = [e for e in events if e["ev"] == "worker_dead"]
    back = [e for e in events if e["ev"] == "worker_back"]
    assert dead and all(e["worker"] == 0 for e in dead)
    assert len(back) >= 1, "the respawned worker was never brought back into service"
    assert all(e["version"] is not None and e["version"] >= 1 for e in back), back  # current weights, not step 0
    resub = [e for e in events if e["ev"] == "resubmit"]
    launched = {e["gid"]: e["task_id"] for e in events if e["ev"] == "launch"}
    assert resub and all(e["worker"] == 1 or e["t"] > back[0]["t"] for e in resub[:1])
    assert all(e["gid"] in launched for e in resub)  # same group ids as first launched


def test_broadcast_worker_killed_rejoins_a_reformed_group(tmp_path):
    """weights=broadcast: the respawned worker cannot join the old group (a process group takes no
    member back), so the group is re-formed with it (generation 1) and it is readmitted once the
    next update reached it; nothing lost, every later update verified on both workers."""
    r = run_chaos(tmp_path / "run", num_steps=10, timeout_s=240,
                  overrides=["weights=broadcast", "trainer.simulated_step_delay_s=1.0", "orchestrator.max_off_policy_steps=1"],
                  schedule=[(2, "inference[0]", "KILL")])
    assert r["launcher_exit"] == 0 and r["finished"], r
    assert r["rollouts_lost"] == 0 and r["rollouts_trained_twice"] == 0, r["ledger"]
    assert r["steps_missing_in_metrics"] == 0 and [x["child"] for x in r["restarts"]] == ["inference[0]"]
    run = tmp_path / "run"
    events = [json.loads(line) for line in (run / "orchestrator_ledger.jsonl").read_text().splitlines()]
    back = [e for e in events if e["ev"] == "worker_back"]
    assert [e["worker"] for e in back] == [0] and back[0]["version"] >= 1, back  # readmitted by a broadcast update
    group = json.loads((run / "weights" / "broadcast" / "group.json").read_text())
    assert group["generation"] == 1 and group["group_name"].endswith(".g1"), group
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["weight_updates_mismatched"] == 0 and last["weight_updates_verified"] >= 3, last
    assert "received v" in (run / "logs" / "inference_0.log").read_text().split("serving on")[-1]  # after the respawn
