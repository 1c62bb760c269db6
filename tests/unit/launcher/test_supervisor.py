"""launcher/supervisor.py: the steps file the templates render, and the supervision rules
(done, failed, respawned with backoff, budget spent) with real child processes standing in
for srun (the Slurm side is tests/slurm/test_server_respawn.py)."""
from __future__ import annotations

import json
import re
import sys

import pytest

from launcher import supervisor
from launcher.supervisor import Step, Supervisor, backoff, component_ids, parse_steps
from tests.conftest import GLM5, TINY_SLURM, plan
from tests.unit.conftest import render


def steps_file(text: str) -> str:
    return re.search(r"<<'SLURMRL_STEPS_END'\n(.*?)\nSLURMRL_STEPS_END\n", text, re.S).group(1)


@pytest.mark.parametrize("overrides", [TINY_SLURM, GLM5], ids=["tiny", "glm5"])
def test_rendered_steps_parse_into_the_plan_roles(overrides):
    steps, p = parse_steps(steps_file(render(overrides))), plan(overrides)
    assert sorted((s.name, s.het_group, s.main) for s in steps) == sorted((r.role, r.het_group, r.main) for r in p.roles)
    assert {s.name for s in steps if s.respawn} == {r.role for r in p.roles if r.role in ("inference", "prefill", "decode")}
    for s in steps:
        srun = s.argv.index("srun")
        assert s.argv[srun + 1:srun + 3] and f"--het-group={s.het_group}" in s.argv
        assert s.argv[-3:-1] == ["bash", "-c"] and s.argv[-1].startswith('exec ')
        assert srun == 0 or s.argv[0] == "env"  # SGLang steps get their own environment first


def test_respawn_off_renders_fail_fast():
    steps = parse_steps(steps_file(render([*TINY_SLURM, "cluster.server_respawns=0"])))
    assert not any(s.respawn for s in steps)


def test_bad_steps_file_names_the_line():
    with pytest.raises(ValueError, match="expected 'slurmrl_step NAME"):
        parse_steps("srun --het-group=0 true\n")
    with pytest.raises(ValueError, match=r"unknown options \['mian'\]"):
        parse_steps("slurmrl_step x mian=1 -- true\n")


def test_backoff_doubles_up_to_the_cap():
    assert [backoff(k, 5, 60) for k in range(6)] == [5, 10, 20, 40, 60, 60]


def test_component_ids_leader_reaches_all():
    env = {"SLURM_JOB_ID": "10", "SLURM_JOB_ID_HET_GROUP_0": "10", "SLURM_JOB_ID_HET_GROUP_1": "11",
           "SLURM_JOB_ID_HET_GROUP_2": "12"}
    assert component_ids([2, 0, 1], env) == ["10"]
    assert component_ids([2, 1, 2], env) == ["11", "12"]


def sh(name, script, **kw) -> Step:
    return Step(name=name, main=kw.get("main", False), het_group=kw.get("group", 0), respawn=kw.get("respawn", False),
                argv=[sys.executable, "-c", script])


def run(tmp_path, steps, **kw):
    sup = Supervisor(steps, log_dir=tmp_path, run_dir=tmp_path, shutdown_grace_s=0.5, signal_grace_s=30,
                     max_requeues=0, max_respawns=kw.get("respawns", 2), backoff_s=0.2, backoff_max_s=0.3, env={})
    try:
        return sup.run()
    finally:
        sup.stop_steps()


# A server that dies on its first two starts and then serves until stopped.
FLAKY = ("import os, pathlib, sys, time; p = pathlib.Path({d!r}) / 'starts'; "
         "p.write_text(p.read_text() + 'x' if p.exists() else 'x'); "
         "sys.exit(3) if len(p.read_text()) <= {fails} else time.sleep(60)")


@pytest.fixture(autouse=True)
def fast_poll(monkeypatch):
    monkeypatch.setattr(supervisor, "POLL_S", 0.05)


def test_main_steps_done_stops_the_servers(tmp_path):
    server = sh("inference", "import time; time.sleep(60)", respawn=True)
    assert run(tmp_path, [sh("trainer", "import time; time.sleep(0.3)", main=True), server]) == 0
    assert server.proc.returncode != 0 and server.respawns == 0  # stopped, not respawned


def test_dead_server_is_respawned_with_backoff_and_logged(tmp_path, capsys):
    server = sh("inference", FLAKY.format(d=str(tmp_path), fails=2), respawn=True, group=1)
    code = run(tmp_path, [sh("trainer", "import time; time.sleep(2.5)", main=True), server])
    assert code == 0 and server.respawns == 2 and (tmp_path / "starts").read_text() == "xxx"
    rows = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [(r["child"], r["exit_code"], r["restart"], r["het_group"]) for r in rows] == [
        ("inference", 3, 1, 1), ("inference", 3, 2, 1)]
    assert [r["backoff_s"] for r in rows] == [0.2, 0.3]
    assert "respawning inference as a new step on het group 1 in 0s (respawn 1/2)" in capsys.readouterr().out


def test_respawn_budget_spent_fails_the_job(tmp_path, capsys):
    server = sh("inference", FLAKY.format(d=str(tmp_path), fails=5), respawn=True)
    trainer = sh("trainer", "import time; time.sleep(60)", main=True)
    assert run(tmp_path, [trainer, server], respawns=1) == 1
    assert server.respawns == 1 and not trainer.live
    out = capsys.readouterr().out
    assert "inference exited with status 3" in out and "a role failed: stopping the whole job" in out


def test_non_server_failure_is_fatal_at_once(tmp_path):
    trainer = sh("trainer", "import sys; sys.exit(7)", main=True)
    server = sh("inference", "import time; time.sleep(60)", respawn=True)
    assert run(tmp_path, [trainer, server]) == 1 and not (tmp_path / "restarts.jsonl").exists()


def test_backoff_cap_below_first_wait_is_refused_at_plan_time():
    from launcher.plan import PlanError

    with pytest.raises(PlanError, match=r"cluster.respawn_backoff_max_s\(2\) < cluster.respawn_backoff_s\(5\)"):
        plan([*TINY_SLURM, "cluster.respawn_backoff_max_s=2"])
