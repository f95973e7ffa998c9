"""A free TCP port, for the servers and process groups rollflow starts. Standard library only, so every layer may
import it."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now (the OS picks it; ``""``: free on every interface of this node)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
