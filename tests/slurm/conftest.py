"""Fixtures for tests that run against a real (local) Slurm cluster.

These tests never skip: CI must exercise real Slurm, so a missing cluster is an error.
If no cluster answers, `slurm_cluster` starts one with tests/slurm/cluster.sh (which
installs Slurm if needed) and stops it again at the end of the session.
"""

import os
import subprocess
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
