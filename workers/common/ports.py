"""A free TCP port for a server or a process group this process is about to start (torch-free)."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out on ``host`` (free now; the caller binds it right away)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
