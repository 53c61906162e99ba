"""Free ports on 127.0.0.1 for the processes of a local run."""

from __future__ import annotations

import socket

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, and never one this process handed out before: a
    server given a port binds it only once it has loaded its model, and until then the OS
    would offer the same port again (a rollout server and the weight-sync store once drew
    the same one, and the store's EADDRINUSE ended the attempt)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
