"""Fixtures for tests that run against a real (local) Slurm cluster.

These tests never skip: CI must exercise real Slurm, so a missing cluster is an error.
If no cluster answers, `slurm_cluster` starts one with tests/slurm/cluster.sh (which
installs Slurm if needed) and stops it again at the end of the session.

Also the helpers every Slurm test shares (the CLI as a subprocess, sacct polling, waits with a deadline).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLUSTER_SH = Path(__file__).with_name("cluster.sh")
# Node states in which a node accepts (or will accept) work.
_USABLE = ("idle", "mixed", "allocated", "completing")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slurm: runs against the local Slurm cluster (tests/slurm/cluster.sh)"
    )


def _node_states():
    """Per-node states from sinfo, or None if Slurm does not answer."""
    try:
        # sinfo retries a dead controller for ~10 s; scontrol ping answers at once.
        if subprocess.run(["scontrol", "ping"], capture_output=True, timeout=20).returncode:
            return None
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.split() if out.returncode == 0 else None


def _usable(states):
    # "idle*" etc. (trailing "*": not responding) do not count.
    return bool(states) and any(s in _USABLE for s in states)


def _cluster_sh(action, timeout):
    try:
        res = subprocess.run(
            ["bash", str(CLUSTER_SH), action],
            capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{CLUSTER_SH} {action} timed out after {timeout}s:\n{e.stdout}\n{e.stderr}",
                    pytrace=False)
    return res


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running Slurm cluster with idle nodes; yields facts about it."""
    started = False
    if not _usable(_node_states()):
        # From scratch this includes apt-get install (~40 s); allow plenty.
        res = _cluster_sh("start", timeout=900)
        if res.returncode != 0:
            pytest.fail(
                f"Slurm cluster is not running and `{CLUSTER_SH} start` failed "
                f"(rc={res.returncode}):\n{res.stdout}\n{res.stderr}",
                pytrace=False,
            )
        started = True
    # Leftover jobs from an earlier run may hold nodes for a moment.
    deadline = time.monotonic() + 60
    while (states := _node_states()) is None or "idle" not in states:
        if time.monotonic() > deadline:
            pytest.fail(f"Slurm cluster shows no idle node after 60s (sinfo states: {states})",
                        pytrace=False)
        time.sleep(0.5)
    try:
        yield {
            "nodes": len(states),
            "state_dir": Path(os.environ.get("SLURMRL_CLUSTER_DIR", "/tmp/slurmrl-cluster")),
            "started_here": started,
        }
    finally:
        if started:  # leave a cluster someone else started alone
            res = _cluster_sh("stop", timeout=120)
            if res.returncode != 0:
                print(f"warning: `{CLUSTER_SH} stop` failed:\n{res.stdout}\n{res.stderr}")


# ---- shared helpers -----------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[2]
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED"}
SMALL = ["experiment=tiny_local", "orchestrator.num_prompts_per_step=4"]


def slurmrl(args: list[str], tmp_path: Path, *, timeout: float = 300) -> subprocess.CompletedProcess:
    flags = [a for a in args if a.startswith("-")]  # Hydra wants -m before the overrides
    cmd = [sys.executable, "-m", "launcher", *flags, f"cluster.runs_root={tmp_path / 'runs'}",
           *(a for a in args if not a.startswith("-"))]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    print(res.stdout[-4000:], res.stderr[-4000:])
    return res


def sacct(job_id: str) -> dict[str, str]:
    out = subprocess.run(["sacct", "-j", job_id, "--format=JobID,State", "-P", "-n"], capture_output=True,
                         text=True, timeout=30).stdout
    return {a: b.split()[0] for a, b in (line.split("|", 1) for line in out.splitlines() if "|" in line)}


def sacct_final(job_id: str, num_parts: int, num_steps: int, timeout: float = 60) -> dict[str, str]:
    """sacct rows once every part, the batch step and num_steps srun steps are recorded, final.

    sacct lags slurmctld by seconds for hetjobs (tests/slurm/README.md), hence the poll.
    """
    deadline = time.monotonic() + timeout
    while True:
        rows = sacct(job_id)
        parts = [f"{job_id}+{k}" for k in range(num_parts)]
        steps = [r for r in rows if "." in r and not r.endswith((".batch", ".extern"))]
        if (all(p in rows for p in parts) and f"{job_id}+0.batch" in rows and len(steps) == num_steps
                and not ACTIVE.intersection(rows.values())):
            return rows
        if time.monotonic() > deadline:
            pytest.fail(f"sacct did not record job {job_id} completely within {timeout}s: {rows}", pytrace=False)
        time.sleep(0.5)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def wake_backfill() -> None:
    """Touch the partition record (setting its state to what it is) so the backfill scheduler runs.

    Why a test needs this: Slurm starts heterogeneous jobs only from its backfill scheduler, and
    a backfill pass runs only when a job, node, partition or reservation record changed since the
    last pass. A requeued job becomes eligible when its BeginTime (cred_expire + 1 s) passes, which
    changes no record, so on this otherwise idle cluster it waited for the next unrelated change
    (67 s and 143 s measured in CI). A cluster with other users has such changes every second.
    """
    subprocess.run(["scontrol", "update", "PartitionName=debug", "State=UP"], capture_output=True, timeout=30)


def wait_until(what, timeout, probe, *, wake_every_s: float = 0.0):
    """Poll probe() until it returns a truthy value; fail after timeout seconds. ``wake_every_s`` > 0:
    call :func:`wake_backfill` that often meanwhile (waiting for a requeued job to start again)."""
    deadline = time.monotonic() + timeout
    woken = time.monotonic()
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}", pytrace=False)
        if wake_every_s > 0 and time.monotonic() - woken >= wake_every_s:
            wake_backfill()
            woken = time.monotonic()
        time.sleep(0.2)
