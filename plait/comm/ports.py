"""A free TCP port on this machine, for a rendezvous or store that this process is about to host."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the operating system has just found free on 127.0.0.1 (another process may still
    take it before the caller binds it; the launchers that use it bind at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
