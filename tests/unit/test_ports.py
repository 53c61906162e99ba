"""Local mode's ports: a port handed out is never handed out again by the same process, even
before whoever got it binds it (the rollout servers bind theirs only once loaded)."""

from __future__ import annotations

import socket

from rlhf_launcher.ports import free_port


def test_no_port_is_handed_out_twice_before_it_is_bound():
    ports = [free_port() for _ in range(2000)]  # ~28k ephemeral ports: unchecked, ~70 repeats expected
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:  # and each was free when handed out
        s.bind(("127.0.0.1", ports[-1]))
