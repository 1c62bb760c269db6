"""Every sandbox limit, and escape attempts, against the real sandbox (no fakes).

The default mode is what ``auto`` picks on this machine (``namespaces`` as root, as in CI);
the limits are also checked in the ``userns`` and ``rlimits`` fallbacks where they apply.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from workers.orchestrator.envs.sandbox import TRAMPOLINE, Sandbox, SandboxLimits, live_pids

LIMITS = SandboxLimits(cpu_s=1, memory_mb=128, file_size_kb=64, num_procs=8, num_files=32, timeout_s=4.0, tmp_mb=4,
                       output_bytes=4096)
ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("sandbox")


@pytest.fixture(scope="module")
def project(scratch):
    p = scratch / "project"
    p.mkdir()
    p.chmod(0o755)
    (p / "mod.py").write_text("X = 1\n")
    (p / "mod.py").chmod(0o644)
    return p


def run(code: str, project: Path, scratch: Path, *, mode: str = "auto", **limits):
    sb = Sandbox(SandboxLimits(**{**LIMITS.__dict__, **limits}), mode=mode, scratch_root=str(scratch / "sb"))
    res = asyncio.run(sb.run_python(["-c", textwrap.dedent(code)], project=project))
    return res, sb


def test_auto_mode_isolates_as_root(project, scratch):
    res, sb = run("import os; print(os.getuid(), os.getcwd(), sorted(os.listdir('/')))", project, scratch)
    assert res.returncode == 0, res.stderr
    uid, cwd, listing = res.stdout.split(" ", 2)
    if ROOT:
        assert sb.mode == "namespaces" and int(uid) in sb.uids and int(uid) != 0
        assert cwd == "/work" and "root" not in listing and "home" not in listing


FALLBACKS = ["auto", "userns", "rlimits"]


@pytest.mark.parametrize("mode", FALLBACKS)
def test_cpu_time_limit(project, scratch, mode):
    res, _ = run("while True: pass", project, scratch, mode=mode, timeout_s=20.0)
    assert res.signal in (24, 9) and not res.timed_out, res  # SIGXCPU at the soft limit (SIGKILL one second later)


@pytest.mark.parametrize("mode", FALLBACKS)
def test_memory_limit(project, scratch, mode):
    res, _ = run("x = bytearray(512 << 20)", project, scratch, mode=mode)
    assert res.returncode == 1 and "MemoryError" in res.stderr, res


@pytest.mark.parametrize("mode", FALLBACKS)
def test_file_size_limit(project, scratch, mode):
    res, _ = run("""
        import os, tempfile
        with open(os.path.join(tempfile.gettempdir(), 'big'), 'wb') as f:
            f.write(b'x' * (256 << 10))
    """, project, scratch, mode=mode)
    assert res.returncode == 1 and "File too large" in res.stderr, res


def test_tmp_is_a_small_private_tmpfs(project, scratch):
    res, _ = run("""
        for i in range(100):
            open(f'/tmp/f{i}', 'wb').write(b'x' * (60 << 10))
    """, project, scratch)
    assert res.returncode == 1 and "No space left on device" in res.stderr, res


def test_open_files_limit(project, scratch):
    res, _ = run("fs = [open('/dev/null') for _ in range(100)]", project, scratch)
    assert res.returncode == 1 and "Too many open files" in res.stderr, res


@pytest.mark.parametrize("mode", ["auto", "rlimits"])
def test_process_limit_stops_a_fork_bomb(project, scratch, mode):
    if not ROOT:
        pytest.skip("RLIMIT_NPROC is per uid: only a uid of its own (root drops to one) makes it a sandbox limit")
    res, sb = run("""
        import os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as e:
            print(n, e.errno)
    """, project, scratch, mode=mode, timeout_s=3.0)
    forks, errno = map(int, res.stdout.split())
    assert forks < LIMITS.num_procs and errno == 11, res  # EAGAIN
    assert_none_left(sb)


def test_wall_clock_limit_kills_everything(project, scratch):
    res, sb = run("""
        import os, time
        if os.fork() == 0:
            os.setsid()          # a daemon trying to outlive the run
            time.sleep(60)
        time.sleep(60)
    """, project, scratch, timeout_s=1.0)
    assert res.timed_out and res.wall_s < 4, res
    assert_none_left(sb)


def test_output_is_capped(project, scratch):
    res, _ = run("print('x' * 100000)", project, scratch)
    assert res.returncode == 0 and len(res.stdout) == LIMITS.output_bytes


def test_no_network(project, scratch):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    res, _ = run(f"""
        import socket
        for addr in [('127.0.0.1', {port}), ('8.8.8.8', 53)]:
            try:
                socket.create_connection(addr, timeout=1)
                print('CONNECTED', addr)
            except OSError as e:
                print('refused', e.errno)
    """, project, scratch)
    with pytest.raises(socket.timeout):
        server.accept()  # nothing ever reached the host's listener
    server.close()
    assert "CONNECTED" not in res.stdout and res.stdout.count("refused") == 2, res


def test_cannot_write_outside_scratch_or_read_the_run_dir(project, scratch, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "admin_token").write_text("secret")
    marker = f"/tmp/escape-{uuid.uuid4().hex}"
    res, _ = run(f"""
        import os
        for path in ['{run_dir}/admin_token', '/etc/passwd', '/proc/1/environ']:
            try:
                print('READ', path, open(path).read()[:20])
            except OSError as e:
                print('denied', path, type(e).__name__)
        for path in ['{marker}', '/work/mod.py', '{run_dir}/evil', '/usr/evil']:
            try:
                open(path, 'w').write('x')
                print('WROTE', path)
            except OSError as e:
                print('denied', path, type(e).__name__)
        try:
            os.setuid(0)
            print('ROOT')
        except OSError:
            print('denied setuid')
    """, project, scratch)
    assert "secret" not in res.stdout and "ROOT" not in res.stdout, res
    assert not any(line.startswith("READ") for line in res.stdout.splitlines()), res
    written = [line for line in res.stdout.splitlines() if line.startswith("WROTE")]
    assert written == [f"WROTE {marker}"], res  # its own private /tmp only
    assert not os.path.exists(marker) and not (run_dir / "evil").exists()
    assert (project / "mod.py").read_text() == "X = 1\n"


def test_rlimits_fallback_runner_blocks_sockets_and_outside_reads(project, scratch, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    (project / "test_escape.py").write_text(textwrap.dedent(f"""
        import socket
        def test_socket():
            socket.socket()
        def test_read():
            open({str(secret)!r}).read()
        def test_ok():
            assert True
    """))
    (project / "test_escape.py").chmod(0o644)
    sb = Sandbox(LIMITS, mode="rlimits", scratch_root=str(scratch / "sb"))
    res = asyncio.run(sb.run_python([sb.runner, "test_escape.py"], project=project, stdin=b"N\n"))
    (project / "test_escape.py").unlink()
    lines = sorted(res.stdout.splitlines())
    assert lines[0].startswith("N ERROR test_escape.py::test_read PermissionError"), res
    assert lines[1].startswith("N ERROR test_escape.py::test_socket PermissionError"), res
    assert lines[2] == "N PASS test_escape.py::test_ok"


def assert_none_left(sb: Sandbox) -> None:
    deadline = time.monotonic() + 3
    while (left := live_pids(set(sb.uids))) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel finishes SIGKILLed processes asynchronously
    assert not left, f"sandbox processes survived the run: {left}"


@pytest.mark.skipif(not (ROOT and shutil.which("setpriv") and os.path.exists("/usr/bin/python3")),
                    reason="needs root (to become nobody), setpriv and /usr/bin/python3")
def test_userns_mode_works_for_an_unprivileged_user():
    """What a non-root orchestrator on a Slurm node gets: the trampoline itself runs as nobody."""
    base = Path(tempfile.mkdtemp(prefix="sandbox-userns-", dir="/tmp"))  # pytest's tmp is 0700: nobody can't enter
    try:
        base.chmod(0o755)
        project = base / "project"
        project.mkdir(mode=0o755)
        sb = Sandbox(LIMITS, mode="userns", scratch_root=str(base / "sb"))
        (base / "sb").chmod(0o755)
        code = "import os, socket\nprint(os.getuid(), sorted(os.listdir('/')))\nsocket.create_connection(('127.0.0.1', 22), 1)"
        spec = sb._spec("userns", ["-c", code], project, None, None)
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I",
                              "-S", str(TRAMPOLINE), json.dumps(spec)], capture_output=True, text=True, timeout=30)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert out.stdout.startswith("0 ['bin', 'dev'") and "work" in out.stdout, out  # root of its own namespace only
    assert "Network is unreachable" in out.stderr, out
