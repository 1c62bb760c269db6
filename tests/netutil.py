"""Small helpers shared by tests that start real servers and process groups."""
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out on ``host`` (free now; tests bind it right away)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
