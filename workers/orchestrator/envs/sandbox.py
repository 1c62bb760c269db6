"""Run untrusted Python (the model's code and its tests) in a subprocess sandbox, async.

What is enforced, and how (the isolation itself is in sandbox_exec.py, a trampoline
script this module starts with ``asyncio.create_subprocess_exec``):

  CPU time      RLIMIT_CPU (SIGXCPU at the soft limit, SIGKILL one second later)
  memory        RLIMIT_AS (allocations fail with MemoryError / ENOMEM)
  file size     RLIMIT_FSIZE (writes past it fail with EFBIG) + /tmp is a tmpfs of ``tmp_mb``
  processes     RLIMIT_NPROC for a uid of its own (fork fails with EAGAIN)
  open files    RLIMIT_NOFILE
  wall clock    ``timeout_s``: the trampoline's process group is SIGKILLed; its PID
                namespace init dies by parent-death signal and takes every process with it
  network       a new network namespace with no interface up (``namespaces``/``userns``)
  filesystem    a new root: read-only /usr (+ interpreter prefix) and project at /work,
                private /tmp; the run directory and every other path are absent
  user          root drops to uid ``uid_base + slot`` (no passwd entry needed, no groups)

Why a uid per concurrent run instead of ``nobody``: RLIMIT_NPROC counts processes per
uid, so with a shared uid one episode's fork bomb would starve every other episode's
tests, and episodes could signal each other's processes.

Mode ``auto`` probes once per process, when the Sandbox is built (the env's start):
``namespaces`` when root, else ``userns``. When neither works it does not degrade silently:
it raises :class:`SandboxWeakError` naming ``env.sandbox_allow_weak``, unless the caller
allowed the weak ``rlimits`` mode (``allow_weak=True``). The weak mode still keeps the code
away from the run: its own uid when root, a private copy as cwd/HOME/TMPDIR, no inherited
fds, a clean environment (no SLURMRL_*, tokens or run paths), a subreaper that kills every
leftover process, and Landlock where the kernel has it (landlock.py; which protections
apply is logged). What it cannot block without root or Landlock is listed in sandbox_exec.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from workers.orchestrator.envs.sandbox_uids import uid_pool

log = logging.getLogger("slurmrl.sandbox")
HERE = Path(__file__).resolve().parent
TRAMPOLINE = HERE / "sandbox_exec.py"
RUNNER = HERE / "sandbox_runner.py"
INSIDE_PROJECT, INSIDE_RUNNER = "/work", "/sandbox/runner.py"
MODES = ("auto", "namespaces", "userns", "rlimits")
SETUP_FAILED = 125
_probed: dict[tuple, tuple[str, str]] = {}  # (python, scratch, candidates) -> (mode, why not isolated)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    cpu_s: int = 2
    """CPU seconds per run (RLIMIT_CPU)."""
    memory_mb: int = 256
    """Address space per process in MiB (RLIMIT_AS)."""
    file_size_kb: int = 1024
    """Largest file a process may write, KiB (RLIMIT_FSIZE)."""
    num_procs: int = 16
    """Processes of the sandbox uid (RLIMIT_NPROC)."""
    num_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    timeout_s: float = 5.0
    """Wall-clock deadline of one run."""
    tmp_mb: int = 16
    """Size of the private /tmp tmpfs."""
    output_bytes: int = 65536
    """stdout and stderr are each cut to this many bytes (the rest is read and dropped)."""


@dataclasses.dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    mode: str

    @property
    def signal(self) -> Optional[int]:
        """Signal that killed the program (from the 128 + N convention), or None."""
        return self.returncode - 128 if self.returncode > 128 else None


class SandboxSetupError(RuntimeError):
    """The sandbox itself could not be built (not the program's fault)."""


class SandboxWeakError(SandboxSetupError):
    """``auto`` found only the weak rlimits mode and the weak mode was not allowed."""


WEAK_REFUSED = ("sandbox: mode auto found no namespaces here ({where}: {why}); "
                "only the weak rlimits mode is left, where untrusted code runs as the job user. Refusing to run "
                "untrusted code; set env.sandbox_allow_weak=true to accept the weak mode ({protections}), or run "
                "where user namespaces are enabled")


PROOF = "import sys; print('slurmrl-python', *sys.version_info[:3])"
"""What an interpreter must answer to ``-I -S -c`` to be taken as Python 3 (its version after the tag)."""


def prove_python(python: str, timeout_s: float = 20.0) -> str:
    """The version of ``python`` ("3.12.3"), proven by running it; SandboxSetupError otherwise.

    Why: the tests of every episode run as ``python -I -S runner.py``; an executable that is not
    Python (``/bin/true``, a shell script, a Python 2) exits without running a test, and every
    episode would score 0 with nothing reported. Run outside the sandbox: it proves what the file
    is, not that the sandbox can run it (mode ``auto``'s probe does that)."""
    try:
        res = subprocess.run([python, "-I", "-S", "-c", PROOF], capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except subprocess.TimeoutExpired:
        raise SandboxSetupError(f"sandbox python {python!r} did not answer `-c print(version)` within "
                                f"{timeout_s:g} s: not a Python interpreter?") from None
    except OSError as e:
        raise SandboxSetupError(f"sandbox python {python!r} cannot be run ({e})") from None
    words = res.stdout.split()
    if res.returncode != 0 or len(words) != 4 or words[0] != "slurmrl-python" or words[1] != "3":
        said = (res.stdout.strip() or res.stderr.strip() or "nothing")[-200:]
        raise SandboxSetupError(f"sandbox python {python!r} is not a Python 3 interpreter: asked to print its version "
                                f"it exited {res.returncode} and said {said!r}")
    return ".".join(words[1:])


class Sandbox:
    """One sandbox configuration; ``run_python`` may be called concurrently."""

    def __init__(self, limits: SandboxLimits, *, mode: str = "auto", python: Optional[str] = None,
                 scratch_root: Optional[str] = None, uid_base: int = 61000, num_uids: int = 64,
                 allow_weak: bool = False, auto_modes: tuple[str, ...] = ("namespaces", "userns")):
        """``auto_modes``: the isolating modes ``auto`` tries, in order (each only where it can
        work: ``namespaces`` needs root). Passing ``()`` shows auto a host without namespaces.
        ``python``: the interpreter that runs the code; it must be an executable file (a named one is
        never replaced by another); None: /usr/bin/python3 where it exists, else this interpreter."""
        if mode not in MODES:
            raise ValueError(f"sandbox mode {mode!r} is unknown; choose one of {MODES}")
        self.limits, self.requested_mode = limits, mode
        if python is None:
            python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise SandboxSetupError(f"sandbox python {python!r} is not an executable file")
        self.python = os.path.realpath(python)
        self.python_version = prove_python(self.python)
        self.scratch_root = Path(scratch_root or Path(tempfile.gettempdir()) / "slurmrl-sandbox")
        self.scratch_root.mkdir(parents=True, exist_ok=True)
        self.mountpoint = self.scratch_root / ".root"  # each run mounts its own tmpfs here, privately
        self.mountpoint.mkdir(exist_ok=True)
        self.pool = uid_pool(uid_base, num_uids)
        self.uids = self.pool.uids
        self.allow_weak = allow_weak
        self.mode = mode if mode != "auto" else self._detect(tuple(auto_modes))
        if self.mode == "rlimits":
            log.warning("sandbox: weak rlimits mode (%s); Landlock here blocks: %s", "requested" if mode == "rlimits"
                        else "allowed by env.sandbox_allow_weak", ", ".join(weak_protections()) or "nothing")

    @property
    def runner(self) -> str:
        """Path of the test runner as the sandboxed program sees it."""
        return str(RUNNER) if self.mode == "rlimits" else INSIDE_RUNNER

    async def resolve_mode(self) -> str:
        return self.mode

    def _detect(self, candidates: tuple[str, ...]) -> str:
        """``auto``: the first isolating mode that runs ``python -c pass`` here (cached per
        interpreter, scratch root and candidates); else rlimits if allowed, else SandboxWeakError."""
        key = (self.python, str(self.scratch_root), candidates)
        if key not in _probed:
            _probed[key] = self._probe(candidates)
        mode, why = _probed[key]
        if mode == "rlimits" and not self.allow_weak:
            where = ("running as root, but neither the namespaces nor the userns mode ran the interpreter"
                     if os.geteuid() == 0 else "not root and user namespaces are unavailable")
            raise SandboxWeakError(WEAK_REFUSED.format(where=where, why=why, protections="Landlock here blocks: " + (
                ", ".join(weak_protections()) or "nothing")))
        return mode

    def _probe(self, candidates: tuple[str, ...]) -> tuple[str, str]:
        empty = Path(tempfile.mkdtemp(dir=self.scratch_root))
        empty.chmod(0o755)
        why = []
        try:
            for mode in candidates:
                if mode == "namespaces" and os.geteuid() != 0:
                    continue
                spec = self._spec(mode, ["-c", "pass"], empty, None, None)
                res = subprocess.run([sys.executable, "-I", "-S", str(TRAMPOLINE), json.dumps(spec)],
                                     capture_output=True, text=True, timeout=30, start_new_session=True)
                if res.returncode == 0:
                    return mode, ""
                why.append(f"{mode}: {res.stderr.strip()[-200:]}")
                log.info("sandbox mode %s unavailable: %s", mode, res.stderr.strip()[-300:])
        finally:
            shutil.rmtree(empty, ignore_errors=True)
        return "rlimits", "; ".join(why) or "no isolating mode was tried"

    async def run_python(self, args: list[str], *, project: Path, stdin: bytes = b"") -> SandboxResult:
        """``python -I -S ARGS`` with ``project`` as cwd (read-only /work inside the namespaces).

        ``project`` must be world-readable (dirs 755, files 644): the sandbox uid reads it.
        """
        mode = await self.resolve_mode()
        res = await self._run(mode, args, Path(project), stdin)
        if res.returncode == SETUP_FAILED and res.stderr.startswith("sandbox:"):
            raise SandboxSetupError(res.stderr.strip())
        return res

    async def _run(self, mode: str, args: list[str], project: Path, stdin: bytes) -> SandboxResult:
        root = os.geteuid() == 0
        uid = await self._take_uid() if root and mode != "userns" else None
        copy = None
        try:
            if mode == "rlimits":  # no read-only mount to protect the agent's files: work on a copy
                copy = Path(tempfile.mkdtemp(dir=self._copies_dir()))
                shutil.copytree(project, copy, dirs_exist_ok=True)
                if uid is not None:
                    for p in [copy, *copy.rglob("*")]:
                        os.chown(p, uid, uid)
            spec = self._spec(mode, args, project, copy, uid)
            return await self._exec(spec, stdin, mode, uid)
        finally:
            if copy is not None:
                shutil.rmtree(copy, ignore_errors=True)
            if uid is not None:
                await self._give_uid(uid)

    def _spec(self, mode: str, args: list[str], project: Path, copy: Optional[Path], uid: Optional[int]) -> dict:
        lim = self.limits
        # without a uid of its own, RLIMIT_NPROC counts the job user's processes (+1: the weak mode's reaper)
        num_procs = lim.num_procs if uid is not None else lim.num_procs + _processes_of(os.getuid()) + 1
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONHASHSEED": "0", "TMPDIR": "/tmp"}
        spec = {"mode": mode, "uid": uid, "gid": uid, "argv": [self.python, "-I", "-S", *args],
                "limits": {"cpu_s": lim.cpu_s, "memory_bytes": lim.memory_mb << 20,
                           "file_size_bytes": lim.file_size_kb << 10, "num_procs": num_procs,
                           "num_files": lim.num_files}}
        if mode == "rlimits":  # a clean environment: nothing of the run's (no SLURMRL_*, tokens, paths)
            env.update({"SANDBOX_AUDIT": "1", "TMPDIR": str(copy), "HOME": str(copy)})
            prefix = os.path.dirname(os.path.dirname(self.python))
            read = ["/usr", "/bin", "/lib", "/lib64", "/etc", prefix, str(RUNNER)]
            write = [str(copy), "/dev/null", "/dev/zero", "/dev/urandom"]
            return {**spec, "cwd": str(copy), "env": env, "landlock": {"read": read, "write": write}}
        binds = [["/usr", "/usr", False], [str(project.resolve()), INSIDE_PROJECT, False], [str(RUNNER), INSIDE_RUNNER, False]]
        prefix = os.path.dirname(os.path.dirname(self.python))
        if not prefix.startswith("/usr"):
            binds.append([prefix, prefix, False])
        symlinks = {}
        for top in ("/bin", "/sbin", "/lib", "/lib64"):
            if os.path.islink(top):
                symlinks[top] = os.readlink(top)
            elif os.path.isdir(top):
                binds.append([top, top, False])
        return {**spec, "cwd": INSIDE_PROJECT, "env": env, "root": str(self.mountpoint), "binds": binds,
                "symlinks": symlinks, "tmp_mb": lim.tmp_mb}

    async def _exec(self, spec: dict, stdin: bytes, mode: str, uid: Optional[int]) -> SandboxResult:
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", str(TRAMPOLINE), json.dumps(spec), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        cap = self.limits.output_bytes
        work = asyncio.gather(_feed(proc, stdin), _read_capped(proc.stdout, cap), _read_capped(proc.stderr, cap),
                              proc.wait())
        timed_out = False
        try:
            _, out, err, code = await asyncio.wait_for(asyncio.shield(work), self.limits.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            if mode == "rlimits":  # the trampoline's reaper kills the program and every daemon, then exits
                await _terminate_reaper(proc)
            _kill_group(proc.pid)
            if mode == "rlimits" and uid is not None:
                await _kill_uid(uid)
            try:
                _, out, err, code = await asyncio.wait_for(work, 5.0)
            except asyncio.TimeoutError:  # an orphan still holds a pipe (rlimits mode without root)
                out, err, code = b"", b"sandbox: output pipes still open after kill", -signal.SIGKILL
        finally:
            if mode == "rlimits" and uid is not None:
                await _kill_uid(uid)  # background processes left behind by a finished run
        code = 128 - code if code < 0 else code
        return SandboxResult(returncode=code, stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                             timed_out=timed_out, wall_s=time.monotonic() - t0, mode=mode)

    def _copies_dir(self) -> Path:
        """rlimits mode: the sandbox uid must traverse every ancestor of its cwd copy."""
        for base in (self.scratch_root, Path(tempfile.gettempdir()) / "slurmrl-sandbox-copies"):
            base.mkdir(mode=0o711, exist_ok=True)
            if all(p.stat().st_mode & 0o001 for p in [base, *base.parents]):
                return base
        raise SandboxSetupError(f"no directory the sandbox uid can enter for its copy (tried {self.scratch_root})")

    async def _take_uid(self) -> int:
        return await self.pool.take()

    async def _give_uid(self, uid: int) -> None:
        await self.pool.give(uid)


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    try:
        if data:
            proc.stdin.write(data)
            await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading its stdin


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    kept = bytearray()
    while chunk := await stream.read(65536):
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]
    return bytes(kept)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _terminate_reaper(proc: asyncio.subprocess.Process) -> None:
    try:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.shield(proc.wait()), 2.0)
    except (ProcessLookupError, asyncio.TimeoutError):
        pass


def weak_protections() -> list[str]:
    """What Landlock blocks in the weak mode on this kernel (landlock.py); [] without Landlock."""
    from workers.orchestrator.envs import landlock

    return landlock.protections(landlock.abi())


def _processes_of(uid: int) -> int:
    return len(live_pids({uid}))


def live_pids(uids: set[int]) -> list[int]:
    """Pids of running (not zombie) processes owned by ``uids``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid in uids:
                    with open(f"/proc/{d}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            out.append(int(d))
            except (OSError, IndexError):
                continue
    return out


async def _kill_uid(uid: int, *, deadline_s: float = 2.0) -> None:
    """SIGKILL every process of ``uid`` until none is left (rlimits mode: no PID namespace
    collects them, and a process may fork between the scan and the kill)."""
    end = time.monotonic() + deadline_s
    while (pids := live_pids({uid})) and time.monotonic() < end:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        await asyncio.sleep(0.02)
