"""Helpers shared by the benchmark scripts (which run as scripts, without the tests package)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
