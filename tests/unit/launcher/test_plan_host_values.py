"""Paths and values only this machine can judge (issue 35 item 6), refused at plan time.

Each case goes through ``python -m launcher`` as a user runs it: exit 2, ``slurmrl: error`` naming
the key, no Python traceback, and nothing written (neither the run directory nor the runs root).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher.host_checks import HostCheckError, check_dir_usable

ROOT = Path(__file__).resolve().parents[3]
CR = "env=code_repair model.vocab_size=264 model.max_position_embeddings=576 env.sandbox_allow_weak=true "

CASES = [
    # (overrides, key named); {tmp} is this test's temporary directory
    ("launcher.run_dir=/proc/1/nope", "launcher.run_dir"),
    ("launcher.run_dir=/dev/null/x", "launcher.run_dir"),
    ("launcher.run_dir=/proc/self/fd/x", "launcher.run_dir"),
    ("launcher.run_dir={tmp}/afile/run", "launcher.run_dir"),
    ("cluster.runs_root=/dev/null/x", "cluster.runs_root"),
    ("cluster.runs_root=/proc/1/nope", "cluster.runs_root"),
    ("cluster.runs_root=/sys/kernel/x", "cluster.runs_root"),
    ("inference.host=not_a_host", "inference.host"),
    ("inference.host=203.0.113.7", "inference.host"),  # resolvable, but no address of this machine
    (CR + "env.sandbox_python=/nonexistent/python", "env.sandbox_python"),
    (CR + "env.sandbox_python={tmp}/afile", "env.sandbox_python"),  # exists, not executable
    (CR + "env.sandbox_python={tmp}", "env.sandbox_python"),  # a directory
    (CR + "env.sandbox_python=/bin/true", "env.sandbox_python: sandbox python '/bin/true' is not a Python 3"),
    (CR + "env.sandbox_python=/bin/false", "env.sandbox_python: sandbox python '/bin/false' is not a Python 3"),
    ("cluster=local_slurm cluster.container.image=X", "cluster.container.runtime"),
    ("cluster=local_slurm cluster.container.mounts=[/a:/b]", "cluster.container.runtime"),
]


@pytest.mark.parametrize("override, key", CASES, ids=[c[0] for c in CASES])
def test_cli_refuses_path_or_value_naming_the_key(override, key, tmp_path):
    (tmp_path / "afile").write_text("not a directory, not executable\n")
    runs = tmp_path / "runs"
    args = override.format(tmp=tmp_path).split()
    defaults = [f"cluster.runs_root={runs}"] if "cluster.runs_root" not in override else []
    before = sorted(p.name for p in tmp_path.iterdir())
    res = subprocess.run([sys.executable, "-m", "launcher", *args, *defaults, "launcher.dry_run=true"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    assert "slurmrl: error" in res.stderr and key in res.stderr, res.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "something was written for a refused config"


def test_check_dir_usable_accepts_a_new_dir_under_tmp(tmp_path):
    check_dir_usable("launcher.run_dir", tmp_path / "a" / "b")  # created later, parents writable
    (tmp_path / "ro").mkdir(mode=0o500)
    if not __import__("os").access(tmp_path / "ro", __import__("os").W_OK):  # root can write anywhere
        with pytest.raises(HostCheckError, match="launcher.run_dir.*not writable"):
            check_dir_usable("launcher.run_dir", tmp_path / "ro" / "run")


def test_check_dir_usable_refuses_an_existing_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(HostCheckError, match="cluster.runs_root.*not a directory"):
        check_dir_usable("cluster.runs_root", tmp_path / "f")


def test_sandbox_never_swaps_a_named_interpreter(tmp_path):
    """On a Slurm node there is no launcher host check: the env's sandbox itself refuses a missing
    interpreter (it used to run this one instead, silently)."""
    from workers.orchestrator.envs.sandbox import Sandbox, SandboxLimits, SandboxSetupError

    with pytest.raises(SandboxSetupError, match="/nonexistent/python"):
        Sandbox(SandboxLimits(), mode="rlimits", python="/nonexistent/python", scratch_root=str(tmp_path),
                allow_weak=True)
    assert Sandbox(SandboxLimits(), mode="rlimits", python=sys.executable, scratch_root=str(tmp_path),
                   allow_weak=True).python == __import__("os").path.realpath(sys.executable)


def test_max_nonfinite_skips_has_a_range(tmp_path):
    from launcher.plan import PlanError, build_plan
    from tests.conftest import compose

    with pytest.raises((PlanError, ValueError), match="weights.max_nonfinite_skips"):
        build_plan(compose(["weights.max_nonfinite_skips=0", f"cluster.runs_root={tmp_path}"]))


def fake_python(path: Path, answer: str) -> str:
    """An executable that answers the version proof with ``answer`` and fails everything else."""
    path.write_text(f"#!/bin/sh\ncase \"$*\" in *slurmrl-python*) echo '{answer}'; exit 0;; esac\nexit 1\n")
    path.chmod(0o755)
    return str(path)


def test_the_sandbox_interpreter_must_prove_it_is_python_3(tmp_path):
    """Issue 47 item 7: ``/bin/true`` used to be accepted and every test scored 0, silently."""
    from workers.orchestrator.envs.sandbox import SandboxSetupError, prove_python

    assert prove_python(sys.executable) == ".".join(map(str, sys.version_info[:3]))
    for python, said in [("/bin/true", "exited 0 and said 'nothing'"), ("/bin/false", "exited 1"),
                         (fake_python(tmp_path / "py2", "slurmrl-python 2 7 18"), "said 'slurmrl-python 2 7 18'")]:
        with pytest.raises(SandboxSetupError, match=f"'{python}' is not a Python 3 interpreter.*{said}"):
            prove_python(python)
    hangs = tmp_path / "hangs"
    hangs.write_text("#!/bin/sh\nexec sleep 30\n")
    hangs.chmod(0o755)
    with pytest.raises(SandboxSetupError, match="did not answer .* within 0.5 s"):
        prove_python(str(hangs), timeout_s=0.5)


def test_auto_says_running_as_root_when_root_and_no_mode_ran(tmp_path):
    """An interpreter that passes the proof but runs nothing: as root, the refusal must not say 'not root'."""
    import os

    from workers.orchestrator.envs.sandbox import Sandbox, SandboxLimits, SandboxWeakError

    python = fake_python(tmp_path / "py", "slurmrl-python 3 12 0")
    with pytest.raises(SandboxWeakError) as e:
        Sandbox(SandboxLimits(), mode="auto", python=python, scratch_root=str(tmp_path / "s"))
    if os.geteuid() == 0:
        assert "running as root, but neither the namespaces nor the userns mode ran" in str(e.value)
        assert "not root" not in str(e.value)
    else:
        assert "not root and user namespaces are unavailable" in str(e.value)
