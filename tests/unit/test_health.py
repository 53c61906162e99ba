"""The operator's liveness endpoint: 200 while beats come, 503 naming how long and what beat
last once they stop (a stuck kopf loop stops the leader's beats)."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

from rlhf_operator.health import Heartbeat, serve


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_healthz_fails_once_the_beats_stop_and_recovers_when_they_resume():
    heartbeat, port = Heartbeat(stale_after_s=0.5), _port()
    server = serve(port, heartbeat)
    try:
        heartbeat.beat("leading (kopf's event loop)")
        assert _get(port, "/healthz") == (200, _get(port, "/healthz")[1])
        assert _get(port, "/healthz")[1].startswith("ok: leading")
        time.sleep(0.7)  # no beat: the loop is stuck
        code, text = _get(port, "/healthz")
        assert code == 503 and text.startswith("stuck: no progress for") and "last: leading" in text
        assert _get(port, "/readyz")[0] == 200  # readiness is not liveness
        heartbeat.beat("waiting for the leader lease")
        assert _get(port, "/healthz")[0] == 200
        assert _get(port, "/nope")[0] == 404
    finally:
        server.shutdown()
    assert serve(0, heartbeat) is None
