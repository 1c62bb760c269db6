"""A hung inference worker (alive, not answering) no longer stalls the run (issue 35 item 4).

SIGSTOP one of two workers: it was marked dead after ~22 s, but the pending weight update
waited on it for ``orchestrator.weight_update_timeout_s`` (120 s), so no training progressed,
and nothing ever restarted a worker that was hung but alive. Now a worker marked dead leaves
the update at once (it loads the current weights when it comes back), and a worker dead but
still running beyond ``launcher.hung_worker_kill_s`` is killed and restarted: by PID in the
local backend, as its srun step by the Slurm supervisor (both read the orchestrator's
``run_dir/inference_health.json``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from types import SimpleNamespace

import pytest

from launcher import supervisor
from launcher.hung import hung_workers
from launcher.supervisor import Step, Supervisor
from tests.integration.test_http_hostile import MODEL, TOKEN, serve
from tests.unit.launcher.test_failure_classes import SLEEP, local_backend
from workers.common.inference_client import InferenceClient
from workers.common.protocol import INFERENCE_HEALTH, RunPaths
from workers.models.build import model_from_config
from workers.orchestrator.faults import WorkerPool
from workers.weights.filesystem.coordinator import FilesystemCoordinator
from workers.weights.filesystem.publisher import publish_step

log = logging.getLogger("test.hung")
CFG = SimpleNamespace(weights=SimpleNamespace(verify=True), trainer=SimpleNamespace(dtype="float32"),
                      inference=SimpleNamespace(dtype="float32", backend="embedded"))


def test_a_worker_marked_dead_leaves_the_weight_update_at_once(tmp_path):
    """Worker 1 accepts connections and never answers (what a SIGSTOPped server's kernel does): the
    update waits on it only until the health checks mark it dead, then goes on without it."""
    paths = RunPaths(tmp_path)
    publish_step(paths.root / "weights", 1, model_from_config(MODEL, "float32", "cpu").state_dict(), keep_last=5)

    async def run(session, base, engine, app):
        silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        hung_url = f"http://127.0.0.1:{silent.sockets[0].getsockname()[1]}"
        clients = [InferenceClient(u, TOKEN, session=session, timeout_s=120) for u in (base, hung_url)]
        pool = WorkerPool(clients, num_misses=1, timeout_s=1, log=log, health_file=paths.root / INFERENCE_HEALTH,
                          kill_after_s=30)
        coord = FilesystemCoordinator(CFG, paths, log=log)
        t0 = time.monotonic()
        update = asyncio.create_task(coord.maybe_update(pool))
        await asyncio.sleep(1.0)
        assert not update.done()  # waiting on the hung worker
        await pool.check_live()  # the orchestrator's health round: the hung one misses it
        await asyncio.wait_for(update, 5)
        took = time.monotonic() - t0
        silent.close()
        health = json.loads((paths.root / INFERENCE_HEALTH).read_text())
        return took, coord.version, engine.weight_version, pool.alive, health, coord.verified

    took, version, served, alive, health, verified = serve(run)
    assert took < 5, f"the update waited {took:.1f}s for a worker marked dead"
    assert version == 1 and served == 1 and alive == [True, False]
    assert verified == 1  # the worker that stayed is verified against the trainer's digest
    assert list(health["dead"]) == ["1"] and health["kill_after_s"] == 30
    assert health["dead"]["1"]["last_ok"] <= health["dead"]["1"]["since"]  # it answered, then went silent


def test_hung_workers_reads_the_bound_and_spares_a_newer_process(tmp_path):
    (tmp_path / INFERENCE_HEALTH).write_text(json.dumps({"kill_after_s": 10, "dead": {"1": {"since": 1000.0}}}))
    assert hung_workers(tmp_path, {0: 900.0, 1: 900.0}, now=1005.0) == {}  # not yet over the bound
    assert hung_workers(tmp_path, {0: 900.0, 1: 900.0}, now=1011.0) == {1: 11.0}
    assert hung_workers(tmp_path, {1: 1001.0}, now=1100.0) == {}  # a restarted process: not the hung one
    assert hung_workers(tmp_path, 900.0, now=1011.0) == {1: 11.0}  # one Slurm step holds every worker
    assert hung_workers(tmp_path, {1: 900.0}, now=1011.0, kill_after_s=0) == {}  # 0: never
    (tmp_path / INFERENCE_HEALTH).write_text("{torn")
    assert hung_workers(tmp_path, {1: 900.0}, now=1011.0) == {}


def test_a_replacement_that_never_answered_is_spared_even_when_marked_dead_after_it_started(tmp_path):
    """The race the Slurm test met: one step holds workers 0 and 1; killing it for hung worker 1 also
    ends healthy worker 0, whose misses add up only after the respawned step started. Worker 0 last
    answered before that start, so the loading replacement is not killed again."""
    dead = {"0": {"since": 1003.0, "last_ok": 995.0}, "1": {"since": 990.0, "last_ok": 985.0}}
    (tmp_path / INFERENCE_HEALTH).write_text(json.dumps({"kill_after_s": 3, "dead": dead}))
    assert hung_workers(tmp_path, 1001.0, now=1010.0) == {}  # the respawned step (started 1001)
    assert hung_workers(tmp_path, 900.0, now=1010.0) == {0: 7.0, 1: 20.0}  # the original step
    dead["0"]["last_ok"] = 1002.0  # the replacement answered, then hung: it is killed like the first
    (tmp_path / INFERENCE_HEALTH).write_text(json.dumps({"kill_after_s": 3, "dead": dead}))
    assert hung_workers(tmp_path, 1001.0, now=1010.0) == {0: 7.0}


def test_local_backend_kills_a_hung_worker_by_pid_and_restarts_it(tmp_path, capsys):
    """The inference processes run (sleep) but worker 1 is listed dead: killed, restarted, run goes on."""
    mark = ("import json, os, pathlib, time; run = pathlib.Path(os.environ['SLURMRL_RUN_DIR']); time.sleep(1.5); "
            "(run / 'inference_health.json').write_text(json.dumps({'kill_after_s': 0.5, "
            "'dead': {'1': {'since': time.time()}}})); time.sleep(6)\n")
    backend = local_backend(tmp_path, {"trainer": "import time; time.sleep(6)\n", "orchestrator": mark,
                                       "inference": SLEEP})
    backend.cfg.launcher.hung_worker_kill_s = 0.5
    assert backend.run() == 0
    rows = [json.loads(x) for x in (backend.paths.root / "restarts.jsonl").read_text().splitlines()]
    assert [(r["child"], r["exit_code"]) for r in rows] == [("inference[1]", -9)], rows
    assert "inference[1]" in capsys.readouterr().out


def test_slurm_supervisor_kills_a_hung_server_step_and_respawns_it(tmp_path, monkeypatch, capsys):
    """No squeue here: the supervisor falls back on killing the srun process (a real child)."""
    monkeypatch.setattr(supervisor, "POLL_S", 0.05)
    server = Step(name="inference", main=False, het_group=1, respawn=True,
                  argv=[sys.executable, "-c", "import time; time.sleep(60)"])
    trainer = Step(name="trainer", main=True, het_group=2, respawn=False,
                   argv=[sys.executable, "-c", "import time; time.sleep(3)"])
    sup = Supervisor([trainer, server], log_dir=tmp_path, run_dir=tmp_path, shutdown_grace_s=0.5, signal_grace_s=30,
                     max_requeues=0, max_respawns=2, backoff_s=0.1, backoff_max_s=0.2, env={})

    def mark_dead():
        time.sleep(0.5)
        (tmp_path / INFERENCE_HEALTH).write_text(json.dumps({"kill_after_s": 0.3,
                                                             "dead": {"0": {"since": time.time()}}}))

    import threading

    threading.Thread(target=mark_dead, daemon=True).start()
    try:
        assert sup.run() == 0
    finally:
        sup.stop_steps()
    assert server.respawns == 1
    rows = [json.loads(x) for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [(r["child"], r["exit_code"]) for r in rows] == [("inference", -9)]
    assert "its step still runs (hung): killing the step" in capsys.readouterr().out


@pytest.mark.slow
def test_a_sigstopped_worker_neither_stalls_nor_stays_hung(tmp_path):
    """The hostile case itself: SIGSTOP worker 1 of 2 mid-run. Training keeps going (no gap near
    weight_update_timeout_s), the launcher kills the hung process and restarts it, and the worker
    comes back at the current weights; nothing lost, nothing trained twice."""
    from benchmarks.chaos import run_chaos

    r = run_chaos(tmp_path / "run", num_steps=12, timeout_s=300,
                  overrides=["trainer.simulated_step_delay_s=1.0", "launcher.hung_worker_kill_s=5",
                             "orchestrator.weight_update_timeout_s=120", "orchestrator.max_off_policy_steps=2"],
                  schedule=[(2, "inference[1]", "STOP")])
    assert r["launcher_exit"] == 0 and r["finished"], r
    assert r["rollouts_lost"] == 0 and r["rollouts_trained_twice"] == 0, r["ledger"]
    assert [(x["child"], x["exit_code"]) for x in r["restarts"]] == [("inference[1]", -9)], r["restarts"]
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    t_stop = r["kills"][0]["time"]
    gaps = [b["time"] - a["time"] for a, b in zip(metrics, metrics[1:]) if b["time"] > t_stop]
    assert max(gaps) < 60, f"training stalled {max(gaps):.0f}s after the SIGSTOP (weight update held)"
    assert r["kills"][0]["recovery_s"] is not None, "the restarted worker was never brought back"
