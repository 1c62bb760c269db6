"""The admin token is on no command line (/proc/<pid>/cmdline is world-readable: ``ps`` shows it).

1. A real local run (``python -m launcher``, tiny): while it runs, every descendant of the
   launcher is found through /proc and its cmdline read; none may hold the token.
2. The SGLang backend's wrapper (workers/inference/sglang/keyed.py) in front of the real smg
   1.13.0 router: smg must get the key (it sends ``Authorization: Bearer`` to its worker, an
   HTTP stub here: SGLang itself needs GPUs) while its own cmdline and its children's do not
   hold it. (The SGLang side of the wrapper is parsed by SGLang's own parser in
   tests/unit/inference/test_sglang_parser.py.)
"""
from __future__ import annotations

import http.server
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from tests.conftest import REPO
from tests.integration.conftest import SMALL, assert_no_children_left, metrics
from tests.helpers.netutil import free_port


def descendants(root: int) -> list[int]:
    """Pids below ``root`` (children of children ...), from /proc/<pid>/stat."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parent[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        kids = [p for p, pp in parent.items() if pp == pid]
        out += kids
        todo += kids
    return out


def cmdlines(pids: list[int]) -> dict[int, bytes]:
    out = {}
    for pid in pids:
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # exited between the scan and the read
        if line:  # a zombie's is empty: keep what the process showed while alive
            out[pid] = line
    return out


def test_local_run_puts_the_token_on_no_command_line(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", *SMALL, "trainer.num_steps=4",
           f"launcher.run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: dict[int, bytes] = {}
    token = None
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if token is None and (run_dir / "admin_token").exists():
                token = (run_dir / "admin_token").read_text().strip() or None
            seen.update(cmdlines([proc.pid, *descendants(proc.pid)]))
            time.sleep(0.1)
        out = proc.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert token and len(token) >= 16
    assert len(metrics(run_dir)) == 4
    roles = {role for role in ("workers.trainer", "workers.inference", "workers.orchestrator")
             if any(role.encode() in c for c in seen.values())}
    assert len(roles) == 3, f"did not see every role's process: {[c[:120] for c in seen.values()]}"
    leaking = {pid: c.replace(b"\0", b" ")[:200] for pid, c in seen.items() if token.encode() in c}
    assert not leaking, f"the admin token is on these command lines: {leaking}"
    assert_no_children_left(run_dir)


class _Worker(http.server.BaseHTTPRequestHandler):
    """A stand-in for an SGLang server behind smg: answers every GET/POST with {} and records auth."""

    seen: list = []

    def do_GET(self):
        self.seen.append(self.headers.get("Authorization"))
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_smg_gets_the_key_through_the_wrapper_not_argv(tmp_path):
    token = "tok-" + secrets.token_hex(16)
    key_file = tmp_path / "admin_token"
    key_file.write_text(token + "\n")
    key_file.chmod(0o600)
    worker = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Worker)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    port = free_port()
    argv = [sys.executable, "-m", "workers.inference.sglang.keyed", "smg.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--worker-urls", f"http://127.0.0.1:{worker.server_address[1]}",
            "--policy", "round_robin", "--log-level", "warn"]
    env = {**os.environ, "SLURMRL_API_KEY_FILE": str(key_file), "PYTHONPATH": str(REPO)}
    router = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline, healthy, seen = time.monotonic() + 60, False, {}
        while time.monotonic() < deadline and not (healthy and f"Bearer {token}" in _Worker.seen):
            seen.update(cmdlines([router.pid, *descendants(router.pid)]))
            try:
                healthy = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
            except OSError:
                pass
            assert router.poll() is None, router.communicate()[0].decode(errors="replace")[-3000:]
            time.sleep(0.2)
        seen.update(cmdlines([router.pid, *descendants(router.pid)]))
    finally:
        router.kill()
        log = router.communicate(timeout=30)[0].decode(errors="replace")
        worker.shutdown()
    assert healthy and f"Bearer {token}" in _Worker.seen, (healthy, _Worker.seen[:5], log[-2000:])
    assert seen and not any(token.encode() in c for c in seen.values()), seen
    assert token not in log


def test_the_wrapper_refuses_a_key_file_others_can_read(tmp_path):
    key_file = tmp_path / "admin_token"
    key_file.write_text("tok-readable\n")
    key_file.chmod(0o644)
    env = {**os.environ, "SLURMRL_API_KEY_FILE": str(key_file), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "workers.inference.sglang.keyed", "smg.launch_router", "--help"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "mode 600" in out.stderr and "tok-readable" not in out.stderr + out.stdout, out
