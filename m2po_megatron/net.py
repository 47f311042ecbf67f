"""Small network helpers shared by the launcher, the trainer group and the weight sync."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` now (bind to port 0 and read it back)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
