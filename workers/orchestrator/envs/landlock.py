"""Landlock for the sandbox's weak mode: what an unprivileged process can still take away from itself.

Why: without root and without user namespaces (``rlimits`` mode, sandbox_exec.py) the code
under test runs as the job user, who owns the run directory and its ``admin_token``; rlimits
and the runner's audit hook (Python only) do not stop ``subprocess.run(["cat", token])``.
Landlock (Linux >= 5.13, no privileges needed, inherited by every descendant, irrevocable)
does:

  ABI 1+  files: read/execute only below the interpreter's and the system's directories
          (``read``), read/write only below the episode's throwaway copy (``write``);
          everything else (the run directory, $HOME, other episodes) is EACCES
  ABI 4+  TCP: no connect and no bind at all (127.0.0.1 services included)
  ABI 6+  scope: no signal to a process outside the sandbox (the orchestrator, the
          trampoline) and no connect to abstract unix sockets created outside it

Not covered by any ABI: UDP and pathname unix sockets already open elsewhere (the file
rules stop reaching their paths). Stdlib only: sandbox_exec.py loads this file by path
just before exec, and sandbox.py imports :func:`abi` to log what applies.
"""
import ctypes
import os

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446  # the same on every architecture
CREATE_RULESET_VERSION, RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_ABI1 = (1 << 13) - 1  # execute .. make_sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is absent or disabled."""
    got = _libc.syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    return max(int(got), 0)


def protections(version: int) -> list:
    """What Landlock of ``version`` blocks in the weak mode (for the log and the docs)."""
    out = ["files outside the copy"] if version >= 1 else []
    out += ["tcp connect/bind"] if version >= 4 else []
    out += ["signals and abstract sockets outside"] if version >= 6 else []
    return out


def fs_rights(version: int) -> int:
    rights = FS_ABI1
    rights |= FS_REFER if version >= 2 else 0
    rights |= FS_TRUNCATE if version >= 3 else 0
    rights |= FS_IOCTL_DEV if version >= 5 else 0
    return rights


def restrict_self(*, read: list, write: list) -> int:
    """Restrict this process and its future children; returns the ABI used (0: none available).

    Needs ``no_new_privs`` already set (sandbox_exec.py does it). Paths that do not exist are
    skipped; a file path gets only the file rights (Landlock refuses directory rights on it).
    """
    version = abi()
    if version < 1:
        return 0
    handled = fs_rights(version)
    attr = RulesetAttr(handled_access_fs=handled,
                       handled_access_net=(NET_BIND_TCP | NET_CONNECT_TCP) if version >= 4 else 0,
                       scoped=(SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if version >= 6 else 0)
    size = 8 if version < 4 else 16 if version < 6 else 24
    ruleset = _libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    _check(ruleset, "landlock_create_ruleset")
    try:
        for paths, rights in ((read, READ), (write, handled)):
            for path in paths:
                _allow(int(ruleset), path, rights)
        _check(_libc.syscall(SYS_RESTRICT_SELF, ctypes.c_int(int(ruleset)), ctypes.c_uint32(0)),
               "landlock_restrict_self")
    finally:
        os.close(int(ruleset))
    return version


def _allow(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if not os.path.isdir(path):
            rights &= FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
        rule = PathBeneathAttr(allowed_access=rights, parent_fd=fd)
        _check(_libc.syscall(SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(RULE_PATH_BENEATH),
                             ctypes.byref(rule), ctypes.c_uint32(0)), f"landlock_add_rule({path})")
    finally:
        os.close(fd)


def _check(ret: int, what: str) -> None:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
