"""``python -m workers.inference.sglang.keyed MODULE ARG...``: run MODULE with ``--api-key`` added in memory.

Why: the run's admin token guards SGLang's admin routes (pause, weight updates) and smg's
calls to the workers. On a command line (``--api-key <token>``) every user of the node sees
it in ``ps`` (/proc/<pid>/cmdline is world-readable). Neither pinned program reads the key
from elsewhere: SGLang 0.5.23 has no environment variable for ``--api-key`` (it does accept
``--config file.yaml``, which would need a second copy of the secret on disk), and smg
1.13.0 has no environment variable or config file for it at all (its only env defaults are
the ATP_/POSTGRES_/REDIS_ storage settings). So server.py and router.py exec into this
wrapper instead, with ``SLURMRL_API_KEY_FILE`` naming the run's ``admin_token`` (mode 600,
the job user's). The wrapper reads it, refuses a file others could read, appends
``--api-key TOKEN`` to ``sys.argv`` (Python's argv list, not the process's cmdline), and
runs MODULE as ``__main__`` in this very process (``runpy``; the same thing ``python -m``
does), so Slurm's signals still reach SGLang / smg directly and their spawned children
(multiprocessing ``spawn``) get their arguments through pipes, never through argv.
"""
from __future__ import annotations

import os
import runpy
import stat
import sys

KEY_FILE_ENV = "SLURMRL_API_KEY_FILE"
MODULE = "workers.inference.sglang.keyed"


def wrap(argv: list[str]) -> list[str]:
    """``[python, -m, MODULE, ARG...]`` -> the same program run through this wrapper."""
    if argv[1:2] != ["-m"]:
        raise ValueError(f"expected 'python -m MODULE ...', got {argv[:3]}")
    return [argv[0], "-m", MODULE, *argv[2:]]


def with_key(args: list[str], token: str) -> list[str]:
    """The argument list the program parses (in memory only)."""
    return [*args, "--api-key", token]


def read_private(path: str) -> str:
    """The token in ``path``, which must be a regular file of ours that nobody else can read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path} must be a regular file owned by uid {os.geteuid()} with mode 600 "
                                  f"(is uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): it holds the admin token")
        token = os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)
    if not token:
        raise ValueError(f"{path} is empty: no admin token")
    return token


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(f"usage: python -m {MODULE} MODULE [ARG...]  (with {KEY_FILE_ENV}=<run_dir>/admin_token)")
    path = os.environ.pop(KEY_FILE_ENV, "")
    if not path:
        sys.exit(f"{MODULE}: {KEY_FILE_ENV} is not set; it names the run's admin_token file")
    try:
        token = read_private(path)
    except (OSError, ValueError) as e:
        sys.exit(f"{MODULE}: {e}")
    module = sys.argv[1]
    sys.argv = [module, *with_key(sys.argv[2:], token)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
