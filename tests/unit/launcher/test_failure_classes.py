"""Deterministic failures are not restarted (issue 35 item 2): a role that exits with
``EXIT_FATAL`` (a diverged optimizer, a config error) stops the run at once with its reason;
a crash or a kill is restarted as before. Real child processes, in both supervisors: the local
backend (launcher/local_backend.py) and the Slurm step supervisor (launcher/supervisor.py)."""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import pytest

from launcher import supervisor
from launcher.local_backend import LocalBackend
from launcher.supervisor import Step, Supervisor
from tests.conftest import compose
from launcher.plan import build_plan
from workers.common.exits import EXIT_FATAL
from workers.common.protocol import RunPaths


def role_modules(tmp_path: Path, **scripts: str) -> Path:
    """One ``python -m`` module per role, in a package on the children's PYTHONPATH."""
    pkg = tmp_path / "pkg" / "fakeroles"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for role, body in scripts.items():
        (pkg / f"{role}.py").write_text(body)
    return tmp_path / "pkg"


def local_backend(tmp_path: Path, scripts: dict, max_restarts: int = 2) -> LocalBackend:
    pkg = role_modules(tmp_path, **scripts)
    cfg = compose([f"cluster.runs_root={tmp_path / 'runs'}", f"launcher.max_restarts={max_restarts}",
                   "launcher.shutdown_grace_s=2"])
    cfg.cluster.env = {"PYTHONPATH": str(pkg)}
    plan = build_plan(cfg)
    roles = tuple(dataclasses.replace(r, module=f"fakeroles.{r.role}") for r in plan.roles)
    paths = RunPaths(tmp_path / "run").ensure()
    return LocalBackend(cfg, dataclasses.replace(plan, roles=roles), paths)


SLEEP = "import time; time.sleep(60)\n"


def test_local_fatal_exit_stops_at_once_without_a_restart(tmp_path, capsys):
    backend = local_backend(tmp_path, {"trainer": f"import sys; print('diverged: x'); sys.exit({EXIT_FATAL})\n",
                                       "orchestrator": SLEEP, "inference": SLEEP})
    t0 = time.monotonic()
    assert backend.run() == 1
    assert time.monotonic() - t0 < 30
    assert not (backend.paths.root / "restarts.jsonl").exists()
    out = capsys.readouterr().out
    assert f"trainer[0] exited with code {EXIT_FATAL}" in out and "not restarted" in out and "diverged: x" in out


def test_local_crash_is_still_restarted(tmp_path):
    flaky = ("import pathlib, sys; p = pathlib.Path({d!r}) / 'starts'; p.write_text((p.read_text() if p.exists() "
             "else '') + 'x'); sys.exit(1 if len(p.read_text()) == 1 else 0)\n").format(d=str(tmp_path))
    backend = local_backend(tmp_path, {"trainer": flaky, "orchestrator": "pass\n", "inference": SLEEP})
    assert backend.run() == 0
    assert (tmp_path / "starts").read_text() == "xx"
    assert "trainer[0]" in (backend.paths.root / "restarts.jsonl").read_text()


@pytest.fixture
def fast_poll(monkeypatch):
    monkeypatch.setattr(supervisor, "POLL_S", 0.05)


def test_slurm_fatal_server_exit_is_not_respawned(tmp_path, fast_poll, capsys):
    server = Step(name="inference", main=False, het_group=1, respawn=True,
                  argv=[sys.executable, "-c", f"import sys; sys.exit({EXIT_FATAL})"])
    trainer = Step(name="trainer", main=True, het_group=2, respawn=False,
                   argv=[sys.executable, "-c", "import time; time.sleep(60)"])
    sup = Supervisor([trainer, server], log_dir=tmp_path, run_dir=tmp_path, shutdown_grace_s=0.5, signal_grace_s=30,
                     max_requeues=0, max_respawns=3, backoff_s=0.1, backoff_max_s=0.2, env={})
    try:
        assert sup.run() == 1
    finally:
        sup.stop_steps()
    assert server.respawns == 0 and not (tmp_path / "restarts.jsonl").exists()
    assert "not restarted" in capsys.readouterr().out


@pytest.mark.parametrize("module", ["workers.orchestrator", "workers.inference", "workers.trainer"])
def test_a_role_refusing_its_config_exits_fatal(tmp_path, module):
    """A run.yaml the role cannot use (edited by hand: a value out of range) is a config error:
    one line and EXIT_FATAL, so neither supervisor restarts it."""
    import os
    import subprocess

    import yaml

    from tests.conftest import REPO
    from tests.integration.conftest import write_ranks_run

    paths = write_ranks_run(tmp_path, num_steps=1)
    cfg = yaml.safe_load(paths.run_config.read_text())
    cfg["trainer"]["lr"] = -1.0
    paths.run_config.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(SLURMRL_ROLE=module.split(".")[1], SLURMRL_RUN_DIR=str(paths.root), RANK="0", WORLD_SIZE="1",
               SLURMRL_LOCAL="1", SLURMRL_INFERENCE_URLS="http://127.0.0.1:1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1", PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == EXIT_FATAL, (res.returncode, res.stderr[-2000:])
    assert "trainer.lr" in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
