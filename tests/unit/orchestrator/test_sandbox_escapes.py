"""Escape attempts against the real sandbox, from a sacrificial "orchestrator" process.

Each case starts a driver process (the orchestrator's stand-in: it holds the run's token in
its environment and in an inheritable fd) that runs hostile code in the sandbox: a
subprocess reading the run's admin token and listing the run directory, /dev/tcp and a
socket to a 127.0.0.1 listener of this test, reading inherited fds and the environment,
SIGKILL to its parent and to the driver, and a double-forked daemon. The driver must survive
and report; no daemon may outlive the run (normal exit or deadline).

Modes: ``namespaces`` (what auto picks as root), the weak ``rlimits`` mode as root (uid
drop), and the weak mode as an unprivileged user (``nobody`` via setpriv: the job user owns
the token, so only Landlock stands between them; each block is asserted where this kernel's
Landlock ABI has it, and is documented as not blockable otherwise).
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from workers.orchestrator.envs import landlock
from workers.orchestrator.envs.sandbox import Sandbox, SandboxLimits, SandboxWeakError

REPO = Path(__file__).resolve().parents[3]
ROOT = os.geteuid() == 0
ABI = landlock.abi()
NOBODY = ROOT and shutil.which("setpriv") and os.path.exists("/usr/bin/python3")
LIMITS = dict(cpu_s=2, memory_mb=256, file_size_kb=64, num_procs=16, num_files=64, timeout_s=4.0, tmp_mb=4,
              output_bytes=16384)

ESCAPE = r'''
import os, signal, socket, subprocess, time
TOKEN, RUN_DIR, PORT, MARKER, LINGER = PARAMS
ORCH = ORCH_PID

def attempt(name, fn):
    try:
        got = fn()
        print(name, "OK", repr(got)[:300], flush=True)
    except BaseException as e:
        print(name, "BLOCKED", type(e).__name__, str(e)[:80], flush=True)

def need(value):
    if not value:
        raise RuntimeError("nothing")
    return value

def fds():
    out = []
    for fd in range(3, 64):
        try:
            out.append(os.pread(fd, 200, 0))
        except OSError:
            pass
    return need(out)

def kill(pid):
    os.kill(pid, signal.SIGKILL)
    return pid

attempt("cat_token", lambda: need(subprocess.run(["cat", TOKEN], capture_output=True, text=True, timeout=5).stdout))
attempt("open_token", lambda: open(TOKEN).read())
attempt("list_run_dir", lambda: os.listdir(RUN_DIR))
attempt("dev_tcp", lambda: need(subprocess.run(["bash", "-c", f"echo hi >/dev/tcp/127.0.0.1/{PORT}"],
                                               capture_output=True, timeout=5).returncode == 0))
attempt("socket", lambda: socket.create_connection(("127.0.0.1", PORT), timeout=2))
attempt("inherited_fds", fds)
print("ENV", sorted(os.environ.items()), flush=True)
attempt("kill_orchestrator", lambda: kill(ORCH))
attempt("kill_parent", lambda: kill(os.getppid()))
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", MARKER])
    os._exit(0)
time.sleep(0.3)
print("DAEMON started", flush=True)
time.sleep(LINGER)
'''

DRIVER = r'''
import asyncio, json, os, sys
from pathlib import Path
from workers.orchestrator.envs.sandbox import Sandbox, SandboxLimits, SandboxWeakError
p = json.loads(sys.argv[1])
secret = open(p["token"]).read()
os.environ.update({"SLURMRL_RUN_DIR": p["run_dir"], "SLURMRL_ADMIN_TOKEN": secret, "HF_TOKEN": secret})
leak = os.open(p["token"], os.O_RDONLY)
os.set_inheritable(leak, True)  # an fd the orchestrator forgot to close
try:
    sb = Sandbox(SandboxLimits(**p["limits"]), mode=p["mode"], scratch_root=p["scratch"],
                 allow_weak=p["allow_weak"], auto_modes=tuple(p["auto_modes"]))
except SandboxWeakError as e:
    print(json.dumps({"refused": str(e)}))
    sys.exit(0)
res = asyncio.run(sb.run_python(["-c", p["code"].replace("ORCH_PID", str(os.getpid()))], project=Path(p["project"])))
print(json.dumps({"mode": res.mode, "rc": res.returncode, "stdout": res.stdout, "stderr": res.stderr,
                  "timed_out": res.timed_out}))
'''


def setup_run(base: Path, *, owner: int) -> dict:
    """A run dir with its 0600 admin token, a project and a scratch root, owned by ``owner``."""
    base.chmod(0o755)
    run_dir, project, scratch = base / "run", base / "project", base / "scratch"
    for d in (run_dir, project, scratch):
        d.mkdir(mode=0o755)
    token = run_dir / "admin_token"
    token.write_text("tok-" + secrets.token_hex(16))
    token.chmod(0o600)
    (run_dir / "ledger.jsonl").write_text("{}\n")
    for p in (run_dir, project, scratch, token, run_dir / "ledger.jsonl"):
        os.chown(p, owner, owner)
    return {"run_dir": str(run_dir), "project": str(project), "scratch": str(scratch), "token": str(token),
            "secret": token.read_text()}


def attack(run: dict, *, mode: str, linger: float = 0.0, as_nobody: bool = False, allow_weak: bool = True,
           auto_modes=("namespaces", "userns")) -> tuple[dict, dict, bool]:
    """(driver's report, {attempt: line}, whether the listener was reached)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.3)
    marker = f"{secrets.randbelow(10**6) + 10**6}.25"
    params = (run["token"], run["run_dir"], listener.getsockname()[1], marker, linger)
    p = {**run, "mode": mode, "limits": LIMITS, "allow_weak": allow_weak, "auto_modes": list(auto_modes),
         "code": ESCAPE.replace("PARAMS", repr(params))}
    python = "/usr/bin/python3" if as_nobody else sys.executable
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_nobody else []
    try:
        out = subprocess.run([*prefix, python, "-c", DRIVER, json.dumps(p)], capture_output=True, text=True,
                             timeout=60, cwd="/tmp", env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
        try:
            listener.accept()[0].close()
            reached = True
        except socket.timeout:
            reached = False
    finally:
        listener.close()
    assert out.returncode == 0 and out.stdout.strip(), f"the orchestrator did not survive: {out}"
    report = json.loads(out.stdout.strip().splitlines()[-1])
    lines = {ln.split(" ", 1)[0]: ln for ln in report.get("stdout", "").splitlines()}
    assert_no_daemon(marker)
    return report, lines, reached


def assert_no_daemon(marker: str) -> None:
    deadline = time.monotonic() + 3
    while True:
        left = []
        for d in os.listdir("/proc"):
            try:
                if d.isdigit() and marker.encode() in Path(f"/proc/{d}/cmdline").read_bytes():
                    left.append(int(d))
            except OSError:
                continue
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"a daemon of the run survived it: {left}"


def blocked(lines: dict, name: str) -> bool:
    return name in lines and " BLOCKED " in lines[name]


def assert_clean_env(report: dict, run: dict) -> None:
    env = next(ln for ln in report["stdout"].splitlines() if ln.startswith("ENV "))
    assert "SLURMRL" not in env and run["run_dir"] not in env and "TOKEN" not in env, env
    assert run["secret"] not in report["stdout"] + report["stderr"], report


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="sandbox-escape-", dir="/tmp"))  # pytest's tmp is 0700: nobody can't enter
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(not ROOT, reason="the namespaces mode needs root")
@pytest.mark.parametrize("linger", [0.0, 30.0], ids=["exit", "deadline"])
def test_namespaces_mode_blocks_every_escape(base, linger):
    run = setup_run(base, owner=0)
    report, lines, reached = attack(run, mode="auto", linger=linger)
    assert report["mode"] == "namespaces" and report["timed_out"] == (linger > 0), report
    for name in ("cat_token", "open_token", "list_run_dir", "dev_tcp", "socket", "inherited_fds", "kill_orchestrator"):
        assert blocked(lines, name), (name, report)
    assert not reached and "DAEMON" in lines
    assert_clean_env(report, run)


@pytest.mark.skipif(not ROOT, reason="the uid drop of the weak mode needs root")
@pytest.mark.parametrize("linger", [0.0, 30.0], ids=["exit", "deadline"])
def test_weak_mode_as_root_drops_to_its_own_uid(base, linger):
    run = setup_run(base, owner=0)
    report, lines, reached = attack(run, mode="rlimits", linger=linger)
    assert report["mode"] == "rlimits" and report["timed_out"] == (linger > 0), report
    for name in ("cat_token", "open_token", "list_run_dir", "inherited_fds", "kill_orchestrator", "kill_parent"):
        assert blocked(lines, name), (name, report)  # another uid: EACCES / EPERM even without Landlock
    if ABI >= 4:
        assert blocked(lines, "dev_tcp") and blocked(lines, "socket") and not reached, report
    assert_clean_env(report, run)


@pytest.mark.skipif(not NOBODY, reason="needs root (to become nobody), setpriv and /usr/bin/python3")
@pytest.mark.parametrize("linger", [0.0, 30.0], ids=["exit", "deadline"])
def test_weak_mode_as_the_job_user(base, linger):
    """Same uid as the token's owner: files, TCP and signals are blocked by Landlock alone."""
    run = setup_run(base, owner=65534)
    report, lines, reached = attack(run, mode="rlimits", linger=linger, as_nobody=True)
    assert report["mode"] == "rlimits" and report["timed_out"] == (linger > 0), report
    assert blocked(lines, "inherited_fds"), report  # closed by the trampoline, Landlock or not
    assert_clean_env(report, run)
    if ABI >= 1:
        for name in ("cat_token", "open_token", "list_run_dir"):
            assert blocked(lines, name), (name, report)
    if ABI >= 4:
        assert blocked(lines, "dev_tcp") and blocked(lines, "socket") and not reached, report
    if ABI >= 6:
        assert blocked(lines, "kill_orchestrator") and blocked(lines, "kill_parent"), report
    if ABI < 6:
        pytest.skip(f"Landlock ABI {ABI} here: the checks it cannot make are documented as not blockable")


@pytest.mark.skipif(not NOBODY, reason="needs root (to become nobody), setpriv and /usr/bin/python3")
def test_auto_refuses_the_weak_mode_for_the_job_user_without_namespaces(base):
    run = setup_run(base, owner=65534)
    report, _, _ = attack(run, mode="auto", as_nobody=True, allow_weak=False, auto_modes=())
    assert "env.sandbox_allow_weak=true" in report["refused"], report


def test_auto_refuses_the_weak_mode_unless_allowed(tmp_path):
    with pytest.raises(SandboxWeakError, match=r"env\.sandbox_allow_weak=true"):
        Sandbox(SandboxLimits(), mode="auto", scratch_root=str(tmp_path), auto_modes=())
    sb = Sandbox(SandboxLimits(), mode="auto", scratch_root=str(tmp_path), auto_modes=(), allow_weak=True)
    assert sb.mode == "rlimits"
    res = asyncio.run(sb.run_python(["-c", "print('ran')"], project=tmp_path))
    assert res.returncode == 0 and res.stdout == "ran\n", res
