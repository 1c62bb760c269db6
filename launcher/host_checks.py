"""Plan-time checks that only the launcher's machine can answer (paths, addresses, interpreters).

``build_plan`` is a pure function of the config; these look at this host instead: the run
directory and the runs root must be creatable directories on a real filesystem (not under
``/proc``, ``/sys`` or ``/dev``, not below a regular file, writable; never the filesystem root, and
a new run never goes into a non-empty directory that is not a run), and a local run's
``inference.host`` must be an address of this machine. Each failure is a :class:`HostCheckError`
naming the key, raised before anything is written (the CLI answers exit 2).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

from launcher.resources import PlanError

PSEUDO_FS = ("/proc", "/sys", "/dev")
"""Kernel pseudo filesystems: nothing of a run may live there (``/dev/shm`` excepted: a real tmpfs)."""


class HostCheckError(PlanError):
    """A path or value this machine cannot use; the message names the config key."""


def _under(path: Path, top: str) -> bool:
    return path == Path(top) or Path(top) in path.parents


def check_dir_usable(key: str, path: Path) -> None:
    """``path`` is (or can be created as) a writable directory: its nearest existing ancestor is a
    directory we may write to, and neither lies on a kernel pseudo filesystem."""
    path = Path(os.path.abspath(os.path.expanduser(str(path))))
    real = Path(os.path.realpath(path))
    for p in (path, real):
        if any(_under(p, top) for top in PSEUDO_FS) and not _under(p, "/dev/shm"):
            raise HostCheckError(f"{key}={str(path)!r} lies under {next(t for t in PSEUDO_FS if _under(p, t))}, a "
                                 f"kernel pseudo filesystem; choose a directory on a real filesystem")
    existing = real
    while not existing.exists() and not existing.is_symlink():
        existing = existing.parent
    if not existing.is_dir():
        what = "is" if existing == real else f"lies below {str(existing)!r}, which is"
        raise HostCheckError(f"{key}={str(path)!r} {what} not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise HostCheckError(f"{key}={str(path)!r}: {str(existing)!r} is not writable by this user")


def check_run_target(key: str, root: Path, runs_root: str, *, resume: bool) -> None:
    """The run directory may be written: ``cluster.runs_root`` is not ``/``; a new run's directory is new,
    empty, or already a run (refused later by name); a resumed one can be read and written."""
    if Path(os.path.realpath(os.path.expanduser(runs_root))) == Path("/"):
        raise HostCheckError(f"cluster.runs_root={runs_root!r} is the filesystem root: runs would be written "
                             f"straight into /; choose a directory for runs, e.g. cluster.runs_root=$HOME/runs")
    try:
        if resume:
            with open(root / "config" / "run.yaml", "rb"):
                pass
            probe = root / f".slurmrl-write-probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        elif root.is_dir() and not (root / "config" / "run.yaml").exists() and any(root.iterdir()):
            raise HostCheckError(f"{key}={str(root)!r} is a non-empty directory that is not a run: slurmrl would "
                                 f"write config/, logs/ and weights/ among what is there; choose a new or empty "
                                 f"directory")
    except OSError as e:
        raise HostCheckError(f"{key}={str(root)!r} cannot be {'read and written' if resume else 'read'}: "
                             f"{e.strerror or e} (check its permissions for this user)") from None


def check_bind_host(key: str, host: str) -> None:
    """``host`` resolves to an IPv4 address of this machine (the local servers bind to it). IPv6 is refused
    here: the roles' URLs, ports and process groups are IPv4 (``::1`` passed the plan, then every role
    failed to bind or to parse its URL)."""
    if ":" in host:
        raise HostCheckError(f"{key}={host!r} is an IPv6 address; local runs use IPv4: 127.0.0.1 or this "
                             f"machine's name")
    try:
        infos = socket.getaddrinfo(host, 0, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise HostCheckError(f"{key}={host!r} does not resolve here ({e}); use 127.0.0.1 or this "
                             f"machine's name") from None
    errors = []
    for family, kind, proto, _canon, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(addr[:2] if family == socket.AF_INET else addr)
                return
        except OSError as e:
            errors.append(f"{addr[0]}: {e.strerror or e}")
    raise HostCheckError(f"{key}={host!r} is not an address of this machine (cannot bind: {'; '.join(errors)}); "
                         f"use 127.0.0.1 or this machine's name")

