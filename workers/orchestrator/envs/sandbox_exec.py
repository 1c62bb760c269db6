"""Sandbox trampoline: ``python -I -S sandbox_exec.py SPEC_JSON`` isolates, limits, then execs.

Stdlib only and run as a plain script (never imported by the orchestrator), because
everything here happens in a fresh process just before untrusted code runs, and the
asyncio orchestrator cannot use ``preexec_fn`` safely (it has threads). Linux only.

Modes (SPEC ``mode``; workers/orchestrator/envs/sandbox.py picks one):

``namespaces`` (root): unshare mount, network, PID, IPC and UTS namespaces; fork
    the PID-namespace init (a reaper, so rlimit signals reach the program normally and
    every leftover process dies with it); build a new root on a tmpfs with read-only
    binds of /usr (and the interpreter's prefix), the project read-only at /work, a
    size-limited tmpfs at /tmp, /dev/{null,zero,urandom}; chroot; set rlimits; drop to an
    unprivileged uid/gid with no groups, ``no_new_privs`` and a parent-death SIGKILL;
    exec. The new network namespace has only a loopback that is down: no socket can
    reach anything. The run directory, other episodes' scratch dirs and the rest of the
    host filesystem do not exist inside.
``userns`` (unprivileged user): the same, inside a new user namespace mapping the
    caller's uid to root; no uid change is possible there, so RLIMIT_NPROC counts all of
    the caller's processes (sandbox.py adds the current count).
``rlimits`` (the weak mode, only with ``env.sandbox_allow_weak=true`` or an explicit
    ``sandbox_mode=rlimits``): rlimits, the uid drop when root, every inherited fd
    closed, a clean environment, cwd/HOME/TMPDIR a throwaway copy of the project, and
    Landlock where the kernel has it (landlock.py: files outside the copy and the
    interpreter, TCP connect/bind from ABI 4, signals to and abstract sockets of
    processes outside the sandbox from ABI 6). The trampoline stays as the program's
    parent, a child subreaper: orphans and daemons are re-parented to it and killed when
    the program exits or at SIGTERM (the deadline). What stays open without root and
    without Landlock: reading the job user's files, 127.0.0.1 services, signals to the
    job user's processes (sandbox.py logs what applies).

Exit status: the program's, or 128 + signal when a signal killed it; 125 when the
sandbox itself could not be set up (the message is on stderr, prefixed ``sandbox:``).
"""
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36
SETUP_FAILED = 125
LANDLOCK = None  # weak mode: landlock.py, loaded before the uid drop

libc = ctypes.CDLL(None, use_errno=True)


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src, dst, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {src} -> {dst}")


def bind(root: str, src: str, dst: str, *, writable: bool, device: bool = False) -> None:
    target = root + dst
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(src, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | (0 if device else MS_NODEV) | (0 if writable else MS_RDONLY)
    mount(None, target, None, flags | locked_flags(target))


def locked_flags(path: str) -> int:
    """Flags a bind remount must keep: inside a user namespace the kernel refuses to clear
    the source mount's noexec/atime flags (bubblewrap does the same dance)."""
    have = os.statvfs(path).f_flag
    flags = MS_NOEXEC if have & os.ST_NOEXEC else 0
    for st, ms in ((os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        flags |= ms if have & st else 0
    return flags


def build_root(spec: dict) -> None:
    """Mount the sandbox's filesystem under spec['root'] and chroot into it."""
    root = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount leaks back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    for link, target in spec.get("symlinks", {}).items():
        os.symlink(target, root + link)
    for src, dst, writable in spec["binds"]:
        bind(root, src, dst, writable=writable)
    for dev in ("null", "zero", "urandom"):
        bind(root, f"/dev/{dev}", f"/dev/{dev}", writable=True, device=True)
    os.makedirs(root + "/tmp", exist_ok=True)
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(spec['tmp_mb'])}m,mode=1777")
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace only
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    os.chroot(".")


def enter_namespaces(spec: dict) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if spec["mode"] == "userns":
        uid, gid = os.getuid(), os.getgid()
        check(libc.unshare(CLONE_NEWUSER), "unshare(user)")
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
    check(libc.unshare(flags), "unshare(mount|net|pid|ipc|uts)")


def drop_and_exec(spec: dict) -> None:
    """In the final process: rlimits, uid drop, no_new_privs, parent-death signal, exec."""
    lim = spec["limits"]
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_size_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["num_procs"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["num_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if spec.get("uid") is not None:
        os.setgroups([])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")  # reset by setuid: set after
    os.chdir(spec["cwd"])
    if spec.get("landlock"):
        LANDLOCK.restrict_self(read=spec["landlock"]["read"], write=spec["landlock"]["write"])
    os.closerange(3, 65536)  # nothing of the orchestrator's (sockets, files, pipes) reaches the program
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def load_landlock():
    """landlock.py, loaded by path (this script runs without the project on sys.path) and before
    the uid drop (the sandbox uid may not read the orchestrator's interpreter or project)."""
    import importlib.util

    loc = importlib.util.spec_from_file_location("sandbox_landlock", os.path.join(os.path.dirname(__file__),
                                                                                 "landlock.py"))
    mod = importlib.util.module_from_spec(loc)
    loc.loader.exec_module(mod)
    return mod


def children() -> list:
    """Pids whose parent is this process (the program, and orphans re-parented to us)."""
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    return out


def kill_descendants() -> None:
    """SIGKILL every child until none is left (killing one re-parents its children to us)."""
    while True:
        for pid in children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def weak_main(spec: dict) -> None:
    """rlimits mode: a subreaper parent, so no process of the run outlives it."""
    global LANDLOCK
    LANDLOCK = load_landlock() if spec.get("landlock") else None
    check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(child_subreaper)")
    program = os.fork()
    if program == 0:
        try:
            drop_and_exec(spec)
        except BaseException as e:  # noqa: BLE001 - anything here means no sandbox
            fail(e)

    def on_term(*_):
        kill_descendants()
        os._exit(128 + signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_term)
    code = wait_status(program, reap_all=True)
    kill_descendants()  # daemons left behind by a finished program
    os._exit(code if code >= 0 else 128 - code)


def wait_status(pid: int, *, reap_all: bool) -> int:
    """Wait for ``pid`` (reaping every other child too when we are a PID-namespace init)."""
    while True:
        got, status = os.waitpid(-1 if reap_all else pid, 0)
        if got == pid:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def fail(e: BaseException) -> None:
    os.write(2, f"sandbox: setup failed: {type(e).__name__}: {e}\n".encode())
    os._exit(SETUP_FAILED)


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec["mode"] == "rlimits":
        try:
            weak_main(spec)
        except BaseException as e:  # noqa: BLE001 - anything here means no sandbox
            fail(e)
    try:
        enter_namespaces(spec)
    except BaseException as e:  # noqa: BLE001
        fail(e)
    init = os.fork()  # the first child of unshare(CLONE_NEWPID) is the namespace's init
    if init:
        signal.signal(signal.SIGTERM, lambda *_: os.kill(init, signal.SIGKILL))
        code = wait_status(init, reap_all=False)
        os._exit(code if code >= 0 else 128 - code)
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        build_root(spec)
        program = os.fork()
        if program == 0:
            drop_and_exec(spec)
    except BaseException as e:  # noqa: BLE001
        fail(e)
    # init: reap everything; when it exits, the kernel kills whatever is left in the namespace
    os._exit(wait_status(program, reap_all=True))


if __name__ == "__main__":
    main()
